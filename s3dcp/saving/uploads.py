"""One rank's part of a save: the objects it uploads, under which identity, and their end.

Owns what ``write_data`` does with a rank's items: each item's data resolved from the planner
(:func:`resolve`), the save's identity on this rank (:class:`SavePlanData`,
:func:`save_identity`: never an object name an earlier save used), and the upload group
(:class:`Uploads`): checksum each item, refer to an incremental base for the unchanged ones,
send the rest as objects — a staging slab's file as it is, or items copied into one — in
parallel, and on failure stop them and delete what they stored.

Must not commit, nor touch anything but this rank's own new objects: the metadata, the
pending-references marker and the objects of other checkpoints are the writer's commit
(:mod:`s3dcp.saving.writer`), which runs only once every rank's uploads succeeded.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from ..config import S3Config
from ..errors import S3DCPError
from ..format import integrity, layout
from ..format.layout import ItemLocation
from ..format.metadata import dtype_to_str
from ..format.tensors import byte_view
from ..memory.pool import ALIGN_BYTES, Arena, HostBufferPool
from ..memory.ring_buffer import align
from ..memory.slabs import FileSpan, file_of, staged_in_files
from ..s3.client import S3Client
from ..s3.request import abort_and_wait
from ..uri import S3Uri
from .base import BaseIndex
from .local_copy import LocalCopy

log = logging.getLogger("s3dcp")


@dataclass(frozen=True)
class SavePlanData:
    """What the coordinator tells each rank in its plan (``SavePlan.storage_data``): the rank's
    number in object names and the save's identity, chosen once per save for all ranks."""

    rank: int
    save_id: str


@dataclass
class _Entry:
    """One item to store: its data, byte view, checksums and what its location records."""

    item: WriteItem
    data: Any
    view: memoryview
    sums: integrity.ItemChecksums
    dtype: str | None
    shape: tuple[int, ...] | None


# An object sent straight from a shared-memory file holds the file's first bytes up to its last
# item; at most this share of them may be bytes no item of this save names (alignment gaps, a
# tensor DCP gave another rank, an unchanged one of an incremental save), else the items are
# copied into an object of their own.
_MAX_UNNAMED_SHARE = 1 / 32
# A smaller object (serialized values, a few small tensors) is one PUT whose body the CRT copies
# from the items' memory: cheaper than a slab of shared memory for it.
_COMPOSE_FROM_BYTES = 1 << 20
# A shared-memory file that is not a slab of this save's arena (DefaultStager's shared memory: a
# file per tensor) is an object of its own only from this size: a smaller one is copied in with
# others (a memcpy of 8 MiB costs ~1 ms here; a request of its own, tens of ms of latency and a
# request's overhead, and 750 optimizer tensors would be 750 objects).
_SEND_ALONE_FROM_BYTES = 8 << 20


