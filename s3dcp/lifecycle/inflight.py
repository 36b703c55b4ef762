"""Saves in flight: the futures of asynchronous saves, whose errors are raised once, by
whoever looks next (CheckpointManager, Lightning's S3CheckpointIO).

    save ──add(future), start()──► InFlight ──wait():   every one ended; the first error raised, each once
                                           ──raise_finished(): the first error among those ended (once)
                                           ──drain():  every one ended; errors left for wait()
                                           ──newest(): the last added (what a later step waits behind)
                                           ──wait_staged(): every background stage's copy made
"""

from __future__ import annotations

import concurrent.futures
import threading

__all__ = ["InFlight"]


class InFlight:
    """Futures of saves in flight (thread-safe); a future leaves once its error, or its
    success, has been seen by :meth:`wait` or :meth:`raise_finished`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._futures: list[concurrent.futures.Future] = []
        self._staging: list[concurrent.futures.Future] = []  # background stages not yet waited for

    def add(self, future: concurrent.futures.Future, staged: concurrent.futures.Future | None = None) -> None:
        """Track ``future``; ``staged``: its stage's completion when staging runs in the background
        (DCP's ``AsyncSaveResponse.staging_completion``), also set on ``future`` as
        ``staging_completion`` (an already completed one without it)."""
        if staged is None:
            staged = concurrent.futures.Future()
            staged.set_result(None)
        future.staging_completion = staged  # type: ignore[attr-defined]
        with self._lock:
            self._futures.append(future)
            # stages that completed unwaited-for (a loop that leaves the wait to the optimizer's
            # hook) leave, so that a long job keeps none of them
            self._staging = [s for s in self._staging if not s.done()]
            if not staged.done():
                self._staging.append(staged)

    def start(self, staged: concurrent.futures.Future | None = None) -> concurrent.futures.Future:
        """A new future for a save in flight (running), tracked as :meth:`add` tracks one."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_running_or_notify_cancel()
        self.add(future, staged)
        return future

    def wait_staged(self) -> None:
        """Wait until every background stage added so far has made its copy (the training loop
        may then change the state it saved)."""
        with self._lock:
            staging, self._staging = self._staging, []
        for staged in staging:
            staged.result()

    def newest(self) -> concurrent.futures.Future | None:
        with self._lock:
            return self._futures[-1] if self._futures else None

    def wait(self) -> None:
        """Wait for every one; raise the first error among them (once)."""
        with self._lock:
            pending, self._futures = self._futures, []
        concurrent.futures.wait(pending)
        _raise_first(pending)

    def raise_finished(self) -> None:
        """Raise the first error among those that have ended (once); the others stay."""
        with self._lock:
            finished = [f for f in self._futures if f.done()]
            self._futures = [f for f in self._futures if not f.done()]
        _raise_first(finished)

    def drain(self) -> None:
        """Wait for every one without consuming their errors."""
        with self._lock:
            pending = list(self._futures)
        concurrent.futures.wait(pending)


def _raise_first(futures: list[concurrent.futures.Future]) -> None:
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        raise errors[0]
