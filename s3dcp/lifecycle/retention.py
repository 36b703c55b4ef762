"""Retention's bookkeeping: the steps it chose to delete, remembered while a base choice may still
see them committed (so a save never takes a checkpoint being deleted as its base)."""

from __future__ import annotations

from typing import Iterable


class _Doomed:
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