class Uploads:
    """The objects one rank's write_data is uploading under ``uri``: futures, keys and write
    results. Items are checksummed with ``item_checksum``; ``config`` sizes the objects and
    spreads their names; objects are composed in host memory from ``pool`` (at most
    ``window_bytes`` of it at once: None, no bound); ``arena`` is the save's staging arena;
    ``local``, the node-local copy every object also goes to; ``upload=False`` keeps the objects
    in ``local`` only (a step of the local tier not sent to S3); ``wait_in(tensor)``, while a
    background stage still copies into ``arena``, returns once the tensor's bytes are in.

    Where an object's bytes come from::

        items whose tensors are views of one shared-memory file (a staging slab, the parent's
        slab in DCP's process executor, or from 8 MiB a file of DefaultStager's shared memory),
        naming nearly all of its first bytes
            -> that file is the object: the CRT sends its first bytes, read by path
               (small serialized values are copied into the free room after them, in a slab
               of this save's own arena)
        every other item (a synchronous save's tensors, serialized bytes, a few changed items
        of an incremental save, a slab most of whose bytes are not this save's)
            -> copied, back to back, into a slab of the pool (one memcpy), sent the same way
    """

    def __init__(self, client: S3Client, uri: S3Uri, config: S3Config, *, rank: int, save_id: str,
                 item_checksum: str, base: BaseIndex | None = None, pool: HostBufferPool | None = None,
                 window_bytes: int | None = None, arena: Arena | None = None, local: LocalCopy | None = None,
                 upload: bool = True, wait_in: Callable[[torch.Tensor], None] | None = None) -> None:
        self.client = client
        self.uri = uri
        self.config = config
        self.item_checksum = item_checksum
        self.rank = rank
        self.save_id = save_id
        self.base = base
        self.pool = pool
        self.window_bytes = window_bytes
        # this save's staging arena's slabs by address: sent as they are, their free tails take small items
        self._own = {slab.address: slab for slab in arena.slabs} if arena is not None else {}
        self.wait_in = wait_in  # a background stage: returns once a staged tensor's bytes are in
        self.local = local  # the node-local copy each object is also written to (the local tier)
        self.upload = upload  # False: a step kept in the local tier only
        self.objects = 0
        self.inherited_bytes = 0
        self.inherited_items = 0
        self.futures: list[Future] = []
        self.keys: list[str] = []
        self.results: list[WriteResult] = []
        self.bytes = 0
        self.copied_bytes = 0  # bytes composed into objects (copied once) rather than sent from their file
        self._composing: list[tuple[Future, int]] = []  # composed objects in flight, and their bytes
        self._keep_alive: list[Any] = []  # resolved data must outlive its upload

    def add(self, pairs: list) -> None:
        """Checksum each ``(write item, data)`` pair; with a base, record the unchanged ones as
        references to it; upload the rest as objects of about the configured target size (see
        the class docstring), each started as soon as its bytes are in place: the items of a
        staging slab still being filled (a background stage) once the slab is in
        (``wait_in``), one slab after the other, and never read before."""
        by_file: dict[int, tuple[FileSpan, list]] = {}  # items in a shared-memory file, by file
        loose: list[_Entry] = []
        for item, data in pairs:
            span = file_of(data) if isinstance(data, torch.Tensor) and data.nbytes else None
            if span is not None:
                by_file.setdefault(span.address, (span, []))[1].append((span.offset, item, data))
                continue
            if isinstance(data, torch.Tensor) and self.wait_in is not None:
                self.wait_in(data)  # a slab of ordinary memory (no files here)
            if (e := self._entry(item, data)) is not None:
                loose.append(e)
        rest: list[_Entry] = []  # items of files not sent as they are
        for span, items in by_file.values():  # the order of the plan: that of the slabs' filling
            if self.wait_in is not None:
                self.wait_in(items[0][2])
            placed = [(offset, e) for offset, item, data in items if (e := self._entry(item, data)) is not None]
            end = self._object_end(span, placed)
            if end is None:
                rest.extend(e for _, e in placed)
                continue
            loose, end = self._fill_tail(span, placed, end, loose)
            self._send_file(span, placed, end)
        self._compose(loose + rest)

    def _entry(self, item: WriteItem, data: Any) -> _Entry | None:
        """``data`` checksummed, or None when an incremental base holds the same bytes (the
        item's result is then a reference to it)."""
        view = data if isinstance(data, memoryview) else byte_view(data)
        sums = integrity.compute(self.item_checksum, view)
        tensor = isinstance(data, torch.Tensor)
        dtype = dtype_to_str(data.dtype) if tensor else None
        shape = tuple(data.shape) if tensor else None
        if self.base is not None:
            ref = self.base.reference(item.index, view.nbytes, dtype, shape, sums.whole)
            if ref is not None:
                self.results.append(WriteResult(index=item.index, size_in_bytes=view.nbytes, storage_data=ref))
                self.inherited_bytes += view.nbytes
                self.inherited_items += 1
                return None
        return _Entry(item, data, view, sums, dtype, shape)

    def _object_end(self, span: FileSpan, placed: list[tuple[int, _Entry]]) -> int | None:
        """Where the object made of the file's first bytes ends (sorting ``placed`` by offset),
        or None when the items are to be copied into an object of their own instead (see the
        class docstring)."""
        if not placed:
            return None
        placed.sort(key=lambda p: p[0])
        named, end = 0, 0  # bytes some item names; where the last one ends
        for offset, e in placed:
            stop = offset + e.view.nbytes
            named += max(0, stop - max(offset, end))
            end = max(end, stop)
        if end - named > end * _MAX_UNNAMED_SHARE or (span.address not in self._own and end < _SEND_ALONE_FROM_BYTES):
            return None
        return end

    def _fill_tail(self, span: FileSpan, placed: list, end: int, loose: list[_Entry]) -> tuple[list[_Entry], int]:
        """Copy small loose items (serialized values: a step count, a scheduler's state) into
        the free room after the last item of one of this save's own staging slabs, so that they
        travel in its object instead of objects of their own; return the others, and where the
        object now ends."""
        slab = self._own.get(span.address)
        if slab is None:
            return loose, end
        rest: list[_Entry] = []
        for e in loose:
            n = e.view.nbytes
            start = align(end, ALIGN_BYTES)
            if n >= _COMPOSE_FROM_BYTES or start + n > slab.capacity:
                rest.append(e)
                continue
            if n:
                slab.buffer[start:start + n].copy_(torch.frombuffer(e.view, dtype=torch.uint8))
                self.copied_bytes += n
            placed.append((start, e))
            end = start + n
        return rest, end

    def _send_file(self, span: FileSpan, placed: list[tuple[int, _Entry]], end: int) -> None:
        """Upload the first ``end`` bytes of the file as one object holding the ``placed`` items."""
        name = self._next_name()
        for offset, e in placed:
            self._record(name, offset, e)
        buffer = torch.empty(0, dtype=torch.uint8).set_(span.owner)[:end]
        self._put(name, end, span.path, [buffer], keep=(span.owner, placed))

    def _compose(self, loose: list[_Entry]) -> None:
        """Copy the entries, in order, back to back into objects of about the target size (an
        item larger than the target gets one of its own), each in a slab of the pool."""
        target = self.config.object_size_target_bytes
        group: list[_Entry] = []
        group_bytes = 0
        for e in loose:
            if group and group_bytes + e.view.nbytes > target:
                self._compose_one(group, group_bytes)
                group, group_bytes = [], 0
            group.append(e)
            group_bytes += e.view.nbytes
        if group:
            self._compose_one(group, group_bytes)

    def _compose_one(self, group: list[_Entry], nbytes: int) -> None:
        if self.pool is None or nbytes < _COMPOSE_FROM_BYTES or not self.client.sends_files or not staged_in_files():
            # sent from the items' own buffers (transport="sockets" sends every object so, and
            # so does the CRT where staging is ordinary memory: a copy would buy nothing)
            name = self._next_name()
            offset = 0
            for e in group:
                self._record(name, offset, e)
                offset += e.view.nbytes
            self._put(name, nbytes, None, [e.view for e in group], keep=(group,))
            return
        self._make_room(nbytes)
        arena = self.pool.acquire(nbytes, max_in_use=None, prefault=False)
        try:
            slab = arena.slabs[0]
            name = self._next_name()
            offset = 0
            for e in group:
                n = e.view.nbytes
                if n:
                    slab.buffer[offset:offset + n].copy_(torch.frombuffer(e.view, dtype=torch.uint8))
                self._record(name, offset, e)
                offset += n
            self.copied_bytes += nbytes
            future = self._put(name, nbytes, slab.path, [slab.buffer[:nbytes]], keep=(slab,))
        except BaseException:  # nothing was sent from it (the local copy's write, the request's start)
            self.pool.release(arena)
            raise
        self._composing.append((future, nbytes))
        future.add_done_callback(lambda _f, arena=arena: self.pool.release(arena))

    def _make_room(self, nbytes: int) -> None:
        """Wait, oldest first, for composed objects to be sent until ``nbytes`` more fit the
        window (one object always may be composed); a failed upload raises here."""
        if self.window_bytes is None:
            return
        while self._composing:
            in_flight = sum(n for f, n in self._composing if not f.done())
            if in_flight + nbytes <= self.window_bytes:
                break
            future, _ = self._composing.pop(0)
            future.result()
        self._composing = [(f, n) for f, n in self._composing if not f.done()]

    def _next_name(self) -> str:
        name = layout.object_name(self.rank, self.objects, self.save_id, self.config.key_prefix_spread)
        self.objects += 1
        if self.upload:  # a local-only step puts nothing in the bucket, nor deletes anything there
            self.keys.append(self.uri.key(name))
        return name

    def _record(self, name: str, offset: int, e: _Entry) -> None:
        self.results.append(WriteResult(index=e.item.index, size_in_bytes=e.view.nbytes, storage_data=ItemLocation(
            object_name=name, offset=offset, length=e.view.nbytes, checksum=e.sums.whole,
            dtype=e.dtype, shape=e.shape,
            block_size=integrity.BLOCK_SIZE_BYTES if e.sums.blocks else 0,
            block_checksums=e.sums.blocks,
        )))

    def _put(self, name: str, nbytes: int, path: str | None, buffers, *, keep: tuple) -> Future:
        """Upload ``nbytes`` as object ``name``: through the CRT from the file at ``path`` (its
        first bytes), or from ``buffers`` (the same bytes in memory) where there is no file or
        the transport sends from memory. ``keep`` stays referenced until the upload ends. With a
        local copy the same bytes are written to the node's local directory first; a step kept
        only there (``upload=False``) sends nothing."""
        views = [byte_view(b) if isinstance(b, torch.Tensor) else b for b in buffers]
        if self.local is not None:
            self.local.write(name, views)
        self.bytes += nbytes
        if not self.upload:
            done: Future = Future()
            done.set_result(None)
            self.futures.append(done)
            return done
        key = self.keys[-1]
        if path is not None and self.client.sends_files:
            future = self.client.put_file(self.uri.bucket, key, path, nbytes, keep=keep)
        else:
            self._keep_alive.append(keep)
            future = self.client.put(self.uri.bucket, key, views)
        self.futures.append(future)
        return future

    def drain(self) -> None:
        """Wait for every upload so far; raise the first failure as soon as it happens (then
        :meth:`discard` stops the others)."""
        done, _ = wait(self.futures, return_when=FIRST_EXCEPTION)
        failed = next((f for f in self.futures if f in done and f.exception() is not None), None)
        if failed is not None:
            raise failed.exception()

    def wait(self) -> list[WriteResult]:
        self.drain()
        return self.results

    def discard(self, error: BaseException) -> None:
        """After ``error``: stop the uploads in flight and wait for them to stop reading the
        staged memory, then delete every object this rank started (the CRT aborts the multipart
        uploads it stopped or that failed). After a failed upload, only what stops without
        leaving anything stored is stopped (queued uploads, multipart ones); a single PUT
        already sending finishes, and is deleted with the rest. After an interrupt (Ctrl-C) all
        stop at once, and a single PUT cut off after its body went out may still be stored
        after the delete (``s3dcp gc`` removes it). Every key is deleted, not only those whose
        upload succeeded: one that timed out may have been stored all the same, and deleting a
        key that is not there is no error."""
        abort_and_wait(self.futures, only_if_clean=isinstance(error, Exception))
        if not self.keys:
            return
        try:
            self.client.delete(self.uri.bucket, self.keys).result()
        except S3DCPError:
            log.warning("could not delete the %d object(s) of a failed save under %s; `s3dcp gc` will",
                        len(self.keys), self.uri, exc_info=True)


