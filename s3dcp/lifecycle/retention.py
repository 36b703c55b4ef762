"""Retention: which committed steps a policy deletes (:func:`steps_to_delete`, pure), the
bookkeeping of those being deleted (:class:`Doomed`), remembered while a base choice may still see
them committed, so that a save never takes a checkpoint being deleted as its base, a manager's
retention after a commit (:func:`apply_retention`), and the base an incremental save builds on
(:func:`choose_base`), chosen under the same lock."""

from __future__ import annotations

import logging
from typing import Any, Iterable

from ..uri import parse_s3_uri
from .deletion import delete_checkpoint

__all__ = ["steps_to_delete", "Doomed", "apply_retention", "choose_base"]

log = logging.getLogger("s3dcp")


def steps_to_delete(committed: list[int], *, just_saved: int, keep_last: int | None, keep_every: int | None,
                    in_use: Iterable[int] = ()) -> list[int]:
    """The steps of ``committed`` (ascending) that retention deletes after ``just_saved`` committed:
    those outside the newest ``keep_last`` (None: keep all) and not a multiple of ``keep_every``;
    never the newest committed step, ``just_saved``, nor a step in ``in_use`` (the base of a
    save in flight)."""
    keep = {just_saved, *in_use}
    if keep_last is None:
        keep.update(committed)
    elif keep_last > 0:  # committed[-0:] would be all of it
        keep.update(committed[-keep_last:])
    if keep_every is not None:
        keep.update(step for step in committed if step % keep_every == 0)
    newest = max(committed, default=None)
    return [step for step in committed if step not in keep and step != newest]


class Doomed:
    """The steps retention chose to delete, each remembered only while a base choice may still
    see it committed. ``.metadata`` goes first, so a LIST that began after a deletion finished
    cannot list that step as committed; one that began before it may. A step is forgotten once
    its deletion finished and every LIST in flight began after that: a long job's manager holds
    only the deletions of the moment, not one entry per checkpoint it ever deleted. The
    manager's lock guards every call."""

    def __init__(self) -> None:
        self._steps: dict[int, int | None] = {}  # step -> deletions finished once its own had (None: running)
        self._finished = 0  # deletions finished so far
        self._listings: list[int] = []  # for each LIST in flight: deletions finished when it began

    def __contains__(self, step: int) -> bool:
        return step in self._steps

    def __len__(self) -> int:
        return len(self._steps)

    def add(self, steps: Iterable[int]) -> None:
        self._steps.update(dict.fromkeys(steps))

    def spare(self, step: int) -> None:
        """``step`` was saved again (and committed) after its deletion: a base again."""
        self._steps.pop(step, None)

    def deleted(self, step: int) -> None:
        self._finished += 1
        if step in self._steps:
            self._steps[step] = self._finished
        self._forget()

    def listing_started(self) -> int:
        self._listings.append(self._finished)
        return self._finished

    def listing_ended(self, started: int) -> None:
        self._listings.remove(started)
        self._forget()

    def _forget(self) -> None:
        oldest = min(self._listings, default=self._finished)
        for step, finished in list(self._steps.items()):
            if finished is not None and finished <= oldest:
                del self._steps[step]


def apply_retention(manager: Any, just_saved: int) -> list[int]:
    """A CheckpointManager's retention after ``just_saved`` committed (coordinator): delete the
    committed steps :func:`steps_to_delete` gives, never the base of a save in flight, each
    remembered in the manager's :class:`Doomed` while a base choice could still see it."""
    with manager._retention_lock:
        with manager._lock:
            manager._doomed.spare(just_saved)  # saved again after an earlier deletion: a base again
        committed = [info for info in manager.list() if info.committed]
        with manager._lock:  # a base of a save in flight stays (it is released when that save ends)
            steps = set(steps_to_delete([info.step for info in committed], just_saved=just_saved,
                                        keep_last=manager.keep_last, keep_every=manager.keep_every,
                                        in_use=manager._bases_in_use.values()))
            doomed = [info for info in committed if info.step in steps]
            manager._doomed.add(info.step for info in doomed)
        for info in doomed:
            result = delete_checkpoint(manager.client, parse_s3_uri(info.uri))
            with manager._lock:
                manager._doomed.deleted(info.step)
            kept = (f"; kept {len(result.kept)} object(s), {result.kept_bytes} bytes, that newer checkpoints "
                    "reference" if result.kept else "")
            log.info("retention: deleted checkpoint step %d (%s, %d bytes)%s", info.step, info.uri,
                     result.deleted_bytes, kept)
        return [info.step for info in doomed]


def choose_base(manager: Any, step: int, *, multi_rank: bool) -> int | None:
    """The step the incremental save of ``step`` uses as its base, claimed against
    retention until that save ends:

    - one save in flight (``max_inflight_checkpoints=1``, the default; always with several
      ranks): wait for it (commit and retention; staging waits for its upload anyway), then take
      the newest committed step, so back-to-back saves build on each other. Several ranks agree
      through the coordinator (``manager.latest()``, a collective that must not run beside a
      save's collectives on DCP's background thread);
    - more in flight, one process: the newest step committed when the save is called (one
      LIST), maybe the one before the save in flight (it only uploads more). Retention never
      deletes a base of a save in flight: base choice and retention's choice take one lock."""
    if multi_rank:
        latest = manager.latest()  # collective, after the save in flight (and its retention) ended
        base = latest if latest is not None and latest != step else None
        with manager._lock:
            if base is not None:
                manager._bases_in_use[step] = base
        return base
    if manager.config.max_inflight_checkpoints <= 1:  # build on the save in flight, not the one before
        manager._saves.drain()
        manager._saves.raise_finished()
    with manager._lock:
        listing = manager._doomed.listing_started()
    try:
        committed = [info.step for info in manager.list() if info.committed]  # one LIST; waits for no upload
    except BaseException:
        with manager._lock:
            manager._doomed.listing_ended(listing)
        raise
    with manager._lock:  # the same lock retention takes to choose: a base is never one it is deleting
        candidates = [s for s in committed if s != step and s not in manager._doomed]
        manager._doomed.listing_ended(listing)  # only now: what this LIST saw may be forgotten
        base = max(candidates) if candidates else None
        if base is not None:
            manager._bases_in_use[step] = base
    return base
