"""Streams and futures the client is built from (no S3 knowledge here)."""

from __future__ import annotations

import atexit
import ctypes
import heapq
import io
import itertools
import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable, Sequence

__all__ = ["BufferStream", "SizedReader", "Deadline", "Deadlines", "deadlines", "chain", "gather", "finalizer",
           "copy_into"]

log = logging.getLogger("s3dcp")

# Below this a copy is cheaper than the ctypes call and its GIL hand-off.
_RELEASE_GIL_FROM = 256 << 10


def _address(buffer) -> int | None:
    """The address of a contiguous buffer's first byte, or None where ctypes cannot take it
    without a copy (a read-only view other than a whole ``bytes``)."""
    if type(buffer) is bytes:
        return ctypes.cast(ctypes.c_char_p(buffer), ctypes.c_void_p).value
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    except (TypeError, ValueError):  # read-only or not contiguous
        return None


def copy_into(dest: memoryview, dest_offset: int, source, source_offset: int, n: int) -> None:
    """Copy ``n`` bytes of ``source`` (a ``bytes`` or a byte memoryview) into ``dest``.

    The CRT calls the body callbacks and the upload stream's ``readinto`` from its own threads,
    each holding the GIL; a large copy made there by slice assignment holds the GIL for its
    whole length (milliseconds per part), so a training loop's Python thread stalls behind
    every part of a background upload or load. ``ctypes.memmove`` does the same memcpy with the
    GIL released. ``dest`` and ``source`` stay referenced by the caller for the call's length.
    """
    if n >= _RELEASE_GIL_FROM:
        to = _address(dest)
        frm = _address(source)
        if to is not None and frm is not None:
            if min(dest_offset, source_offset) < 0 or dest_offset + n > dest.nbytes or source_offset + n > len(source):
                raise ValueError("copy_into: range outside its buffer")  # memmove would not check
            ctypes.memmove(to + dest_offset, frm + source_offset, n)
            return
    dest[dest_offset:dest_offset + n] = memoryview(source)[source_offset:source_offset + n]


class SizedReader(io.RawIOBase):
    """A read-only, seekable stream of ``size`` bytes at position ``_pos``: what the readers
    here and torch-checkpointing's (interop) share. Each says what a seek past the ends does."""

    size = 0
    _pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def _target(self, offset: int, whence: int) -> int:
        """Where ``seek(offset, whence)`` points, unbounded."""
        return {io.SEEK_SET: offset, io.SEEK_CUR: self._pos + offset, io.SEEK_END: self.size + offset}[whence]


class BufferStream(SizedReader):
    """A read-only stream over buffers sent back to back; ``readinto`` copies straight from
    the caller's memory into the CRT's part buffer (the only copy on the upload path)."""

    def __init__(self, buffers: Sequence) -> None:
        super().__init__()
        self._views = [memoryview(b).cast("B") for b in buffers if memoryview(b).nbytes]
        self.size = sum(v.nbytes for v in self._views)
        self._index = 0
        self._offset = 0
        self._pos = 0

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        target = max(0, min(self._target(offset, whence), self.size))
        self._pos, self._index, self._offset = target, 0, target
        while self._index < len(self._views) and self._offset >= self._views[self._index].nbytes:
            self._offset -= self._views[self._index].nbytes
            self._index += 1
        return target

    @property
    def views(self) -> list[memoryview]:
        """The caller's buffers as byte views (empty ones left out)."""
        return self._views

    def release(self) -> None:
        """Drop every reference to the caller's buffers (the request is over); reads return 0."""
        self._views = []
        self._index = self._offset = 0

    def readinto(self, b) -> int:
        out = memoryview(b).cast("B")
        n = 0
        while n < out.nbytes and self._index < len(self._views):
            view = self._views[self._index]
            take = min(out.nbytes - n, view.nbytes - self._offset)
            copy_into(out, n, view, self._offset, take)
            n += take
            self._offset += take
            if self._offset == view.nbytes:
                self._index, self._offset = self._index + 1, 0
        self._pos += n
        return n


class Deadline:
    """A pending :class:`Deadlines` entry; ``cancel()`` drops its callback (and everything the
    callback holds) at once, not when the deadline would have passed."""

    __slots__ = ("when", "callback")

    def __init__(self, when: float, callback: Callable[[], None]) -> None:
        self.when = when
        self.callback: Callable[[], None] | None = callback

    def cancel(self) -> None:
        self.callback = None


