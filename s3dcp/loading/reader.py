"""S3StorageReader: DCP's StorageReader over S3.

    .metadata ──decode (JSON, never pickle)──► Metadata ──DCP planner──► ReadItems for this rank
    ReadItems ──byte ranges per object, neighbours coalesced──► parallel ranged GETs
        ├─ whole item (or one run of an item with nothing to verify), CPU contiguous destination
        │  of the stored dtype: bytes land in the tensor
        └─ otherwise (part of an item, other dtype/device): the box's byte ranges (layout.box_pieces)
           land in slots of a bounded bounce window (bounce.py), taken as GETs are issued and
           reused once copied out, so bounce memory stays at
           ~download_part_size_bytes × max_concurrency whatever the state's size
    every fetched item or block ──checksum──► verified as its GET ends, while others are in flight
"""

from __future__ import annotations

import io
import logging
import os
import queue
import random
import re
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future as TorchFuture

from . import bounce
from ..format import integrity, layout
from ..s3.client import S3Client
from ..s3.request import abort_all, abort_and_wait
from ..config import S3Config
from ..errors import (
    CheckpointNotFoundError,
    IncompleteCheckpointError,
    IntegrityError,
    MetadataFormatError,
    NoSuchKeyError,
    S3ConnectionError,
    S3DCPError,
    S3ServerError,
    ThrottlingError,
    UnsafePickleError,
)
from ..format.layout import METADATA_NAME, ItemLocation, Piece, Segment, is_data_object
from ..format.metadata import decode_metadata, str_to_dtype
from ..memory.pool import HostBufferPool
from ..s3.location import S3CheckpointPath, UnreadableMetadata
from ..format.tensors import byte_view, has_lazy_bits
from ..uri import object_key

__all__ = ["S3StorageReader"]

log = logging.getLogger("s3dcp")

_MAX_RUN_BYTES = 1 << 30  # one coalesced GET at most; the CRT splits it into parallel parts anyway
_METADATA_ATTEMPTS = 4  # reads of .metadata, each with the CRT's own retries inside
_METADATA_BACKOFF_S = 0.2
_MIN_SLOT_BYTES = 1 << 20
_HEAD_BYTES_ITEM_ABOVE = 1 << 20  # a non-tensor item larger than this is checked against its object first


@dataclass
class _Read:
    """One ReadItem's plan: which stored bytes to fetch, where they land, how to check them.

    Direct (``pieces is None``): bytes ``[start, end)`` of the item land in ``sink`` (the
    destination tensor's memory, or ``bounce``, a bytearray for a non-tensor item). Otherwise
    each of ``pieces`` is fetched into a bounce slot and copied into its part of ``dest``;
    the item is committed when the last piece's copy is done."""

    item: ReadItem
    location: ItemLocation
    start: int  # byte range fetched, relative to the item (direct reads)
    end: int
    sink: memoryview | None  # where the fetched bytes land (direct reads)
    dest: torch.Tensor | None = None  # tensor items: the planner's destination
    bounce: Any = None  # non-tensor items: the buffer their bytes land in
    pieces: list[Piece] | None = None  # bounced reads: the byte ranges of the box, in order
    left: int = 0  # pieces not yet copied out
    tokens: list = field(default_factory=list)  # copies of this item still running


