"""CheckpointManager: numbered checkpoints under one S3 prefix, saved (async by default),
kept by a retention policy, found again and loaded on resume.

    save(step, sd) ─► dcp.async_save(sd, S3StorageWriter(base/step-00000042)) ─► future
                        │ stage() waits while the previous checkpoint still uploads (the pool's
                        │ back-pressure), then the upload runs in DCP's background thread
                        ▼ committed (.metadata written)
                      coordinator: one INFO log line, then retention: delete committed
                      checkpoints outside keep_last / keep_every (.metadata first)
    latest() ─► coordinator lists base/ ─► newest step whose .metadata exists ─► broadcast
    load(sd) ─► latest() ─► dcp.load(sd, S3StorageReader(base/step-…))

A checkpoint is *committed* when its ``.metadata`` object exists (the writer puts it last).
Retention only ever deletes committed checkpoints that are older than the newest ones kept,
and only after a newer save has committed; directories without ``.metadata`` (a save still
running, or a failed one) are left to :func:`s3dcp.gc`, which judges them by age.

With ``incremental=True`` each save uses the newest committed checkpoint as its base
(:mod:`s3dcp.saving.base`): unchanged items become references to it. Retention then deletes a
checkpoint's metadata and only those of its objects that no kept checkpoint references; the
rest go when the last checkpoint referencing them goes. How the base is chosen beside
retention: :func:`s3dcp.lifecycle.retention.choose_base`.

With ``local_dir`` every checkpoint is also kept on the node, every ``s3_every``-th one goes to
S3 too, and :meth:`CheckpointManager.load` restores from the nearest copy
(:mod:`s3dcp.lifecycle.tiers`, docs/restart.md).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from .._dcp_warning import ours
from ..config import S3Config
from ..errors import ConfigError, S3ConnectionError, unwrap_error
from ..format.layout import METADATA_NAME
from ..format.references import REFERENCE_CHECKSUM, check_base
from ..s3.client import S3Client
from ..s3.probe import diagnose
from ..saving.stats import record_committed
from ..uri import checkpoint_uri
from .deletion import delete_checkpoint  # here too: `rm` and Lightning delete as retention does
from .directories import CheckpointInfo, list_checkpoints, name_pattern
from .inflight import InFlight
from .newest import agreed, later, refuse_older
from .retention import Doomed, apply_retention, choose_base
from .tiers import LocalTier

if TYPE_CHECKING:
    from ..saving.stats import SaveStats
    from ..saving.writer import S3StorageWriter

# torch (and the writer and reader, which need it) is imported where it is used, so listing and
# deleting checkpoints (``s3dcp ls``, ``s3dcp rm``) do not pay for importing it.

__all__ = ["CheckpointManager", "CheckpointInfo", "delete_checkpoint", "METADATA_NAME"]

log = logging.getLogger("s3dcp")


class CheckpointManager:
    """Periodic checkpoints of one training run under ``base_uri``.

    Every rank calls :meth:`save` with the same ``step``; :meth:`latest` and :meth:`load` are
    collective when ``torch.distributed`` is initialised (the coordinator, rank 0 of
    ``process_group``, lists the bucket and broadcasts what it found, so every rank agrees).

    Args:
        base_uri: ``s3://bucket/run``; checkpoint ``step`` goes to ``base_uri/name_format(step)``.
        config: :class:`S3Config`; default: resolved from the environment.
        client: an :class:`s3dcp.s3.client.S3Client` to use for everything (tests inject one);
            :meth:`close` leaves it open (one the manager made, it closes).
        keep_last: committed checkpoints to keep, newest first (``None``: keep all).
        keep_every: also keep every step that is a multiple of this (``None``: none).
        async_mode: :meth:`save` returns once the state is staged (``dcp.async_save``);
            ``False``: it returns once the checkpoint is committed.
        process_group: the group DCP saves and loads over (default: the default group).
        name_format: directory name of a step; must hold ``{step}`` once (a format spec is fine).
        incremental: save each checkpoint as an incremental one on the newest committed
            checkpoint (unchanged items are references to it, not uploaded); every checkpoint
            records CRC64NVME item checksums so that the next one can compare. A save waits
            for the save in flight and builds on it (module docstring: more in flight).
        local_dir: the node-local tier (a tmpfs such as ``/dev/shm/<run>``, or an NVMe path, of
            this run alone): every checkpoint also kept there, per rank, as in S3; ``load``
            restores from the nearest copy (docs/restart.md). ``s3_every``: every K-th checkpoint
            (the first included) also goes to S3 (1: every one); ``local_keep_last`` steps are
            kept there, in at most ``local_budget_bytes`` per rank; ``local_replicas=1`` sends
            each rank's copy to a rank on another node too.

    :attr:`last_save_stats`: this rank's :class:`~s3dcp.saving.writer.SaveStats` of the save that
    committed last (bytes uploaded and inherited, seconds), as ``s3dcp.last_save_stats()``.

    A run never saves beside a newer one: the first :meth:`save` of a manager asks
    :meth:`latest` (one LIST), and a step at or below a committed step already there (or one
    this manager saved) is refused with :class:`~s3dcp.errors.CheckpointExistsError` before
    anything is written — resume, save elsewhere, or delete the old run's checkpoints first.

    Errors of an asynchronous save reach its future and are raised again by :meth:`wait`,
    :meth:`close`, or the next :meth:`save` (so none goes unnoticed). A failed save never
    triggers retention. Every error is raised as :func:`s3dcp.unwrap_error` gives it — the
    rank's own (an :class:`~s3dcp.errors.S3DCPError` when s3dcp raised it) with
    ``failed_ranks``, ``rank_errors`` and DCP's ``checkpoint_exception`` — never the
    ``CheckpointException`` itself (a ``BaseException``).
    """

    def __init__(
        self,
        base_uri: str,
        *,
        config: S3Config | None = None,
        client: S3Client | None = None,
        keep_last: int | None = 3,
        keep_every: int | None = None,
        async_mode: bool = True,
        process_group: Any = None,
        name_format: str = "step-{step:08d}",
        incremental: bool = False,
        local_dir: str | os.PathLike | None = None,
        s3_every: int = 1,
        local_keep_last: int = 2,
        local_budget_bytes: int | None = None,
        local_replicas: int = 0,
    ) -> None:
        if keep_last is not None and (not _is_int(keep_last) or keep_last < 1):
            raise ConfigError(f"keep_last={keep_last!r} must be an int >= 1 (or None to keep every checkpoint)")
        if keep_every is not None and (not _is_int(keep_every) or keep_every < 1):
            raise ConfigError(f"keep_every={keep_every!r} must be an int >= 1 or None")
        self.base = checkpoint_uri(base_uri, what="a CheckpointManager's run")
        self._pattern = name_pattern(name_format)
        self.name_format = name_format
        self.incremental = incremental
        if incremental:  # references need the checkpoints to be siblings
            try:
                check_base(self.base.child(self.name(1)), self.base.child(self.name(0)))
            except ConfigError:
                raise ConfigError(f"name_format={name_format!r}: incremental=True needs every step's directory "
                                  "in the same parent directory (no '/' after {step})") from None
        self.config = config or (client.config if client is not None else S3Config())
        self.client = client or S3Client(self.config)
        self._owns_client = client is None
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.async_mode = async_mode
        self.process_group = process_group
        self.last_writer: S3StorageWriter | None = None
        self.last_save_stats: SaveStats | None = None  # this rank's, of the save that committed last
        self._saves = InFlight()
        self._lock = threading.Lock()  # _bases_in_use, _doomed
        self._retention_lock = threading.Lock()
        self._bases_in_use: dict[int, int] = {}  # step of a save in flight -> step of its base
        self._doomed = Doomed()  # steps retention chose to delete: never a base again
        self._newest: int | None = None  # newest committed step known (the bucket's at the first save, ours)
        self._newest_in_s3: int | None = None  # of those, the newest in S3: a load() goes back to it (a rollback)
        self._checked = False  # whether the first save asked the bucket for its newest step
        self.last_load_stats: dict | None = None  # of the last load(): step, tier, bytes per tier
        self._tiers: LocalTier | None = None
        if local_dir is not None:
            if incremental:
                raise ConfigError("local_dir= and incremental=True cannot go together: a step kept only "
                                  "locally would reference objects of S3")
            self._tiers = LocalTier(local_dir, base=self.base, name=self.name, step_of=self._step_of,
                                    s3_every=s3_every, keep_last=local_keep_last, budget_bytes=local_budget_bytes,
                                    replicas=local_replicas, process_group=process_group)
        elif (s3_every, local_keep_last, local_budget_bytes, local_replicas) != (1, 2, None, 0):
            raise ConfigError("s3_every, local_keep_last, local_budget_bytes and local_replicas need local_dir=")

    def __repr__(self) -> str:
        return (f"CheckpointManager({str(self.base)!r}, keep_last={self.keep_last}, "
                f"keep_every={self.keep_every}, async_mode={self.async_mode}, incremental={self.incremental})")

    # ------------------------------------------------------------------ naming
    def name(self, step: int) -> str:
        """The directory name of ``step`` (relative to the base URI)."""
        return self.name_format.format(step=step)

    def uri(self, step: int) -> str:
        """``s3://bucket/run/<name(step)>``."""
        return str(self.base.child(self.name(step)))

    def _step_of(self, relative_dir: str) -> int | None:
        m = self._pattern.match(relative_dir)
        if m is None:
            return None
        step = int(m.group(1))
        return step if self.name(step) == relative_dir else None  # only names we would write

    # ------------------------------------------------------------------ save
    def save(self, step: int, state_dict: dict[str, Any]) -> concurrent.futures.Future | None:
        """Save ``state_dict`` as checkpoint ``step`` (all ranks, same step).

        Async mode: returns a future that resolves to the DCP ``Metadata`` once the checkpoint
        is committed and retention has run. The training loop may change ``state_dict`` as
        soon as this returns with ``staging="blocking"`` (the default); with
        ``staging="background"`` only once staging is complete (:meth:`wait_staged`, or the
        future's ``staging_completion``): a tensor changed before fails the save with
        :class:`~s3dcp.errors.TornCheckpointError`, raised by the next ``save()`` (docs/memory.md).
        A save while ``max_inflight_checkpoints`` saves still upload waits
        (in staging) for the oldest to end its upload.
        Sync mode: returns ``None`` once committed. Raises the error of an earlier failed
        asynchronous save that nobody has seen yet, before starting this one.
        """
        if not _is_int(step) or step < 0:
            raise ConfigError(f"step={step!r} must be an int >= 0")
        if self._tiers is not None and _multi_rank(self.process_group):
            # what the last save became decides this one's tiers, and its error is raised here: every
            # rank must know it (the next save's staging waits for that save's upload anyway)
            self._saves.drain()
        self._saves.raise_finished()
        refuse_older(self, step)
        import torch.distributed.checkpoint as dcp

        from ..saving.statetree import flattened
        from ..saving.writer import S3StorageWriter

        base = self._choose_base(step) if self.incremental else None
        copy, to_s3 = None, True
        if self._tiers is not None:
            state_dict = flattened(state_dict)  # Stateful values as DCP saves them: sized and saved once
            copy, to_s3 = self._tiers.begin_save(step, state_dict)
        try:
            writer = ours(S3StorageWriter(self.uri(step), config=self.config, client=self.client,
                                          incremental_from=None if base is None else self.uri(base),
                                          # the default; said for config.checksum=None, which records none
                                          item_checksum=REFERENCE_CHECKSUM if self.incremental else None,
                                          local_copy=copy, upload=to_s3))
            self.last_writer = writer
            no_dist = not _dist_on()
            started = time.perf_counter()
            if not self.async_mode:
                metadata = dcp.save(state_dict, storage_writer=writer, process_group=self.process_group,
                                    no_dist=no_dist)
            else:
                response = dcp.async_save(state_dict, storage_writer=writer, process_group=self.process_group,
                                          no_dist=no_dist)
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            self._release_base(step)
            error = self._unwrapped(e)
            if copy is not None:
                self._tiers.failed(copy, error)
            raise error
        if not self.async_mode:
            self._release_base(step)
            try:
                stored_in = self._committed(writer, step, copy, metadata, to_s3)
            except BaseException as e:  # noqa: BLE001
                raise self._unwrapped(e)
            elapsed = time.perf_counter() - started
            if "s3" in stored_in:
                self._after_commit(step, writer, metadata, stall_s=elapsed, upload_s=elapsed)
            return None

        inner = getattr(response, "upload_completion", response)  # AsyncSaveResponse or Future
        returned = time.perf_counter()
        outer = self._saves.start(getattr(response, "staging_completion", None))  # its staging_completion too

        def done(f: concurrent.futures.Future) -> None:
            self._release_base(step)  # committed (its references protect what it uses) or failed
            try:
                metadata = f.result()
            except BaseException as e:  # noqa: BLE001 - the caller sees it on the future
                error = self._unwrapped(e)  # s3dcp's (or the original) error
                log.error("checkpoint step %d to %s failed: %s: %s", step, self.uri(step),
                          type(error).__name__, " ".join(str(error).split()))
                if copy is not None:
                    self._tiers.failed(copy, error)
                outer.set_exception(error)
                return
            upload_s = time.perf_counter() - returned
            try:  # whatever happens after the commit reaches the caller: wait() and close() never hang
                stored_in = self._committed(writer, step, copy, metadata, to_s3)
                if "s3" in stored_in:
                    self._after_commit(step, writer, metadata, stall_s=returned - started, upload_s=upload_s)
            except BaseException as e:  # noqa: BLE001
                return outer.set_exception(e)
            outer.set_result(metadata)

        inner.add_done_callback(done)
        return outer

    def _unwrapped(self, error: BaseException) -> BaseException:
        """The error to raise for DCP's ``error`` (:func:`unwrap_error`), with the TLS/plain-HTTP
        diagnosis of the endpoint when no HTTP answer came."""
        return diagnose(unwrap_error(error), self.client.config.endpoint_url)

    def _choose_base(self, step: int) -> int | None:
        return choose_base(self, step, multi_rank=_multi_rank(self.process_group))

    def _release_base(self, step: int) -> None:
        with self._lock:
            self._bases_in_use.pop(step, None)

    def wait_staged(self) -> None:
        """Background staging (docs/memory.md): before the optimizer step, wait for the last save's copy."""
        self._saves.wait_staged()

    def wait(self) -> None:
        """Wait for every save in flight (and, with local_replicas, its replication); raise the
        first error among them (once)."""
        self._saves.wait()
        if self._tiers is not None:
            self._tiers.wait()

    def close(self) -> None:
        """Wait for the saves in flight (raising their error), then close the client the
        manager made (one passed in stays open). The manager may be used again after."""
        try:
            self.wait()
        finally:
            self._close_client()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # do not mask the error that is already on its way out
            self._saves.drain()
            self._close_client()

    def _close_client(self) -> None:
        if self._owns_client:
            self.client.close()  # an S3Client is usable again after close: it takes a native client again

    def _committed(self, writer: S3StorageWriter, step: int, copy=None, metadata=None, to_s3: bool = True) -> tuple:
        """Where step ``step`` is held now that its save returned (with a local tier: once every
        rank agreed on what each copy became; raises where nothing holds it)."""
        stats = writer.last_stats
        if copy is not None:  # the local copy is complete; then replicated, older ones retained
            outcome = self._tiers.committed(step, copy, metadata=metadata, in_s3=to_s3)
            stats = dataclasses.replace(stats, **dataclasses.asdict(outcome))
            if self._is_coordinator():
                self._tiers.tell(step, self.uri(step), outcome)
        with self._lock:
            self._newest = later(self._newest, step)
            if "s3" in stats.stored_in:
                self._newest_in_s3 = later(self._newest_in_s3, step)
        self.last_save_stats = stats
        record_committed(stats)  # s3dcp.last_save_stats()
        return stats.stored_in

    def _after_commit(self, step: int, writer: S3StorageWriter, metadata: Any, *,
                      stall_s: float, upload_s: float) -> None:
        if not self._is_coordinator():
            return
        try:
            stored = sum(loc.length for loc in (getattr(metadata, "storage_data", None) or {}).values())
            stall = writer.last_stats.stage_s if self.async_mode else stall_s
            # DEBUG: the writer already logs the one INFO line of this checkpoint
            log.debug("checkpoint step %d committed to %s: %d bytes, stall %.3fs, upload %.3fs, %.3f GB/s",
                     step, self.uri(step), stored, stall, upload_s, stored / upload_s / 1e9 if upload_s > 0 else 0.0)
            self._apply_retention(just_saved=step)
        except Exception:  # noqa: BLE001 - retention must never fail a committed save
            log.warning("retention after checkpoint step %d failed; older checkpoints stay", step, exc_info=True)

    # ------------------------------------------------------------------ retention
    def _apply_retention(self, just_saved: int) -> list[int]:
        return apply_retention(self, just_saved)

    # ------------------------------------------------------------------ discovery
    def list(self) -> list[CheckpointInfo]:
        """Every checkpoint directory under the base URI, committed or not, sorted by step; a
        deleted checkpoint whose objects are kept only because others reference them is not
        listed."""
        try:
            return list_checkpoints(self.client, self.base, self._step_of)
        except S3ConnectionError as e:
            raise diagnose(e, self.client.config.endpoint_url)

    def latest(self) -> int | None:
        """The newest committed step, or ``None``; a newer incomplete one is ignored.

        Collective under ``torch.distributed``: the coordinator lists, every rank gets its
        answer (or its error). Saves of this manager still in flight are waited for first.
        """
        return self._agreed_latest()[0]

    def _agreed_latest(self, outage_ok: bool = False) -> tuple[int | None, str | None]:
        """(:meth:`latest`, None); with ``outage_ok``, (None, why) on every rank where S3 could not
        be reached instead of that error (:func:`~s3dcp.lifecycle.directories.agreed`)."""
        self._saves.drain()
        return agreed(self._latest_local, self.process_group, self._is_coordinator(), outage_ok,
                      f"the coordinator could not list {self.base}")

    def _latest_local(self) -> int | None:
        committed = [info.step for info in self.list() if info.committed]
        return max(committed) if committed else None

    def load(self, state_dict: dict[str, Any] | Callable[[int], dict[str, Any]], step: int | None = None) -> int:
        """Load checkpoint ``step`` (default: :meth:`latest`) into ``state_dict`` in place
        (Stateful values get ``load_state_dict``; a function: called with the step chosen, it gives
        the dict, e.g. model-only for a seed checkpoint); return the step loaded. With ``local_dir``:
        the newest step the local copies, their replicas and S3 together hold in full, read from
        the nearest (:mod:`s3dcp.lifecycle.tiers`); :attr:`last_load_stats` says from where."""
        if self._tiers is not None:
            self._saves.drain()
            try:
                step, self.last_load_stats = self._tiers.restore(self, state_dict, step)
            except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
                raise self._unwrapped(e)
            with self._lock:  # a rollback may save again the steps kept on the nodes only (docs/restart.md)
                self._newest = self._newest_in_s3
            return step
        from .restore import from_s3  # (it imports torch: the light commands import this module)

        try:
            return from_s3(self, state_dict, step)
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            raise self._unwrapped(e)

    def _is_coordinator(self) -> bool:
        if not _dist_on():
            return True
        import torch.distributed as dist

        return dist.get_rank(self.process_group) == 0


def _multi_rank(process_group: Any) -> bool:
    """Whether saves run over more than one rank (then ranks must agree on collective choices)."""
    if not _dist_on():
        return False
    import torch.distributed as dist

    return dist.get_world_size(process_group) > 1


def _dist_on() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
