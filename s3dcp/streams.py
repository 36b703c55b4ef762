"""Streams and futures the client is built from (no S3 knowledge here)."""

from __future__ import annotations

import heapq
import io
import itertools
import logging
import threading
import time
from concurrent.futures import Future
from typing import Callable, Sequence

__all__ = ["BufferStream", "Deadlines", "chain", "gather"]

log = logging.getLogger("s3dcp")


class BufferStream(io.RawIOBase):
    """A read-only stream over buffers sent back to back; ``readinto`` copies straight from
    the caller's memory into the CRT's part buffer (the only copy on the upload path)."""

    def __init__(self, buffers: Sequence) -> None:
        super().__init__()
        self._views = [memoryview(b).cast("B") for b in buffers if memoryview(b).nbytes]
        self.size = sum(v.nbytes for v in self._views)
        self._index = 0
        self._offset = 0
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        target = {io.SEEK_SET: offset, io.SEEK_CUR: self._pos + offset, io.SEEK_END: self.size + offset}[whence]
        target = max(0, min(target, self.size))
        self._pos, self._index, self._offset = target, 0, target
        while self._index < len(self._views) and self._offset >= self._views[self._index].nbytes:
            self._offset -= self._views[self._index].nbytes
            self._index += 1
        return target

    def readinto(self, b) -> int:
        out = memoryview(b).cast("B")
        n = 0
        while n < out.nbytes and self._index < len(self._views):
            view = self._views[self._index]
            take = min(out.nbytes - n, view.nbytes - self._offset)
            out[n:n + take] = view[self._offset:self._offset + take]
            n += take
            self._offset += take
            if self._offset == view.nbytes:
                self._index, self._offset = self._index + 1, 0
        self._pos += n
        return n


class Deadlines:
    """One daemon thread that runs callbacks at deadlines (request timeouts), instead of a
    timer thread per request."""

    def __init__(self) -> None:
        self._heap: list = []
        self._cond = threading.Condition()
        self._counter = itertools.count()
        self._thread: threading.Thread | None = None

    def add(self, delay_s: float, callback: Callable[[], None]) -> None:
        with self._cond:
            heapq.heappush(self._heap, (time.monotonic() + delay_s, next(self._counter), callback))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="s3dcp-deadlines", daemon=True)
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._heap:
                    self._cond.wait()
                when, _, callback = self._heap[0]
                now = time.monotonic()
                if when > now:
                    self._cond.wait(when - now)
                    continue
                heapq.heappop(self._heap)
            try:
                callback()
            except Exception:  # pragma: no cover - a cancel racing completion
                log.debug("deadline callback failed", exc_info=True)


def chain(f: Future, outer: Future, handle: Callable) -> None:
    """Pass ``f``'s value to ``handle`` (which completes ``outer`` or starts the next page);
    any error lands on ``outer``."""
    try:
        handle(f.result())
    except BaseException as e:  # noqa: BLE001
        outer.set_exception(e)


def gather(futures: list[Future], combine: Callable) -> Future:
    outer: Future = Future()
    if not futures:
        outer.set_result(combine([]))
        return outer
    remaining = [len(futures)]
    lock = threading.Lock()

    def done(_f: Future) -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            errors = [f.exception() for f in futures if f.exception() is not None]
            if errors:
                outer.set_exception(errors[0])
            else:
                outer.set_result(combine([f.result() for f in futures]))

    for f in futures:
        f.add_done_callback(done)
    return outer
