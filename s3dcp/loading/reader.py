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

import logging
import os
import queue
from collections import deque
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future as TorchFuture

from ..config import S3Config
from ..errors import MetadataFormatError
from ..format import layout
from ..format.layout import METADATA_NAME, ItemLocation, Segment
from ..format.metadata import decode_metadata, validate_metadata
from ..format.tensors import byte_view
from ..memory.pool import HostBufferPool
from ..s3.client import S3Client
from ..s3.location import S3CheckpointPath, UnreadableMetadata
from ..s3.request import abort_all, abort_and_wait
from ..uri import object_key
from . import bounce, exchange
from .cooperative import DEFAULT_WINDOW_BYTES
from .exchange import LoadStats
from .fetch import fetch_metadata_bytes
from .items import ItemReads

__all__ = ["S3StorageReader"]

log = logging.getLogger("s3dcp")

_MAX_RUN_BYTES = 1 << 30  # one coalesced GET at most; the CRT splits it into parallel parts anyway
_MIN_SLOT_BYTES = 1 << 20


class S3StorageReader(S3CheckpointPath, StorageReader):
    """Reads a DCP checkpoint from ``s3://bucket/prefix``.

    Call order, as :func:`torch.distributed.checkpoint.load` makes it:

    0. ``reset(checkpoint_id)`` — all ranks, only when ``checkpoint_id=`` is passed to load
    1. ``read_metadata()`` — all ranks; refuses an incomplete checkpoint (no metadata object)
    2. ``set_up_storage_reader(metadata, is_coordinator)`` — all ranks
    3. ``prepare_local_plan`` — all ranks; 4. ``prepare_global_plan`` — coordinator (cooperative:
       one reading rank per distinct stored range, :mod:`s3dcp.loading.cooperative`)
    5. ``read_data(plan, planner)`` — all ranks: parallel ranged GETs straight into the
       destination tensors where possible, every item verified against its checksum
       (cooperative: GETs of this rank's ranges, then the exchange, :mod:`s3dcp.loading.exchange`)

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
        cooperative: each distinct stored byte range is read from S3 by one rank and sent to the
            others that need it over ``process_group`` (default: the default group; it must be
            the group given to ``dcp.load``), in rounds of at most ``exchange_window_bytes`` per
            rank (see docs/restore.md). ``last_stats`` has the figures of every load.
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
        cooperative: bool = False,
        process_group: Any = None,
        exchange_window_bytes: int = DEFAULT_WINDOW_BYTES,
    ) -> None:
        super().__init__()
        self._init_path(path, config, client)
        self.verify = verify
        self.allow_pickle = allow_pickle
        self._bounce_pool = pool
        self.cooperative = cooperative
        self.process_group = process_group
        self.exchange_window_bytes = exchange.check_window(exchange_window_bytes)
        self.items: ItemReads | None = None  # how this load reads each item, once the metadata is set up
        self.last_stats: LoadStats | None = None  # the figures of the last read_data (exchange.LoadStats)
        self.last_read_s = 0.0
        self.last_read_bytes = 0

    def __repr__(self) -> str:
        return f"S3StorageReader({self.checkpoint_id!r})"

    # ------------------------------------------------------------------ StorageReader
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self._reset_path(checkpoint_id)
        self.items = None

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
            metadata = self.fetch_metadata()
            # Well formed is not enough to load from: every chunk needs a location that stores
            # exactly its bytes. (fetch_metadata does not refuse them: `s3dcp verify` lists each.)
            validate_metadata(metadata, source=str(self._require_uri().child(METADATA_NAME)))
            return metadata
        except Exception as e:  # noqa: BLE001 - raised again, typed, in set_up_storage_reader
            return UnreadableMetadata(e)

    def fetch_metadata(self) -> Metadata:
        """The checkpoint's metadata, or a typed error: :class:`IncompleteCheckpointError`
        (data but no commit marker), :class:`CheckpointNotFoundError`, S3 errors, or
        :class:`MetadataFormatError`. Throttling, 5xx answers and dropped connections are
        retried (beyond the CRT's own retries) before giving up."""
        uri = self._require_uri()
        raw = fetch_metadata_bytes(self.client, uri)
        source = str(uri.child(METADATA_NAME))
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

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if isinstance(metadata, UnreadableMetadata):
            raise metadata.error
        self.items = ItemReads(self._require_uri(), metadata.storage_data, self.client, verify=self.verify,
                               allow_pickle=self.allow_pickle, coalesce_gap_bytes=self.config.coalesce_gap_bytes)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return exchange.with_peer_info(plan, self.process_group) if self.cooperative else plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return exchange.global_plans(self, plans) if self.cooperative else plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> TorchFuture[None]:
        self.last_stats = exchange.read(self, plan, planner)  # cooperative when the coordinator planned it
        self.last_read_s, self.last_read_bytes = self.last_stats.seconds, self.last_stats.s3_bytes
        fut: TorchFuture = TorchFuture()
        fut.set_result(None)
        return fut

    def _read_plain(self, plan: LoadPlan, planner: LoadPlanner) -> int:
        """Every byte of ``plan`` from S3 by this rank; the bytes fetched."""
        uri = self._require_uri()
        slot_bytes, slots = self._window_shape()
        reads = [self.items.plan(item, planner, slot_bytes) for item in plan.items]

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
        return sum(max(seg.end for seg in run) - run[0].offset for _, run in direct_runs + bounce_runs)

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
                            raise self.items.read_error(run, f.exception())
                        if slot is None:
                            for seg in run:
                                self.items.finish(seg.tag, planner)
                        else:
                            for seg in run:
                                lo = seg.offset - run[0].offset
                                self.items.finish_piece(*seg.tag, slot[lo:lo + seg.length], window.copier,
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
