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
rest go when the last checkpoint referencing them goes. Choosing the base:

- one save in flight (``max_inflight_checkpoints=1``, the default; always with several
  ranks): :meth:`save` waits for it (commit and retention; staging waits for its upload
  anyway), then takes the newest committed step, so back-to-back saves build on each other.
  Several ranks agree through the coordinator (:meth:`latest`, a collective that must not run
  beside a save's collectives on DCP's background thread);
- more in flight, one process: the newest step committed when :meth:`save` is called (one
  LIST), maybe the one before the save in flight (it only uploads more). Retention never
  deletes a base of a save in flight: base choice and retention's choice take one lock.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from ..config import S3Config
from ..errors import CheckpointError, CheckpointNotFoundError, ConfigError, unwrap_error
from ..format.layout import METADATA_NAME, is_data_object
from ..format.references import REFERENCE_CHECKSUM, check_base
from ..s3.client import S3Client
from ..saving.stats import record_committed
from ..uri import S3Uri, parse_s3_uri
from .deletion import DeleteResult
from .deletion import delete_checkpoint as _delete_checkpoint
from .deletion import held_for_references
from .directories import CheckpointInfo, name_pattern, scan_directories
from .inflight import InFlight
from .retention import Doomed, steps_to_delete

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

    :attr:`last_save_stats`: this rank's :class:`~s3dcp.saving.writer.SaveStats` of the save that
    committed last (bytes uploaded and inherited, seconds), as ``s3dcp.last_save_stats()``.

    Errors of an asynchronous save reach its future and are raised again by :meth:`wait`,
    :meth:`close`, or the next :meth:`save` (so none goes unnoticed). A failed save never
    triggers retention. Every error is raised as :func:`s3dcp.unwrap_error` gives it — the
    rank's own (an :class:`~s3dcp.errors.S3DCPError` when s3dcp raised it) with
    ``failed_ranks`` and ``rank_errors``, chained from DCP's ``CheckpointException`` — never
    the ``CheckpointException`` itself (a ``BaseException``).
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
    ) -> None:
        if keep_last is not None and (not _is_int(keep_last) or keep_last < 1):
            raise ConfigError(f"keep_last={keep_last!r} must be an int >= 1 (or None to keep every checkpoint)")
        if keep_every is not None and (not _is_int(keep_every) or keep_every < 1):
            raise ConfigError(f"keep_every={keep_every!r} must be an int >= 1 or None")
        self.base = parse_s3_uri(base_uri)
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
        is committed and retention has run; the training loop may change ``state_dict`` as
        soon as this returns. A save while ``max_inflight_checkpoints`` saves still upload waits
        (in staging) for the oldest to end its upload.
        Sync mode: returns ``None`` once committed. Raises the error of an earlier failed
        asynchronous save that nobody has seen yet, before starting this one.
        """
        if not _is_int(step) or step < 0:
            raise ConfigError(f"step={step!r} must be an int >= 0")
        self._saves.raise_finished()
        import torch.distributed.checkpoint as dcp

        from ..saving.writer import S3StorageWriter

        base = self._choose_base(step) if self.incremental else None
        try:
            writer = S3StorageWriter(self.uri(step), config=self.config, client=self.client,
                                     incremental_from=None if base is None else self.uri(base),
                                     # the default; said for config.checksum=None, which records none
                                     item_checksum=REFERENCE_CHECKSUM if self.incremental else None)
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
            raise unwrap_error(e)  # chained from DCP's exception
        if not self.async_mode:
            self._release_base(step)
            self._committed(writer)
            elapsed = time.perf_counter() - started
            self._after_commit(step, writer, metadata, stall_s=elapsed, upload_s=elapsed)
            return None

        inner = getattr(response, "upload_completion", response)  # AsyncSaveResponse or Future
        returned = time.perf_counter()
        outer: concurrent.futures.Future = concurrent.futures.Future()
        outer.set_running_or_notify_cancel()

        def done(f: concurrent.futures.Future) -> None:
            self._release_base(step)  # committed (its references protect what it uses) or failed
            try:
                metadata = f.result()
            except BaseException as e:  # noqa: BLE001 - the caller sees it on the future
                error = unwrap_error(e)  # s3dcp's (or the original) error, chained from DCP's
                log.error("checkpoint step %d to %s failed: %s: %s", step, self.uri(step),
                          type(error).__name__, " ".join(str(error).split()))
                outer.set_exception(error)
                return
            upload_s = time.perf_counter() - returned
            try:  # whatever happens after the commit reaches the caller: wait() and close() never hang
                self._committed(writer)
                self._after_commit(step, writer, metadata, stall_s=returned - started, upload_s=upload_s)
            except BaseException as e:  # noqa: BLE001
                return outer.set_exception(e)
            outer.set_result(metadata)

        self._saves.add(outer)
        inner.add_done_callback(done)
        return outer

    def _choose_base(self, step: int) -> int | None:
        """The step the incremental save of ``step`` uses as its base, claimed against
        retention until that save ends (see the module docstring)."""
        if _multi_rank(self.process_group):
            latest = self.latest()  # collective, after the save in flight (and its retention) ended
            base = latest if latest is not None and latest != step else None
            with self._lock:
                if base is not None:
                    self._bases_in_use[step] = base
            return base
        if self.config.max_inflight_checkpoints <= 1:  # build on the save in flight, not the one before
            self._saves.drain()
            self._saves.raise_finished()
        with self._lock:
            listing = self._doomed.listing_started()
        try:
            committed = [info.step for info in self.list() if info.committed]  # one LIST; waits for no upload
        except BaseException:
            with self._lock:
                self._doomed.listing_ended(listing)
            raise
        with self._lock:  # the same lock retention takes to choose: a base is never one it is deleting
            candidates = [s for s in committed if s != step and s not in self._doomed]
            self._doomed.listing_ended(listing)  # only now: what this LIST saw may be forgotten
            base = max(candidates) if candidates else None
            if base is not None:
                self._bases_in_use[step] = base
        return base

    def _release_base(self, step: int) -> None:
        with self._lock:
            self._bases_in_use.pop(step, None)

    def wait(self) -> None:
        """Wait for every save in flight; raise the first error among them (once)."""
        self._saves.wait()

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

    def _committed(self, writer: S3StorageWriter) -> None:
        self.last_save_stats = writer.last_stats
        record_committed(writer.last_stats)  # s3dcp.last_save_stats()

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
        with self._retention_lock:
            with self._lock:
                self._doomed.spare(just_saved)  # saved again after an earlier deletion: a base again
            committed = [info for info in self.list() if info.committed]
            with self._lock:  # a base of a save in flight stays (it is released when that save ends)
                steps = set(steps_to_delete([info.step for info in committed], just_saved=just_saved,
                                            keep_last=self.keep_last, keep_every=self.keep_every,
                                            in_use=self._bases_in_use.values()))
                doomed = [info for info in committed if info.step in steps]
                self._doomed.add(info.step for info in doomed)
            for info in doomed:
                result = delete_checkpoint(self.client, parse_s3_uri(info.uri))
                with self._lock:
                    self._doomed.deleted(info.step)
                kept = (f"; kept {len(result.kept)} object(s), {result.kept_bytes} bytes, that newer checkpoints "
                        "reference" if result.kept else "")
                log.info("retention: deleted checkpoint step %d (%s, %d bytes)%s", info.step, info.uri,
                         result.deleted_bytes, kept)
            return [info.step for info in doomed]

    # ------------------------------------------------------------------ discovery
    def list(self) -> list[CheckpointInfo]:
        """Every checkpoint directory under the base URI, committed or not, sorted by step; a
        deleted checkpoint whose objects are kept only because others reference them is not
        listed."""
        infos = []
        by_dir = scan_directories(self.client, self.base)
        held = held_for_references(self.client, self.base.bucket, by_dir)  # deleted, objects kept for others
        for directory, objects in by_dir.items():
            if directory in held:
                continue
            relative = directory[len(self.base.dir_prefix):].rstrip("/")
            step = self._step_of(relative)
            if step is None:
                continue
            names = {o.key.rpartition("/")[2] for o in objects}
            if METADATA_NAME not in names and not any(is_data_object(n) for n in names):
                continue
            stamps = [o.last_modified for o in objects if o.last_modified is not None]
            infos.append(CheckpointInfo(
                step=step, uri=str(self.base.child(relative)), committed=METADATA_NAME in names,
                bytes=sum(o.size for o in objects), objects=len(objects),
                last_modified=max(stamps) if stamps else None))
        return sorted(infos, key=lambda i: i.step)

    def latest(self) -> int | None:
        """The newest committed step, or ``None``; a newer incomplete one is ignored.

        Collective under ``torch.distributed``: the coordinator lists, every rank gets its
        answer (or its error). Saves of this manager still in flight are waited for first.
        """
        self._saves.drain()
        if not _dist_on():
            return self._latest_local()
        box: list[Any] = [None]
        error: BaseException | None = None
        if self._is_coordinator():
            try:
                box[0] = ("ok", self._latest_local())
            except Exception as e:  # noqa: BLE001 - the other ranks must not hang on the broadcast
                error = e
                box[0] = ("error", f"{type(e).__name__}: {e}")
        import torch.distributed as dist

        dist.broadcast_object_list(box, group_src=0, group=self.process_group)
        if error is not None:
            raise error
        status, value = box[0]
        if status != "ok":
            raise CheckpointError(f"the coordinator could not list {self.base}: {value}")
        return value

    def _latest_local(self) -> int | None:
        committed = [info.step for info in self.list() if info.committed]
        return max(committed) if committed else None

    def load(self, state_dict: dict[str, Any], step: int | None = None) -> int:
        """Load checkpoint ``step`` (default: :meth:`latest`) into ``state_dict`` in place
        (Stateful values get ``load_state_dict``); return the step loaded."""
        if step is None:
            step = self.latest()
            if step is None:
                raise CheckpointNotFoundError(
                    f"no committed checkpoint under {self.base} (no directory matching "
                    f"{self.name_format!r} holds a {METADATA_NAME}); nothing to resume from")
        else:
            self._saves.drain()  # no DCP collective of ours may run beside a save's
        import torch.distributed.checkpoint as dcp

        from ..loading.reader import S3StorageReader

        reader = S3StorageReader(self.uri(step), config=self.config, client=self.client)
        try:
            dcp.load(state_dict, storage_reader=reader, process_group=self.process_group, no_dist=not _dist_on())
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            raise unwrap_error(e)  # chained from DCP's exception
        return step

    def _is_coordinator(self) -> bool:
        if not _dist_on():
            return True
        import torch.distributed as dist

        return dist.get_rank(self.process_group) == 0


def delete_checkpoint(client: S3Client, uri: S3Uri, *, on_deleted: Callable[[int], None] | None = None,
                      **age: float) -> DeleteResult:
    """Delete the checkpoint at ``uri`` (``.metadata`` first), keeping the objects other
    committed checkpoints under the same parent reference, and those of saves that may still run
    (``age``: ``older_than_s``, ``now``); see :func:`s3dcp.lifecycle.deletion.delete_checkpoint`.
    Unpacks as ``(objects deleted, bytes deleted)``."""
    return _delete_checkpoint(client, uri, on_deleted=on_deleted, **age)


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