class S3StorageReader(S3CheckpointPath, StorageReader):
    """Reads a DCP checkpoint from ``s3://bucket/prefix``.

    Call order, as :func:`torch.distributed.checkpoint.load` makes it:

    0. ``reset(checkpoint_id)`` — all ranks, only when ``checkpoint_id=`` is passed to load
    1. ``read_metadata()`` — all ranks; refuses an incomplete checkpoint (no metadata object)
    2. ``set_up_storage_reader(metadata, is_coordinator)`` — all ranks
    3. ``prepare_local_plan`` — all ranks; 4. ``prepare_global_plan`` — coordinator
    5. ``read_data(plan, planner)`` — all ranks: parallel ranged GETs straight into the
       destination tensors where possible, every item verified against its checksum

    Args:
        path: ``s3://bucket/prefix``; may instead come as ``checkpoint_id=`` to ``dcp.load``.
        config: :class:`S3Config`; default: resolved from the environment.
        client: an :class:`s3dcp.s3.client.S3Client` to use.
        verify: check every item's checksum (default True).
        allow_pickle: DCP stores non-tensor values (ints, strings, lists...) with
            ``torch.save`` and its default planner unpickles them with ``weights_only=False``,
            which can run code. By default the reader first checks each such item loads with
            ``weights_only=True`` (plain data only) and refuses the checkpoint otherwise; pass
            True for checkpoints you trust that hold other Python objects.
        pool: the :class:`s3dcp.memory.pool.HostBufferPool` the bounce window comes from (items that
            cannot land in their destination directly); default: a process-wide pool of its
            own, pinned when CUDA is available (``s3dcp.loading.bounce.read_pool()``).
    """

    def __init__(
        self,
        path: str | None = None,
        *,
        config: S3Config | None = None,
        client: S3Client | None = None,
        verify: bool = True,
        allow_pickle: bool = False,
        pool: HostBufferPool | None = None,
    ) -> None:
        super().__init__()
        self._init_path(path, config, client)
        self.verify = verify
        self.allow_pickle = allow_pickle
        self._bounce_pool = pool
        self._storage_data: dict[MetadataIndex, ItemLocation] = {}
        self.last_read_s = 0.0
        self.last_read_bytes = 0

    def __repr__(self) -> str:
        return f"S3StorageReader({self.checkpoint_id!r})"

    # ------------------------------------------------------------------ StorageReader
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self._reset_path(checkpoint_id)
        self._storage_data = {}

    def read_metadata(self) -> Metadata:
        """DCP's hook, on every rank. Never raises: a failure comes back inside the returned
        object and is raised, typed, by :meth:`set_up_storage_reader` (or by the planner's first
        look at the metadata) on that rank.

        Why: DCP turns any exception from ``read_metadata`` into ``AssertionError("metadata is
        None ...")``, and when the signature takes ``**kwargs`` it retries that one rank with
        rank-local metadata *and switches that rank alone from collectives to a barrier*, which
        hangs the others. Raised later, inside the same step on every rank, the error travels
        through DCP's collective to every rank as itself (``CheckpointException.failures``).
        Use :meth:`fetch_metadata` to read the metadata yourself.
        """
        try:
            return self.fetch_metadata()
        except Exception as e:  # noqa: BLE001 - raised again, typed, in set_up_storage_reader
            return UnreadableMetadata(e)

    def fetch_metadata(self) -> Metadata:
        """The checkpoint's metadata, or a typed error: :class:`IncompleteCheckpointError`
        (data but no commit marker), :class:`CheckpointNotFoundError`, S3 errors, or
        :class:`MetadataFormatError`. Throttling, 5xx answers and dropped connections are
        retried (beyond the CRT's own retries) before giving up."""
        uri = self._require_uri()
        source = str(uri.child(METADATA_NAME))
        try:
            raw = self._get_with_retries(uri.bucket, uri.key(METADATA_NAME))
        except NoSuchKeyError as e:
            objects, _ = self.client.list(uri.bucket, uri.dir_prefix, delimiter="/").result()
            data = [o for o in objects if is_data_object(o.key.rpartition("/")[2])]
            if data:
                raise IncompleteCheckpointError(
                    f"{uri} is incomplete: {len(data)} data object(s) but no {METADATA_NAME} (the commit "
                    "marker, written last). The save that wrote it failed or is still running; load an "
                    "earlier checkpoint, and run `s3dcp gc` to remove the leftovers") from e
            raise CheckpointNotFoundError(f"no checkpoint at {uri} (no {METADATA_NAME} and no data objects)") from e
        metadata = decode_metadata(raw, source=source)
        if metadata.storage_data is None:
            metadata.storage_data = {}
        # A v2 checkpoint's storage_data is a LazyStorageData that only ever builds ItemLocations,
        # one per lookup; walking it here would build all of them (every rank's items) on every rank.
        if isinstance(metadata.storage_data, dict):
            for index, location in metadata.storage_data.items():
                if not isinstance(location, ItemLocation):
                    raise MetadataFormatError(f"{source}: storage entry for {index.fqn!r} is not an s3dcp location")
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = os.urandom(8).hex()
        return metadata

    def _get_with_retries(self, bucket: str, key: str) -> bytes:
        for attempt in range(_METADATA_ATTEMPTS):
            try:
                return self.client.get(bucket, key).result()
            except (ThrottlingError, S3ServerError, S3ConnectionError) as e:
                if attempt + 1 == _METADATA_ATTEMPTS:
                    raise
                delay = min(_METADATA_BACKOFF_S * 2 ** attempt, 5.0) * (0.5 + random.random() / 2)
                log.info("reading s3://%s/%s failed (%s); retrying in %.2f s", bucket, key, type(e).__name__, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if isinstance(metadata, UnreadableMetadata):
            raise metadata.error
        self._storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> TorchFuture[None]:
        start = time.perf_counter()
        uri = self._require_uri()
        slot_bytes, slots = self._window_shape()
        reads = [self._plan_read(item, planner, slot_bytes) for item in plan.items]

        direct: dict[str, list[Segment]] = {}
        bounced: dict[str, list[Segment]] = {}
        for read in reads:
            loc = read.location
            if read.pieces is None:
                direct.setdefault(loc.object_name, []).append(
                    Segment(loc.offset + read.start, read.end - read.start, read))
            elif not read.pieces:  # an empty box: nothing to fetch
                planner.commit_tensor(read.item, read.dest)
            for piece in read.pieces or ():
                bounced.setdefault(loc.object_name, []).append(
                    Segment(loc.offset + piece.start, piece.end - piece.start, (read, piece)))
        gap = self.config.coalesce_gap_bytes
        direct_runs = [(name, run) for name, segs in direct.items()
                       for run in layout.coalesce(segs, gap, _MAX_RUN_BYTES)]
        largest = max((seg.length for segs in bounced.values() for seg in segs), default=0)
        if largest > slot_bytes:  # pieces are at least two checksum blocks
            slot_bytes, slots = largest, max(2, slot_bytes * slots // largest)
        bounce_runs = [(name, run) for name, segs in bounced.items()
                       for run in layout.coalesce(segs, gap, slot_bytes)]
        if bounce_runs:  # a window no larger than the load needs (a few small casts: a few MiB)
            slot_bytes = max(max(seg.end for seg in run) - run[0].offset for _, run in bounce_runs)
            slots = min(slots, len(bounce_runs))
        self._fetch(uri, direct_runs, bounce_runs, slot_bytes, slots, planner)
        self.last_read_s = time.perf_counter() - start
        self.last_read_bytes = sum(max(seg.end for seg in run) - run[0].offset
                                   for _, run in direct_runs + bounce_runs)
        fut: TorchFuture = TorchFuture()
        fut.set_result(None)
        return fut

    def _window_shape(self) -> tuple[int, int]:
        """(slot bytes, slots) of the bounce window: ``download_part_size_bytes ×
        max_concurrency`` in all (what the GETs keep in flight anyway), in four slots."""
        window = self.config.download_part_size_bytes * self.config.max_concurrency
        slot = max(_MIN_SLOT_BYTES, window // 4)
        return slot, max(2, window // slot)

    def _fetch(self, uri, direct_runs: list, bounce_runs: list, slot_bytes: int, slots: int,
               planner: LoadPlanner) -> None:
        """Issue every direct GET, and bounced GETs as slots free up; finish each run (verify,
        copy out, commit) on this thread as its GET ends, while the others are in flight. On
        the first error nothing more is issued and the GETs in flight are aborted; they are
        waited for (they write into the window and the destinations) before it is raised. An
        interrupt (Ctrl-C) does the same."""
        ended: queue.SimpleQueue = queue.SimpleQueue()
        in_flight: set = set()  # the GETs not yet taken from `ended`

        def issue(name: str, run: list[Segment], slot: torch.Tensor | None) -> None:
            run_start, run_end = run[0].offset, max(seg.end for seg in run)
            if slot is None:
                sinks = [(seg.offset, seg.tag.sink) for seg in run]
            else:
                sinks = [(run_start, byte_view(slot[:run_end - run_start]))]
            future = self.client.get_scatter(uri.bucket, object_key(uri, name), run_start, run_end, sinks)
            in_flight.add(future)
            future.add_done_callback(lambda f: ended.put((run, slot, f)))

        pending = deque(bounce_runs)
        window = bounce.BounceWindow(slot_bytes, slots, self._pool, bounce.DeviceCopier()) if pending else None
        error: BaseException | None = None
        try:
            for name, run in direct_runs:
                issue(name, run, None)
            while in_flight or pending:
                while pending and error is None:
                    slot = window.take()
                    if slot is None:
                        break
                    issue(*pending.popleft(), slot)
                if error is not None:
                    pending.clear()
                if not in_flight:
                    if pending:
                        window.wait_draining()  # every slot is being copied out of
                    continue
                run, slot, f = ended.get()
                in_flight.discard(f)
                tokens: list = []
                try:
                    if error is None:
                        if f.exception() is not None:
                            raise self._read_error(run, f.exception())
                        if slot is None:
                            for seg in run:
                                self._finish_read(seg.tag, planner)
                        else:
                            for seg in run:
                                lo = seg.offset - run[0].offset
                                self._finish_piece(*seg.tag, slot[lo:lo + seg.length], window.copier,
                                                   tokens, planner)
                except BaseException as e:  # noqa: BLE001 - raised once the GETs in flight end
                    error = e
                    abort_all(in_flight)
                finally:
                    if slot is not None:
                        window.give(slot, tokens)
        except BaseException:  # an interrupt while GETs write into the window and the destinations
            abort_and_wait(in_flight)
            raise
        finally:
            if window is not None:
                window.close()
        if error is not None:
            raise error

    @property
    def _pool(self) -> HostBufferPool:
        return self._bounce_pool if self._bounce_pool is not None else bounce.read_pool()

    # ------------------------------------------------------------------ helpers
    def _location(self, item: ReadItem) -> ItemLocation:
        try:
            return self._storage_data[item.storage_index]
        except KeyError:
            raise MetadataFormatError(
                f"{self._uri}: the metadata has no stored location for {item.storage_index.fqn!r} "
                f"(chunk at {tuple(item.storage_index.offset or ())})") from None

    def _where(self, item: ReadItem) -> str:
        return f"{self._uri}: item {item.storage_index.fqn!r} (chunk at {tuple(item.storage_index.offset or ())})"

    def _read_error(self, run: list[Segment], error: BaseException) -> BaseException:
        """A GET that found its object shorter than the metadata says (a short body, or 416):
        an IntegrityError naming the first item past the object's end; else ``error``."""
        if not isinstance(error, IntegrityError) and getattr(error, "status", None) != 416:
            return error
        reads = [seg.tag if isinstance(seg.tag, _Read) else seg.tag[0] for seg in run]
        key = object_key(self._uri, reads[0].location.object_name)
        try:
            size = self.client.head(self._uri.bucket, key).result().size
            for read in reads:
                layout.check_in_object(read.location, size, self._where(read.item))
        except MetadataFormatError as e:  # which of the object and the metadata is wrong, no one can tell
            named = IntegrityError(str(e))
            named.__cause__ = error
            return named
        except S3DCPError:
            pass
        return error

    def _plan_read(self, item: ReadItem, planner: LoadPlanner, slot_bytes: int) -> _Read:
        loc = self._location(item)
        where = self._where(item)
        if item.type == LoadItemType.BYTE_IO:
            layout.check_location(loc, None, where)
            if loc.length > _HEAD_BYTES_ITEM_ABOVE:  # memory is filled only for bytes the object holds
                size = self.client.head(self._uri.bucket, object_key(self._uri, loc.object_name)).result().size
                layout.check_in_object(loc, size, where)
            buf = bytearray(loc.length)
            return _Read(item, loc, 0, loc.length, memoryview(buf), bounce=buf)

        dest = planner.resolve_tensor(item).detach()
        dtype = str_to_dtype(loc.dtype)
        layout.check_location(loc, dtype.itemsize, where)
        shape = tuple(loc.shape)
        offsets, lengths = tuple(item.storage_offsets), tuple(item.lengths)
        layout.check_box(shape, offsets, lengths, where)
        if tuple(dest.shape) != lengths:
            raise MetadataFormatError(
                f"{self._uri}: {item.dest_index.fqn!r}: destination shape {tuple(dest.shape)} does not match "
                f"the {lengths} elements planned from the checkpoint")
        in_place = (dest.device.type == "cpu" and dest.is_contiguous() and dest.dtype == dtype
                    and not has_lazy_bits(dest))  # a conj view takes its values through copy_
        whole = all(o == 0 for o in offsets) and lengths == shape
        if whole and in_place:
            return _Read(item, loc, 0, loc.length, byte_view(dest), dest=dest)
        checked = self.verify and loc.checksum is not None
        if in_place and not checked and layout.is_contiguous_box(shape, offsets, lengths):
            # One run of the item's bytes (rows of a Shard(0) load) with nothing to verify: no
            # block widening needed, so the run lands in the destination too.
            lo, hi = layout.box_byte_range(shape, dtype.itemsize, offsets, lengths)
            if hi > lo:
                return _Read(item, loc, lo, hi, byte_view(dest), dest=dest)

        # Only the box's bytes, in pieces that fit a bounce slot, widened to checksum blocks
        # (the whole item when it has one checksum) so every fetched byte can be verified.
        pieces = layout.box_pieces(
            shape, dtype.itemsize, offsets, lengths, item_bytes=loc.length,
            block_bytes=(loc.block_size or loc.length) if checked else 0,
            gap_bytes=self.config.coalesce_gap_bytes, max_bytes=slot_bytes, flat=dest.is_contiguous())
        return _Read(item, loc, 0, 0, None, dest=dest, pieces=pieces, left=len(pieces))

    def _finish_read(self, read: _Read, planner: LoadPlanner) -> None:
        """A direct read's bytes are all there: verify, hand to the planner."""
        if self.verify:
            self._verify(read, read.start, read.sink)
        item = read.item
        if item.type == LoadItemType.BYTE_IO:
            if not self.allow_pickle:
                self._check_plain_data(read)
            planner.load_bytes(item, io.BytesIO(read.bounce))
            return
        planner.commit_tensor(item, read.dest)

    def _finish_piece(self, read: _Read, piece: Piece, fetched: torch.Tensor, copier, tokens: list,
                      planner: LoadPlanner) -> None:
        """One piece of a bounced read is in ``fetched`` (a slot's uint8 view): verify its
        blocks, start the copy into its part of the destination, and commit the item once its
        last piece is copied. The copy's token goes into ``tokens`` (the slot's)."""
        if self.verify:
            self._verify(read, piece.start, byte_view(fetched))
        dtype = str_to_dtype(read.location.dtype)
        size = dtype.itemsize
        if fetched.storage_offset() % size:  # the item starts unaligned in its object
            fetched = fetched.clone()
        elems = fetched[:fetched.numel() // size * size].view(dtype)
        src = elems.as_strided(piece.sizes, piece.strides, elems.storage_offset() + piece.src_offset)
        target = read.dest.view(-1) if piece.flat else read.dest
        for i in piece.index:
            target = target[i]
        token = copier.copy(target.narrow(0, piece.first, piece.count), src)
        tokens.append(token)
        read.tokens.append(token)
        read.left -= 1
        if read.left == 0:
            for t in read.tokens:
                copier.wait(t)
            read.tokens = []
            planner.commit_tensor(read.item, read.dest)

    def _check_plain_data(self, read: _Read) -> None:
        """Refuse a non-tensor item that is more than plain data before the planner unpickles it."""
        try:
            torch.load(io.BytesIO(read.bounce), weights_only=True)
        except Exception as e:  # noqa: BLE001 - whatever the unpickler refused
            text = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).strip()  # torch colours its message
            reason = text.splitlines()[0] if text else type(e).__name__
            raise UnsafePickleError(
                f"{self._uri}: item {read.item.storage_index.fqn!r} holds pickled Python objects beyond plain "
                f"data ({reason[:200]}); unpickling it could run code. If you trust this checkpoint, pass "
                "allow_pickle=True to S3StorageReader") from e

    def _verify(self, read: _Read, start: int, view: memoryview) -> None:
        """Check bytes ``start..`` of the item (``start`` 0 or on a block boundary)."""
        loc = read.location
        if loc.checksum is None:
            return
        check = integrity.ItemCheck(loc, start).feed_all(view)
        if check.ok:
            return
        if check.bad_blocks:
            b = check.bad_blocks[0]
            lo, hi = b * loc.block_size, min(loc.length, (b + 1) * loc.block_size)
            where, expected, got = f"bytes {lo}-{hi} of ", loc.block_checksums[b], check.block_got[b]
        else:
            where, expected, got = "", loc.checksum, check.got
        raise IntegrityError(
            f"checksum mismatch in s3://{self._uri.bucket}/{object_key(self._uri, loc.object_name)} for item "
            f"{read.item.storage_index.fqn!r} (chunk at {tuple(read.item.storage_index.offset or ())}, "
            f"{where}object bytes {loc.offset}-{loc.offset + loc.length}): expected {expected}, "
            f"got {got}. The object was corrupted or overwritten; restore from another checkpoint")
