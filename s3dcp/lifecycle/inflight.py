"""Saves in flight: the futures of asynchronous saves, whose errors are raised once, by
whoever looks next (CheckpointManager, Lightning's S3CheckpointIO).

    save ──add(future)──► InFlight ──wait():   every one ended; the first error raised, each once
                                   ──raise_finished(): the first error among those ended (once)
                                   ──drain():  every one ended; errors left for wait()
                                   ──newest(): the last added (what a later step waits behind)
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

    def add(self, future: concurrent.futures.Future) -> None:
        with self._lock:
            self._futures.append(future)

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