class Deadlines:
    """One daemon thread that runs callbacks at deadlines (request timeouts), instead of a
    timer thread per request. Shared by the whole process (:func:`deadlines`).

    A cancelled entry keeps nothing alive; the heap is compacted when cancelled entries make up
    most of it, so finished requests cost neither memory nor time until their deadline.
    """

    def __init__(self) -> None:
        self._heap: list = []
        self._cond = threading.Condition()
        self._counter = itertools.count()
        self._thread: threading.Thread | None = None

    def add(self, delay_s: float, callback: Callable[[], None]) -> Deadline:
        entry = Deadline(time.monotonic() + delay_s, callback)
        with self._cond:
            heapq.heappush(self._heap, (entry.when, next(self._counter), entry))
            if len(self._heap) > 64 and len(self._heap) > 2 * self._live():
                self._heap = [e for e in self._heap if e[2].callback is not None]
                heapq.heapify(self._heap)
            if self._thread is None or not self._thread.is_alive():  # none yet, or we are a forked child
                self._thread = threading.Thread(target=self._run, name="s3dcp-deadlines", daemon=True)
                self._thread.start()
            self._cond.notify()
        return entry

    def __len__(self) -> int:
        """Entries not cancelled yet (tests check that finished requests leave none)."""
        with self._cond:
            return self._live()

    def _live(self) -> int:
        return sum(1 for e in self._heap if e[2].callback is not None)

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._heap and self._heap[0][2].callback is None:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._cond.wait()
                    continue
                when, _, entry = self._heap[0]
                now = time.monotonic()
                if when > now:
                    self._cond.wait(when - now)
                    continue
                heapq.heappop(self._heap)
                callback, entry.callback = entry.callback, None
            try:
                if callback is not None:
                    callback()
            except Exception:  # pragma: no cover - a cancel racing completion
                log.debug("deadline callback failed", exc_info=True)


_DEADLINES = Deadlines()


def deadlines() -> Deadlines:
    """The process-wide :class:`Deadlines` (one thread for every client)."""
    return _DEADLINES


class _Finalizers:
    """The thread that runs what weakref finalizers hand it.

    A finalizer runs wherever its object happens to die: on any thread, at any allocation that
    starts a garbage collection, including inside a critical section that holds the very lock
    the finalizer's work needs (a non-reentrant lock then deadlocks; a reentrant one lets the
    work change state half-way through that section). So s3dcp's finalizers do nothing but
    ``SimpleQueue.put`` (reentrant, safe in finalizers), and this thread does the work.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopped = False  # at exit: the thread has ended, work runs where it is handed over
        atexit.register(self._finish)

    def wrap(self, work: Callable[[], None]) -> Callable[[], None]:
        """``work`` as a finalizer callback. Call this where the finalizer is registered (never
        from a finalizer): it makes sure the thread runs, in a forked child too."""
        if not self._running():
            with self._lock:
                if not self._running() and not self._stopped:
                    self._thread = threading.Thread(target=self._run, name="s3dcp-finalizers", daemon=True)
                    self._thread.start()
        put = self._queue.put

        def callback() -> None:
            # Once the thread has ended at exit (atexit handlers run on the main thread, holding
            # none of s3dcp's locks), the work runs here rather than wait in a queue no thread
            # serves. In a forked child the parent's thread is gone too, but the work waits for
            # the next registration to start one: run here, at whatever allocation collected the
            # object, it once started a thread inside a new thread's bootstrap and crashed the
            # child (a collection of S3Clients inherited from the parent).
            if self._stopped:
                work()
            else:
                put(work)

        return callback

    def _running(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive()  # a parent's thread is not alive in a fork

    def _run(self) -> None:
        while True:
            work = self._queue.get()
            if work is None:
                break
            self._do(work)
            del work
        while True:  # handed over while _finish was stopping the thread
            try:
                work = self._queue.get_nowait()
            except queue.Empty:
                return
            if work is not None:
                self._do(work)

    @staticmethod
    def _do(work: Callable[[], None]) -> None:
        try:
            work()
        except Exception:  # pragma: no cover - logged, the thread goes on
            log.warning("s3dcp finalizer failed", exc_info=True)

    def _finish(self) -> None:
        """At exit: let the thread do what it was handed and end, so that no work (freeing
        CRT clients, staging memory) is cut off half-way by the interpreter's finalization;
        finalizers that run after this (weakref's own exit hook) do their work in place."""
        self._stopped = True
        thread = self._thread
        if thread is not None and thread.is_alive():
            self._queue.put(None)
            thread.join(timeout=10.0)
        else:  # a forked child that never started its own: the work handed over is done here
            self._queue.put(None)
            self._run()


_FINALIZERS = _Finalizers()


def finalizer(work: Callable[[], None]) -> Callable[[], None]:
    """A callback for ``weakref.finalize`` that runs ``work`` on s3dcp's finalizer thread."""
    return _FINALIZERS.wrap(work)


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
