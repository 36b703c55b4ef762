"""S3StorageReader: DCP's StorageReader over S3.

    .metadata ──decode (JSON, never pickle)──► Metadata ──DCP planner──► ReadItems for this rank
    ReadItems ──byte ranges per object, neighbours coalesced──► parallel ranged GETs
        ├─ whole item, CPU contiguous destination of the stored dtype: bytes land in the tensor
        └─ otherwise (part of an item, other dtype/device): a bounce buffer, then copy_
    every fetched item or block ──checksum──► verified before the planner sees it
"""

from __future__ import annotations

import io
import logging
import math
import os
import random
import re
import time
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future as TorchFuture

from . import integrity, layout
from .client import S3Client
from .config import S3Config
from .errors import (
    CheckpointNotFoundError,
    IncompleteCheckpointError,
    IntegrityError,
    MetadataFormatError,
    NoSuchKeyError,
    S3ConnectionError,
    S3ServerError,
    ThrottlingError,
    UnsafePickleError,
)
from .layout import METADATA_NAME, ItemLocation, Segment, is_data_object
from .metadata import decode_metadata, str_to_dtype
from .storage import S3CheckpointPath, UnreadableMetadata
from .tensors import byte_view
from .uri import object_key

__all__ = ["S3StorageReader"]

log = logging.getLogger("s3dcp")

_MAX_RUN_BYTES = 1 << 30  # one coalesced GET at most; the CRT splits it into parallel parts anyway
_METADATA_ATTEMPTS = 4  # reads of .metadata, each with the CRT's own retries inside
_METADATA_BACKOFF_S = 0.2




@dataclass
class _Read:
    """One ReadItem's plan: which stored bytes to fetch, where they land, how to check them."""

    item: ReadItem
    location: ItemLocation
    start: int  # byte range fetched, relative to the item
    end: int
    sink: memoryview  # where the fetched bytes land
    dest: torch.Tensor | None = None  # tensor items: the planner's destination
    bounce: Any = None  # the bounce buffer, when the bytes do not land in dest directly


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
        client: an :class:`s3dcp.client.S3Client` to use.
        verify: check every item's checksum (default True).
        allow_pickle: DCP stores non-tensor values (ints, strings, lists...) with
            ``torch.save`` and its default planner unpickles them with ``weights_only=False``,
            which can run code. By default the reader first checks each such item loads with
            ``weights_only=True`` (plain data only) and refuses the checkpoint otherwise; pass
            True for checkpoints you trust that hold other Python objects.
    """

    def __init__(
        self,
        path: str | None = None,
        *,
        config: S3Config | None = None,
        client: S3Client | None = None,
        verify: bool = True,
        allow_pickle: bool = False,
    ) -> None:
        super().__init__()
        self._init_path(path, config, client)
        self.verify = verify
        self.allow_pickle = allow_pickle
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
        reads = [self._plan_read(item, planner) for item in plan.items]

        by_object: dict[str, list[Segment]] = {}
        for read in reads:
            loc = read.location
            by_object.setdefault(loc.object_name, []).append(
                Segment(loc.offset + read.start, read.end - read.start, read))
        futures: list[Future] = []
        total = 0
        for name, segments in by_object.items():
            for run in layout.coalesce(segments, self.config.coalesce_gap_bytes, _MAX_RUN_BYTES):
                sinks = [(seg.offset, seg.tag.sink) for seg in run]
                run_start, run_end = run[0].offset, max(seg.end for seg in run)
                total += run_end - run_start
                futures.append(self.client.get_scatter(uri.bucket, object_key(uri, name), run_start, run_end, sinks))
        wait(futures)
        for f in futures:
            if f.exception() is not None:
                raise f.exception()

        for read in reads:
            self._finish_read(read, planner)
        self.last_read_s = time.perf_counter() - start
        self.last_read_bytes = total
        fut: TorchFuture = TorchFuture()
        fut.set_result(None)
        return fut

    # ------------------------------------------------------------------ helpers
    def _location(self, item: ReadItem) -> ItemLocation:
        try:
            return self._storage_data[item.storage_index]
        except KeyError:
            raise MetadataFormatError(
                f"{self._uri}: the metadata has no stored location for {item.storage_index.fqn!r} "
                f"(chunk at {tuple(item.storage_index.offset or ())})") from None

    def _plan_read(self, item: ReadItem, planner: LoadPlanner) -> _Read:
        loc = self._location(item)
        if item.type == LoadItemType.BYTE_IO:
            buf = bytearray(loc.length)
            return _Read(item, loc, 0, loc.length, memoryview(buf), bounce=buf)

        dest = planner.resolve_tensor(item).detach()
        shape = tuple(loc.shape or ())
        dtype = str_to_dtype(loc.dtype)
        offsets, lengths = tuple(item.storage_offsets), tuple(item.lengths)
        if tuple(dest.shape) != lengths:
            raise MetadataFormatError(
                f"{self._uri}: {item.dest_index.fqn!r}: destination shape {tuple(dest.shape)} does not match "
                f"the {lengths} elements planned from the checkpoint")
        whole = all(o == 0 for o in offsets) and lengths == shape
        if whole and dest.device.type == "cpu" and dest.is_contiguous() and dest.dtype == dtype:
            return _Read(item, loc, 0, loc.length, byte_view(dest), dest=dest)

        # Fetch whole rows of the leading dim (all DCP shardings split there), widened to
        # checksum-block boundaries so every fetched byte can be verified.
        itemsize = dtype.itemsize
        if shape:
            row_bytes = math.prod(shape[1:]) * itemsize
            start, end = offsets[0] * row_bytes, (offsets[0] + lengths[0]) * row_bytes
        else:
            start, end = 0, itemsize
        start, end = _widen_to_blocks(loc, start, end)
        bounce = torch.empty(end - start, dtype=torch.uint8)
        return _Read(item, loc, start, end, byte_view(bounce), dest=dest, bounce=bounce)

    def _finish_read(self, read: _Read, planner: LoadPlanner) -> None:
        if self.verify:
            self._verify(read)
        item, loc = read.item, read.location
        if item.type == LoadItemType.BYTE_IO:
            if not self.allow_pickle:
                self._check_plain_data(read)
            planner.load_bytes(item, io.BytesIO(read.bounce))
            return
        if read.bounce is not None:
            shape = tuple(loc.shape or ())
            dtype = str_to_dtype(loc.dtype)
            if shape:
                row_bytes = math.prod(shape[1:]) * dtype.itemsize
                first = item.storage_offsets[0] * row_bytes - read.start
                rows = read.bounce[first:first + item.lengths[0] * row_bytes]
                src = rows.view(dtype).reshape(item.lengths[0], *shape[1:])
                for dim in range(1, len(shape)):
                    src = src.narrow(dim, item.storage_offsets[dim], item.lengths[dim])
            else:
                src = read.bounce[:dtype.itemsize].view(dtype).reshape(())
            read.dest.copy_(src)
        planner.commit_tensor(item, read.dest)

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

    def _verify(self, read: _Read) -> None:
        loc = read.location
        if loc.checksum is None:
            return
        check = integrity.ItemCheck(loc, read.start).feed_all(read.sink)
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


def _widen_to_blocks(loc: ItemLocation, start: int, end: int) -> tuple[int, int]:
    """Widen ``[start, end)`` (bytes of the item) to the checksummed units covering it:
    whole blocks when the item has them, else the whole item."""
    if loc.checksum is None:
        return start, end
    if not loc.block_size:
        return 0, loc.length
    return (start // loc.block_size) * loc.block_size, min(loc.length, -(-end // loc.block_size) * loc.block_size)