_USED_SAVE_IDS: dict[str, int] = {}  # save ids this process has written, and how often
_USED_LOCK = threading.Lock()


def save_identity(plan_data: Any, rank: int) -> tuple[int, str]:
    """(rank, save id) of the save whose plan this rank got.

    Normally the coordinator's fresh id from this save's plan. Two cases get a new one here:
    no plan data (the writer driven by hand, not by DCP), and an id this process has already
    written — a plan reused from DCP's plan cache (``enable_plan_caching``), which carries the
    id of the save that made it. Then the id is derived from that one and how often this
    process has reused it, which ranks that saved in step agree on. Either way no save writes
    an object name an earlier save used.
    """
    if not isinstance(plan_data, SavePlanData):
        return rank, layout.new_save_id()
    with _USED_LOCK:
        uses = _USED_SAVE_IDS.get(plan_data.save_id, 0)
        _USED_SAVE_IDS[plan_data.save_id] = uses + 1
    if uses == 0:
        return plan_data.rank, plan_data.save_id
    return plan_data.rank, hashlib.sha256(f"{plan_data.save_id}:{uses}".encode()).hexdigest()[:12]


def resolve(planner: SavePlanner, item: WriteItem) -> Any:
    """The item's data: a contiguous tensor (host, unless it awaits a staging round), or a
    byte view of the planner's serialized bytes."""
    data = planner.resolve_data(item)
    if item.type == WriteItemType.BYTE_IO:
        raw = data.getbuffer() if hasattr(data, "getbuffer") else bytes(data)
        return memoryview(raw).cast("B")
    return data.detach()
