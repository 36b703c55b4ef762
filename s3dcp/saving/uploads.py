"""One rank's part of a save: the objects it uploads, under which identity, and their end.

Owns what ``write_data`` does with a rank's items: each item's data resolved from the planner
(:func:`resolve`), the save's identity on this rank (:class:`SavePlanData`,
:func:`save_identity`: never an object name an earlier save used), and the upload group
(:class:`Uploads`): checksum each item, refer to an incremental base for the unchanged ones,
pack the rest into objects, upload them in parallel, and on failure stop them and delete what
they stored.

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
from typing import Any

import torch
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from ..config import S3Config
from ..errors import S3DCPError
from ..format import integrity, layout
from ..format.layout import ItemLocation
from ..format.metadata import dtype_to_str
from ..format.tensors import byte_view
from ..s3.client import S3Client
from ..s3.request import abort_and_wait
from ..uri import S3Uri
from .base import BaseIndex

log = logging.getLogger("s3dcp")


@dataclass(frozen=True)
class SavePlanData:
    """What the coordinator tells each rank in its plan (``SavePlan.storage_data``): the rank's
    number in object names and the save's identity, chosen once per save for all ranks."""

    rank: int
    save_id: str


class Uploads:
    """The objects one rank's write_data is uploading under ``uri``: futures, keys and write
    results. Items are checksummed with ``item_checksum``; ``config`` sizes the objects and
    spreads their names."""

    def __init__(self, client: S3Client, uri: S3Uri, config: S3Config, *, rank: int, save_id: str,
                 item_checksum: str, base: BaseIndex | None = None) -> None:
        self.client = client
        self.uri = uri
        self.config = config
        self.item_checksum = item_checksum
        self.rank = rank
        self.save_id = save_id
        self.base = base
        self.inherited_bytes = 0
        self.inherited_items = 0
        self.futures: list[Future] = []
        self.keys: list[str] = []
        self.results: list[WriteResult] = []
        self.bytes = 0
        self._keep_alive: list[Any] = []  # resolved data must outlive its upload

    def add(self, pairs: list) -> None:
        """Checksum each ``(write item, data)`` pair; with a base, record the unchanged ones as
        references to it; pack the rest, in order, into objects of about the configured target
        size (an item larger than the target gets one of its own) and start uploading each
        object as soon as it is complete."""
        target = self.config.object_size_target_bytes
        group: list = []
        group_bytes = 0
        for item, data in pairs:
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
                    continue
            if group and group_bytes + view.nbytes > target:
                self._put(group)
                group, group_bytes = [], 0
            group.append((item, data, view, sums, dtype, shape))
            group_bytes += view.nbytes
        if group:
            self._put(group)

    def _put(self, group: list) -> None:
        """Upload checksummed items back to back as the rank's next object."""
        name = layout.object_name(self.rank, len(self.keys), self.save_id, self.config.key_prefix_spread)
        views: list[memoryview] = []
        offset = 0
        for item, _data, view, sums, dtype, shape in group:
            self.results.append(WriteResult(index=item.index, size_in_bytes=view.nbytes, storage_data=ItemLocation(
                object_name=name, offset=offset, length=view.nbytes, checksum=sums.whole,
                dtype=dtype, shape=shape,
                block_size=integrity.BLOCK_SIZE_BYTES if sums.blocks else 0,
                block_checksums=sums.blocks,
            )))
            views.append(view)
            offset += view.nbytes
        key = self.uri.key(name)
        self.keys.append(key)
        self._keep_alive.append(group)
        self.futures.append(self.client.put(self.uri.bucket, key, views))
        self.bytes += offset

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
