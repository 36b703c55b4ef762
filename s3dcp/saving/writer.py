"""S3StorageWriter: DCP's StorageWriter (and AsyncStager) over S3.

    write items ──resolve──► raw bytes (tensor memory, no serialisation) ──pack──► a few objects
        per rank ──client.put (parallel, multipart, checksummed)──► s3://bucket/prefix/__R_I.TOKEN.distcp
    coordinator, after every rank succeeded ──► s3://bucket/prefix/.metadata  (JSON, written LAST,
        If-None-Match: *) = the commit marker

With ``incremental_from=`` (a committed sibling checkpoint), an item whose staged bytes are
unchanged since that base is not uploaded: its location is a reference to where the base holds
it (``../step-1000/__0_0.TOKEN.distcp``); see :mod:`s3dcp.format.references`.

This module owns the writer's side of DCP's call order and the commit (``finish``: the checks,
the metadata PUT, the pending-references marker, the replaced checkpoint's objects). It must not
pack or upload data objects itself (a rank's uploads are :mod:`s3dcp.saving.uploads`'s), nor
copy tensors for async_save (:mod:`s3dcp.saving.staging`'s).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future as TorchFuture

from ..config import S3Config
from ..errors import (
    UNREACHABLE,
    CheckpointExistsError,
    ConfigError,
    IncompleteCheckpointError,
    NoSuchKeyError,
    PreconditionFailedError,
    RequestAbortedError,
    S3DCPError,
)
from ..format import layout
from ..format.layout import METADATA_NAME, PENDING_NAME
from ..format.metadata import encode_metadata
from ..format.references import REFERENCE_CHECKSUM, check_base, encode_pending, is_reference
from ..format.tensors import to_host_contiguous
from ..s3.client import S3Client
from ..s3.location import S3CheckpointPath
from ..s3.request import abort_all
from ..uri import parse_s3_uri
from . import statetree
from .base import BaseIndex
from .commit_check import check_objects
from .local_copy import LocalCopy, kept_on_nodes
from .overwrite import delete_own, delete_replaced, own_names, replaced_objects
from .staging import StagingMixin
from .stats import SaveStats
from .uploads import SavePlanData, Uploads, resolve, save_identity

__all__ = ["S3StorageWriter", "METADATA_NAME", "SaveStats"]

log = logging.getLogger("s3dcp")


class S3StorageWriter(S3CheckpointPath, StagingMixin, StorageWriter):
    """Writes a DCP checkpoint under ``s3://bucket/prefix``.

    Call order, as :func:`torch.distributed.checkpoint.save` makes it:

    0. ``reset(checkpoint_id)`` — all ranks, only when ``checkpoint_id=`` is passed to save
    1. ``storage_meta()`` — all ranks
    2. ``set_up_storage_writer(is_coordinator, rank=…)`` — all ranks; the coordinator refuses
       early if a committed checkpoint is already there (and ``overwrite`` is False); with
       ``incremental_from``, every rank reads the base's metadata and refuses a base that is
       missing, incomplete or not a sibling — before anything is uploaded
    3. ``prepare_local_plan`` — all ranks; 4. ``prepare_global_plan`` — coordinator
    5. ``write_data(plan, planner)`` — all ranks: checksum each item; refer to the base for
       the unchanged ones (incremental), pack the others into a few objects and upload them in
       parallel; nothing is visible as a checkpoint yet
    6. ``finish(metadata, results)`` — coordinator, called only if every rank's writes
       succeeded: with references, puts a pending-references marker and checks the base is
       still the committed checkpoint set-up read; checks every object the metadata names
       (own and referenced) at its exact size; then writes the metadata object, which commits
       the checkpoint, and deletes the marker

    :func:`torch.distributed.checkpoint.async_save` first calls ``stage(state_dict)`` on the
    training thread (see :class:`s3dcp.saving.staging.StagingMixin`), then runs 0-6 in the
    background. With ``config.staging="background"`` async_save returns an ``AsyncSaveResponse``
    before the tensors are copied, and 0-6 run once a staging thread has copied them; the loop
    must wait for ``staging_completion`` before it changes a tensor (docs/memory.md), else the
    save fails with :class:`~s3dcp.errors.TornCheckpointError` and nothing is committed.

    Args:
        path: ``s3://bucket/prefix``; may instead come as ``checkpoint_id=`` to ``dcp.save``.
        config: :class:`S3Config`; default: resolved from the environment.
        client: an :class:`s3dcp.s3.client.S3Client` to use (tests and benchmarks inject one).
        overwrite: replace a committed checkpoint at ``path`` (its unreferenced data objects
            are deleted after the new metadata commits). Default: refuse.
        pool: the staging pool for ``async_save`` (default: the process-wide shared pool).
        incremental_from: ``s3://bucket/run/step-1000``, a committed checkpoint in the same
            directory as ``path``: items whose staged bytes are unchanged since it (same FQN,
            chunk, dtype, shape, length and CRC64NVME) are stored as references to it, not
            uploaded. The result is a complete checkpoint, loaded like any other.
        item_checksum: the algorithm of the per-item checksums recorded in the metadata
            (``"crc64nvme"``, ``"crc32c"``). Default: ``"crc64nvme"``, the checksum incremental
            saves compare, so every checkpoint saved with the defaults can be the base of a
            later incremental save (CRC64NVME is also the faster of the two in awscrt); none
            when ``config.checksum`` is None (checksums off), unless the save is incremental.
            Items recorded with ``"crc32c"`` are never inherited. The wire checksum of each
            part is ``config.checksum``, whatever this is.
    """

    _writes = True  # never at a bucket's root

    def __init__(
        self,
        path: str | None = None,
        *,
        config: S3Config | None = None,
        client: S3Client | None = None,
        overwrite: bool = False,
        pool=None,
        incremental_from: str | None = None,
        item_checksum: str | None = None,
        local_copy: LocalCopy | None = None,
        upload: bool = True,
    ) -> None:
        super().__init__()
        self._init_path(path, config, client)
        self.overwrite = overwrite
        self.incremental_from = parse_s3_uri(incremental_from) if incremental_from is not None else None
        if self.incremental_from is not None and self._uri is not None:
            check_base(self._uri, self.incremental_from)  # refused at once, before any save starts
        if item_checksum is not None and item_checksum not in ("crc32c", REFERENCE_CHECKSUM):
            raise ConfigError(f"item_checksum={item_checksum!r} must be 'crc32c', '{REFERENCE_CHECKSUM}' or None")
        self.item_checksum = item_checksum or default_item_checksum(self.config.checksum,
                                                                    incremental=incremental_from is not None)
        self._base: BaseIndex | None = None  # the base's locations, read in set_up_storage_writer
        self._base_etag: str | None = None  # the coordinator's: which base .metadata set-up read
        self._rank = 0
        self._is_coordinator = False
        self._save_id: str | None = None  # this rank's identity of the save in progress
        self._uploads: Uploads | None = None  # write_data's, while it runs (what abandon() stops)
        self._abandoned = False
        self.local_copy = local_copy  # the local tier's copy of this rank's objects (CheckpointManager)
        self.upload = upload  # False: the objects go to local_copy only; nothing is sent to S3
        if not upload and (local_copy is None or incremental_from is not None):
            raise ConfigError("upload=False keeps a checkpoint in its local copy only: it needs local_copy= "
                              "and cannot be incremental")
        self.last_stats = SaveStats()
        self._init_staging(pool, self.config.staging)

    def __repr__(self) -> str:
        base = f", incremental_from={str(self.incremental_from)!r}" if self.incremental_from else ""
        return f"S3StorageWriter({self.checkpoint_id!r}, overwrite={self.overwrite}{base})"

    def __getstate__(self) -> dict[str, Any]:
        # DCP's process executor pickles the writer: the CRT client and the staging pool stay
        # behind and are recreated lazily in the child.
        state = super().__getstate__()
        state.update(self._staging_getstate())
        return state

    # ------------------------------------------------------------------ StorageWriter
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self._attach()
        self._reset_path(checkpoint_id)

    def storage_meta(self) -> StorageMeta | None:
        self._attach()
        return StorageMeta(checkpoint_id=self.checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._attach()
        self._require_uri()
        if kwargs.get("use_collectives") is False:
            raise ConfigError(
                "S3StorageWriter needs use_collectives=True: the coordinator writes the one metadata object "
                "that commits the checkpoint. With use_collectives=False every rank would commit metadata of "
                "its own, under no identity the ranks share, so no reader could tell a whole checkpoint from "
                "ranks of two saves (docs/memory.md, \"DCP's save modes\"). Ranks that cannot meet at save time "
                "can each save a checkpoint of their own: S3StorageWriter(f'{path}/rank-{rank}') with "
                "dcp.save(..., no_dist=True)")
        self._rank = kwargs.get("rank") or 0
        self._is_coordinator = is_coordinator
        if is_coordinator and self.upload and not self.overwrite and self._committed():
            raise CheckpointExistsError(
                f"{self._uri} already holds a committed checkpoint; save to a new path, or pass "
                "overwrite=True (to s3dcp.save / async_save or S3StorageWriter) to replace it")
        self._base, self._base_etag = None, None
        if self.incremental_from is not None:  # every rank: its own items are decided on it
            if is_coordinator:  # before the read: the commit checks the base is still this object
                self._base_etag = self._base_metadata_etag()[1]
            self._base = BaseIndex.load(self.client, self._uri, self.incremental_from)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self._attach()
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        self._attach()
        # The coordinator chooses the save's identity, once, for every rank.
        save_id = layout.new_save_id()
        return [replace(plan, storage_data=SavePlanData(i, save_id)) for i, plan in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> TorchFuture[list[WriteResult]]:
        lease = self._staging_begin()
        start = time.perf_counter()
        rank, self._save_id = save_identity(plan.storage_data, self._rank)
        uploads: Uploads | None = None
        try:
            # in the try: the client may be made here, and a failure must still end the lease
            self._check_not_abandoned()
            streams = self._streams(lease, planner)
            if not streams:  # another planner may read the bytes while resolving: the whole stage first
                self._staging_landed(lease)
            uploads = self._uploads = Uploads(
                self.client, self._uri, self.config, rank=rank, save_id=self._save_id,
                item_checksum=self.item_checksum, base=self._base, pool=self._staging_pool(),
                window_bytes=self.config.staging_budget_bytes, arena=lease.arena if lease is not None else None,
                local=self.local_copy, upload=self.upload, wait_in=lease.wait_in if streams else None)
            if self.local_copy is not None:
                self.local_copy.begin(rank)
            ready, deferred = [], []
            for item in plan.items:
                if streams and item.type == WriteItemType.BYTE_IO and statetree.tensors(
                        planner.lookup_object(item.index)):
                    self._staging_landed(lease)  # pickling the value reads its tensors' bytes
                data = resolve(planner, item)
                if not isinstance(data, torch.Tensor):
                    ready.append((item, data))
                elif lease is not None and lease.pending and not lease.arena.owns(data):
                    deferred.append((item, data))  # beyond the staging budget: copied in rounds
                else:
                    ready.append((item, to_host_contiguous(data)))
            uploads.add(ready)
            self._staging_landed(lease)  # a background stage: torn or failed, nothing is committed
            if deferred:
                self._stage_rounds(deferred, lease, uploads.add, uploads.drain)
            try:
                results = uploads.wait()
            except UNREACHABLE as e:  # S3 out of reach: with the node's whole copy, the save goes on
                if self.local_copy is None or self.local_copy.failure is not None:
                    raise
                uploads.discard(e)
                results = uploads.results
                self._upload_error = e  # what finish() says, on the coordinator
                log.error("rank %d could not upload its objects to %s (%s: %s); they are kept in the node's local "
                          "copy, and the checkpoint will not be committed to S3", rank, self._uri, type(e).__name__,
                          " ".join(str(e).split())[:300])
            elapsed = time.perf_counter() - start
            self.last_stats = SaveStats(stage_s=self._stage_s if lease is not None else 0.0, upload_s=elapsed,
                                        bytes=uploads.bytes, objects=uploads.objects,
                                        inherited_bytes=uploads.inherited_bytes,
                                        inherited_items=uploads.inherited_items,
                                        copied_bytes=uploads.copied_bytes)
        except BaseException as e:
            if uploads is not None:
                uploads.discard(e)
            raise
        finally:
            self._uploads = None
            self._staging_end(lease)
        log.debug("rank %d uploaded %d bytes in %d objects to %s in %.3fs (%d bytes referenced in the base)",
                  rank, uploads.bytes, uploads.objects, self._uri, elapsed, uploads.inherited_bytes)
        fut: TorchFuture = TorchFuture()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Commit (coordinator only, after every rank's writes succeeded). With references: put
        the pending-references marker, then check the base is still the committed checkpoint
        set-up read (the protocol of :mod:`s3dcp.saving.referenced` that keeps a concurrent delete of
        the base from leaving a dangling reference). Then check that every object the metadata
        names is there with its exact size, write the metadata with ``If-None-Match: *``, and
        delete the marker; with ``overwrite=True``, then delete the replaced checkpoint's own
        objects."""
        self._attach()
        uri = self._uri
        metadata.storage_data = {wr.index: wr.storage_data for rank_results in results for wr in rank_results}
        if metadata.storage_meta is None:  # DCP's default planner leaves it out; keep where and which save
            metadata.storage_meta = self.storage_meta()
        metadata.storage_meta.checkpoint_id = self.checkpoint_id
        metadata.storage_meta.save_id = self._save_id or ""
        if not self.upload:  # kept in the local tier only: the manager commits the local copies
            return
        referenced = sorted({loc.object_name for loc in metadata.storage_data.values()
                             if is_reference(loc.object_name)})
        marker = False
        try:
            if referenced:
                self.client.put(uri.bucket, uri.key(PENDING_NAME),
                                encode_pending(self._save_id or "", str(self.incremental_from), referenced),
                                single_request=True, content_type="application/json").result()
                marker = True
                self._check_base_unchanged()
            self._check_objects(metadata.storage_data.values())
            self._check_not_abandoned()
            replaced = replaced_objects(self.client, uri) if self.overwrite else set()
            body = encode_metadata(metadata)
        except BaseException as e:
            # Nothing was committed: this save's objects are garbage now, delete them.
            own = own_names(metadata.storage_data.values()) | ({PENDING_NAME} if marker else set())
            delete_own(self.client, uri, own)
            if kept_on_nodes(self.local_copy, metadata, getattr(self, "_upload_error", None) or e, uri):
                return
            raise
        key = uri.key(METADATA_NAME)
        try:
            try:
                self.client.put(uri.bucket, key, body, if_none_match=not self.overwrite,
                                content_type="application/json").result()
            except UNREACHABLE as e:  # maybe stored, its answer lost: the objects stay (gc judges them)
                if kept_on_nodes(self.local_copy, metadata, e, uri):
                    return
                raise
        except PreconditionFailedError as e:
            # A commit whose answer was lost (connection reset after the server stored it) is
            # retried by the CRT and then fails its own If-None-Match: it is ours if the stored
            # body is byte for byte what we sent (the body holds this save's unique identity).
            if not self._stored_metadata_is(key, body):
                raise CheckpointExistsError(
                    f"{uri}: another save committed this checkpoint first; this save's data objects "
                    "are left for `s3dcp gc` (nothing was overwritten)") from e
            log.info("commit of %s was retried after a lost answer; the stored metadata is this save's", uri)
        finally:
            if marker:  # committed (the metadata now names the references) or never will be
                self._delete_pending()
        stale = replaced - {loc.object_name for loc in metadata.storage_data.values()}
        if stale:
            delete_replaced(self.client, uri, sorted(stale))
        inherited = sum(loc.length for loc in metadata.storage_data.values() if is_reference(loc.object_name))
        total = sum(wr.size_in_bytes for rank_results in results for wr in rank_results)
        stats = self.last_stats  # the coordinator's own rank
        # With a local copy, the manager's local tier says in one INFO line where the step is
        # (lifecycle/tiers.LocalTier.tell): this one, the S3 side's figures, goes to DEBUG.
        log.log(logging.INFO if self.local_copy is None else logging.DEBUG,
                "committed %s: %d bytes from %d rank(s)%s; this rank: stall %.3f s, upload %.2f s, %.3f GB/s",
                uri, total, len(results),
                f" ({inherited} referenced in {self.incremental_from})" if self.incremental_from else "",
                stats.stage_s, stats.upload_s, stats.upload_gbps)

    def abandon(self) -> None:
        """Stop this save from another thread (Ctrl-C in ``s3dcp.async_save``'s ``result()``): the
        uploads in flight are aborted, so ``write_data`` fails and deletes what this rank wrote,
        and ``finish`` commits nothing. Never blocks; a commit already on its way still lands
        (the checkpoint is then whole)."""
        self._abandoned = True
        uploads = self._uploads
        if uploads is not None:
            abort_all(list(uploads.futures))

    def _check_not_abandoned(self) -> None:
        if self._abandoned:
            raise RequestAbortedError(f"the save to {self._uri} was abandoned (Ctrl-C while waiting for it); "
                                      "nothing was committed")

    # ------------------------------------------------------------------ helpers
    def _committed(self) -> bool:
        from ..errors import NoSuchKeyError

        try:
            self.client.head(self._uri.bucket, self._uri.key(METADATA_NAME)).result()
            return True
        except NoSuchKeyError:
            return False
        except UNREACHABLE:
            if self.local_copy is None:
                raise
            return False  # S3 out of reach: the nodes' copies go on; the commit, create-only, decides

    def _stored_metadata_is(self, key: str, body: bytes) -> bool:
        try:
            return self.client.get(self._uri.bucket, key).result() == body
        except S3DCPError:
            log.debug("could not read back %s after a failed conditional commit", key, exc_info=True)
            return False

    def _base_metadata_etag(self) -> tuple[bool, str | None]:
        """Whether the base's ``.metadata`` exists now, and its ETag (at set-up a missing one
        is left to the read that follows, which says what is wrong)."""
        base = self.incremental_from
        try:
            return True, self.client.head(base.bucket, base.key(METADATA_NAME)).result().etag
        except NoSuchKeyError:
            return False, None

    def _check_base_unchanged(self) -> None:
        """Refuse to commit unless the base's ``.metadata`` is still the object set-up read
        (same ETag): deleted, the base's objects may be going; replaced, they may differ."""
        base = self.incremental_from
        where = f"s3://{base.bucket}/{base.key(METADATA_NAME)}"
        present, etag = self._base_metadata_etag()
        if not present or etag != self._base_etag:
            raise IncompleteCheckpointError(
                f"refusing to commit {self._uri}: its incremental base {base} was "
                f"{'replaced' if present else 'deleted'} during the save ({where} "
                f"{f'has ETag {etag}, not {self._base_etag}' if present else 'is gone'}), so the objects "
                "it references may be deleted; nothing was committed — save again (on another base)")

    def _delete_pending(self) -> None:
        """Delete this save's pending-references marker (after its commit, or its failure)."""
        uri = self._uri
        try:
            self.client.delete(uri.bucket, [uri.key(PENDING_NAME)]).result()
        except S3DCPError:
            log.warning("could not delete %s; it keeps the objects it names until `s3dcp gc` removes it",
                        uri.child(PENDING_NAME), exc_info=True)

    def _check_objects(self, locations) -> None:
        """Refuse to commit unless every object ``locations`` name is there at its size."""
        check_objects(self.client, self._uri, locations, self._base)


def default_item_checksum(wire_checksum: str | None, *, incremental: bool) -> str | None:
    """The per-item checksum a save records when not told: the one incremental saves compare
    (so every default checkpoint is a base), unless checksums are off (``wire_checksum`` None)
    for a save that needs none to decide what is unchanged."""
    if wire_checksum is None and not incremental:
        return None
    return REFERENCE_CHECKSUM
