"""Restart from the nearest copy: a CheckpointManager's local tier, peer replicas and S3.

    save(step), every rank:
      begin_save     the first save learns the job (lifecycle/tier_sync.py, collective); every
                     s3_every-th checkpoint also goes to S3 (the first, and the one after a failed
                     save, included); copies of this step or later ones on the node are from before
                     a rollback and go; room is made in local_dir (local_keep_last,
                     local_budget_bytes, the disk's free space), before anything is written
      the writer     writes each object to local_dir/<step>/rank-<R>/ as it uploads it (or
                     instead: a local-only step), see saving/local_copy.py; a local error never
                     fails a step that also goes to S3
      committed      the save returned on this rank: .metadata written, then every rank agrees
                     (bounded) on what each rank's copy became, and all decide alike: seal the
                     markers, or drop the step's copies everywhere; then the copy is sent to a
                     peer node in the background (lifecycle/replicas.py); older copies go
    load(), every rank: lifecycle/restore.py

Owns the tier policy (which steps go where, what is kept, what a failed copy means for the
step); what a node's local_dir holds is lifecycle/holdings.py's, the files saving/local_copy.py's,
the transfers lifecycle/replicas.py's and loading/tiered.py's. What it cannot survive: a node lost
together with the node holding its replicas, for a step not in S3 (the restore then takes an
older step).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from .._private_dir import private_dir
from ..errors import ConfigError, LocalCopyError, LocalRoomError
from ..format.local import parse_rank_dir, rank_dir_name
from ..saving.local_copy import LocalCopy, make_private_dirs, not_committed, remove_copy
from ..uri import S3Uri
from .holdings import entries, scan

if TYPE_CHECKING:
    from .tier_sync import TierSync

# the restore and the tier's collectives need torch: imported where used, so that `s3dcp ls` and
# `rm`, which import the manager, do not pay for it

__all__ = ["LocalTier", "SaveOutcome"]

log = logging.getLogger("s3dcp")


@dataclass(frozen=True)
class SaveOutcome:
    """Where a committed save is held (every rank says the same): ``stored_in`` is ``("s3",
    "local")``, ``("local",)`` (kept on the nodes only, as planned or because S3 could not take
    it: ``s3_error``) or ``("s3",)`` (the node copies failed: ``local_error`` says on which rank
    and why)."""

    stored_in: tuple
    local_error: str | None = None
    s3_error: str | None = None  # why a step meant for S3 was kept on the nodes only (an outage)


class LocalTier:
    """The local (and peer) tier of one CheckpointManager (see the module docstring)."""

    def __init__(self, local_dir: str | os.PathLike, *, base: S3Uri, name: Callable[[int], str],
                 step_of: Callable[[str], int | None], s3_every: int = 1, keep_last: int = 2,
                 budget_bytes: int | None = None, replicas: int = 0, process_group: Any = None) -> None:
        for field, value, low, means in (
                ("s3_every", s3_every, 1, "every s3_every-th checkpoint also goes to S3 (1: every one); S3 is the "
                                          "durable tier, so a run that never writes it is not offered"),
                ("local_keep_last", keep_last, 1, "checkpoints kept on each node"),
                ("local_replicas", replicas, 0, "0, or 1 to keep each rank's copy on a rank of another node too")):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"{field}={value!r} must be an int >= {low}: {means}")
        if replicas > 1:
            raise ConfigError(f"local_replicas={replicas}: one replica per copy is supported (0 or 1)")
        if budget_bytes is not None and (not isinstance(budget_bytes, int) or isinstance(budget_bytes, bool)
                                         or budget_bytes <= 0):
            raise ConfigError(f"local_budget_bytes={budget_bytes!r} must be a positive int or None")
        if not isinstance(local_dir, (str, os.PathLike)) or not str(local_dir):
            raise ConfigError(f"local_dir={local_dir!r} must be a path (a directory of this run, e.g. /dev/shm/run7)")
        # private to the job: a copy another user could plant, a restore would load
        self.dir = Path(private_dir(local_dir, what="local_dir", tighten=True))
        self.base, self.name, self.step_of = base, name, step_of
        self.s3_every, self.keep_last, self.budget_bytes = s3_every, keep_last, budget_bytes
        self.replicas_wanted = replicas
        self.process_group = process_group
        self.sync: TierSync | None = None  # the job's layout, learned at the first save (collective)
        # the schedule, in saves begun (never in what an upload thread has finished: every rank decides
        # alike): the save of that number goes to S3, and so does the one after a failed copy
        self._begun = self._next_s3 = 0
        self._force_s3 = False
        self._writing: set[int] = set()  # steps whose copy is being written: never retained away
        # held while retention decides and deletes, and while a step starts or stops being
        # written: a save's commit (on an upload thread) retains while the next save begins
        self._lock = threading.RLock()

    @property
    def replicas(self):
        return self.sync.replicas if self.sync is not None else None

    def job(self) -> Any:
        """The job's layout (:class:`~s3dcp.lifecycle.tier_sync.TierSync`; None without
        torch.distributed): learned by the first save or restore, collectively, on every rank.
        Its gloo group carries the tier's own collectives whatever the job's backend (NCCL's
        carries no CPU tensors)."""
        if self.sync is None and _dist_on():
            from .tier_sync import TierSync

            self.sync = TierSync(self.process_group, replicas=bool(self.replicas_wanted))
        return self.sync

    # ------------------------------------------------------------------ save
    def begin_save(self, step: int, state_dict: dict) -> tuple[LocalCopy, bool]:
        """The local copy for ``step`` (``state_dict``: flattened, as DCP saves it) and whether it
        also goes to S3. Room is made for it now; where there is none, a step that also goes to
        S3 is saved there alone (a warning), and a local-only one fails on every rank (the copy
        carries the refusal, raised in write_data, which DCP spreads)."""
        if self.job() is None and self.replicas_wanted and self._begun == 0:
            log.warning("local_replicas=1 in a process without torch.distributed: there is no other node to "
                        "hold a replica, so none is kept")
        to_s3 = self._force_s3 or self._begun >= self._next_s3
        if to_s3:
            self._next_s3, self._force_s3 = self._begun + self.s3_every, False
        self._begun += 1
        from ..saving.statetree import tensors

        copy = LocalCopy(self.dir, self.name(step), str(self.base), step, required=not to_s3)
        with self._lock:
            self._drop_rolled_back(step)
            self._writing.add(step)  # before any retention can list its directory
            try:
                self._make_room(step, sum(t.nbytes for t in tensors(state_dict)))
            except LocalRoomError as e:
                copy.refusal = e
        return copy, to_s3

    def failed(self, copy: LocalCopy, error: BaseException | None = None) -> None:
        """The save of ``copy``'s step failed (on every rank: DCP spreads it, and ``error``, as
        :func:`~s3dcp.errors.unwrap_error` gives it, is the same on every rank): its copy goes.
        Where a node's copy was to blame, the next save goes to S3; an S3 failure (an outage)
        keeps the schedule, so the local-only steps between go on being kept."""
        with self._lock:
            self._writing.discard(copy.step)
            copy.discard()
        errors = list((getattr(error, "rank_errors", None) or {None: error}).values())
        if error is None or any(isinstance(e, LocalCopyError) for e in errors):
            self._force_s3 = True

    def committed(self, step: int, copy: LocalCopy, *, metadata: Any, in_s3: bool) -> SaveOutcome:
        """The save of ``step`` returned on this rank (``metadata``: DCP's, every rank gets it):
        write the copy's metadata, agree with every rank on what each copy became, then seal (or
        drop) alike, replicate, retain. A step held nowhere any more (local only, and a copy
        failed) raises :class:`LocalCopyError` on every rank."""
        from ..format.metadata import encode_metadata

        if copy.rank is None:  # written by DCP's process executor's child: this rank's, as DCP numbers it
            copy.rank = _rank(self.process_group)
        save_id = metadata.storage_meta.save_id
        s3_error = not_committed(metadata) if in_s3 else None  # the same on every rank: DCP's metadata says it
        try:
            marker = copy.prepare(encode_metadata(metadata), metadata.storage_data.values(), save_id=save_id,
                                  world_size=_world(self.process_group) if _dist_on() else 1,
                                  in_s3=in_s3 and s3_error is None, saved_at=time.time())
        except LocalCopyError as e:  # a required copy: every rank must hear of it, not raise alone
            marker = None
            copy.failure = e
        mine = None if marker is not None else f"rank {copy.rank}: {copy.failure}"
        try:
            said = self.sync.agree(save_id, mine) if self.sync is not None else [mine]
        except BaseException as e:
            self.failed(copy, e)
            raise
        failures = [why for why in said if why is not None]
        try:
            if not failures:
                copy.seal(marker)
                if self.replicas is not None:
                    self.replicas.submit(copy.root, copy.rank, save_id)
                if s3_error is not None:  # an S3 outage: the nodes keep the step, and the next one tries S3
                    self._force_s3 = True
                    return SaveOutcome(("local",), s3_error=s3_error)
                return SaveOutcome(("s3", "local") if in_s3 else ("local",))
            why = "; ".join(failures[:3]) + (f" (and {len(failures) - 3} more)" if len(failures) > 3 else "")
            if in_s3 and s3_error is None:  # S3 holds the step: the copies that are whole still serve their ranks
                if marker is not None:
                    copy.seal(marker)
                log.warning("checkpoint step %d is committed to S3, but its local copy failed on %d rank(s) (%s): "
                            "on a restart those ranks' parts come from S3", step, len(failures), why)
                return SaveOutcome(("s3",), why)
            with self._lock:
                copy.discard()
            self._force_s3 = True
            raise LocalCopyError(f"checkpoint step {step} was kept only on the nodes"
                                 f"{f' (S3 could not take it: {s3_error})' if s3_error else ''}, and its local copy "
                                 f"failed on {len(failures)} rank(s): {why}. Nothing holds the step: every rank "
                                 "dropped it, and the next checkpoint goes to S3")
        finally:
            with self._lock:
                self._writing.discard(step)
                self._retain(keep={step})

    def tell(self, step: int, uri: str, outcome: SaveOutcome) -> None:
        """The one INFO line of a committed save: where the step is held (never "committed to
        S3" for a step kept on the nodes only)."""
        if outcome.s3_error is not None:
            log.error("checkpoint step %d could not be committed to %s (%s): kept on the nodes only (%s); the next "
                      "checkpoint tries S3 again", step, uri, outcome.s3_error, self.dir)
        elif "local" not in outcome.stored_in:
            log.info("checkpoint step %d committed to %s; not kept on the nodes (its local copy failed)", step, uri)
        elif "s3" in outcome.stored_in:
            log.info("checkpoint step %d committed to %s and kept on the nodes (%s)", step, uri, self.dir)
        else:
            log.info("checkpoint step %d kept on the nodes only (%s), not in S3 (s3_every=%d: one checkpoint in %d "
                     "goes there)", step, self.dir, self.s3_every, self.s3_every)

    def wait(self) -> None:
        """Every replication so far done (raising its error, once)."""
        if self.replicas is not None:
            self.replicas.wait()

    # ------------------------------------------------------------------ retention
    def _mine(self, step_dir: Path) -> list[Path]:
        """This rank's directories in a step's: its own copy, the replicas it receives, and, on the
        node's first rank, those no rank of the node owns (lifecycle/tier_sync.py)."""
        ranks = sorted(r for d in entries(step_dir) if (r := parse_rank_dir(d.name)) is not None)
        if self.sync is not None:
            ranks = self.sync.owned(ranks)
        elif _dist_on():  # before the first save: only its own
            ranks = [r for r in ranks if r == _rank(self.process_group)]
        return [step_dir / rank_dir_name(r) for r in ranks]

    def _steps(self) -> list[tuple[int, Path]]:
        return sorted((s, d) for d in entries(self.dir) if (s := self.step_of(d.name)) is not None)

    def _usage(self) -> dict[int, int]:
        """Bytes of this rank's directories, by step (a replica being received counts as far as it is)."""
        return {step: sum(_size(f) for d in self._mine(step_dir) for f in entries(d))
                for step, step_dir in self._steps()}

    def _remove(self, step_dir: Path) -> bool:
        """Delete this rank's directories of a step; whether there were any."""
        mine = self._mine(step_dir)
        for d in mine:
            remove_copy(d)
        try:
            step_dir.rmdir()
        except OSError:
            pass
        return bool(mine)

    def _drop_rolled_back(self, step: int) -> None:
        """Saving ``step`` again, or one below the node's copies: those copies are of a line of
        training the run went back from (a rollback), and go before this save writes anything."""
        gone = [s for s, step_dir in self._steps()
                if s >= step and s not in self._writing | self._replicating() and self._remove(step_dir)]
        if gone:
            log.warning("local copies of step(s) %s in %s are from before this run went back to step %d or "
                        "earlier (a rollback, or a new run): removed", ", ".join(map(str, gone)), self.dir, step)

    def _retain(self, keep: set[int] = frozenset(), room_for: int = 0) -> None:
        """Delete this rank's copies beyond the newest ``keep_last`` complete steps, and older
        ones still while ``room_for`` more bytes would not fit the budget; never one in ``keep``,
        nor the newest complete step, nor one being written or replicated."""
        with self._lock:
            me = _rank(self.process_group)
            complete = sorted({s for (s, r) in scan(self.dir, str(self.base), self.step_of) if r == me})
            busy = self._writing | self._replicating()
            kept = set(complete[-self.keep_last:]) | set(keep) | set(complete[-1:]) | busy
            usage = self._usage()
            newest = complete[-1] if complete else None
            for step, step_dir in self._steps():
                over = self.budget_bytes is not None and sum(usage.values()) + room_for > self.budget_bytes
                if step in kept and not (over and step not in keep | busy and step != newest):
                    continue
                self._remove(step_dir)
                usage.pop(step, None)

    def _replicating(self) -> set[int]:
        """Steps whose copies are still being sent to, or received from, a peer."""
        if self.replicas is None:
            return set()
        return {s for root in self.replicas.pending() if (s := self.step_of(root.name)) is not None}

    def _make_room(self, step: int, nbytes: int) -> None:
        held = 1 + (len(self.replicas.source_ranks) if self.replicas is not None and self.replicas.active else 0)
        need = nbytes * held
        if self.budget_bytes is not None and need > self.budget_bytes:
            raise LocalRoomError(
                f"local_budget_bytes={self.budget_bytes} cannot hold checkpoint step {step}: this rank's "
                f"copy{' and the replicas it holds' if held > 1 else ''} take {need} bytes; raise it")
        self._retain(room_for=need)
        if self.budget_bytes is not None:
            used = sum(self._usage().values())
            if used + need > self.budget_bytes:
                raise LocalRoomError(
                    f"local_budget_bytes={self.budget_bytes} cannot hold checkpoint step {step} ({need} bytes) "
                    f"beside the newest complete local copy ({used} bytes, kept for a restart); raise the "
                    "budget or checkpoint less state")
        try:
            make_private_dirs(self.dir)
            free = shutil.disk_usage(self.dir).free
        except OSError as e:
            raise LocalRoomError(f"local_dir {self.dir} is not usable any more: {e}") from None
        ranks = self.sync.local_world if self.sync is not None else 1
        if free < need * ranks:
            raise LocalRoomError(
                f"local_dir {self.dir} has {free} bytes free; checkpoint step {step} needs {need} on this rank"
                f"{f' and as much on each of the node s {ranks - 1} other rank(s)' if ranks > 1 else ''} (a tmpfs "
                "such as /dev/shm: its size, or a container's --shm-size)")

    # ------------------------------------------------------------------ restore
    def restore(self, manager: Any, state_dict: dict | Callable[[int], dict],
                step: int | None = None) -> tuple[int, dict]:
        """Load the save the tiers hold in full (the newest, or of ``step``): see
        :func:`s3dcp.lifecycle.restore.restore`. Replications still going end first."""
        try:
            self.wait()
        except Exception as e:  # noqa: BLE001 - a replica it left incomplete has no marker: not used
            log.warning("a replication before this restore failed (%s); its copies are not used", e)
        from .restore import restore

        return restore(self, manager, state_dict, step)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:  # deleted meanwhile
        return 0


def _world(group: Any) -> int:
    import torch.distributed as dist

    return dist.get_world_size(group)


def _dist_on() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _rank(group: Any = None) -> int:
    if not _dist_on():
        return 0
    import torch.distributed as dist

    return dist.get_rank(group)
