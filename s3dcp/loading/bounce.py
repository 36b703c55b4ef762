"""Bounce memory for loads: a bounded window of slots, and the copy out of it into destinations.

    BounceWindow(slot_bytes, slots, pool)      one pool arena cut into equal slots
      take()  ──► a slot for one ranged GET (None when all are busy: issue later)
      ... GET lands in the slot, blocks verified, copier.copy(dest part, slot part) ...
      give(slot, tokens)  ──► the slot is free again once those copies are done
      close()  ──► waits for every copy, gives the arena back to the pool

A load whose bytes cannot land in their destination directly (part of an item, another dtype,
a GPU tensor) holds at most ``slots × slot_bytes`` of bounce memory, whatever the state's size.
The arena comes from a :class:`s3dcp.memory.pool.HostBufferPool`, pinned when CUDA is there, so
host-to-device copies run asynchronously on a side stream (:class:`CudaCopier`) while later
GETs are still in flight; a slot is reused only after the copies out of it are done.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ..memory.pool import HostBufferPool

__all__ = ["BounceWindow", "SyncCopier", "CudaCopier", "ThreadCopier", "DeviceCopier", "copier_for", "read_pool",
           "release_read_memory"]


class SyncCopier:
    """Copies on the calling thread (CPU destinations): done when ``copy`` returns."""

    def copy(self, dest: torch.Tensor, src: torch.Tensor) -> Any:
        dest.copy_(src)
        return None

    def done(self, token: Any) -> bool:
        return True

    def wait(self, token: Any) -> None:
        pass

    def close(self) -> None:
        pass


class CudaCopier:
    """Host-to-device copies on a side stream, ``non_blocking`` from pinned slots; the token is
    an event recorded after the copy. The side stream first waits for the work already queued on
    the current stream (e.g. a model's initialisation kernels, still running, that would write
    the destinations after the load's copies); the current stream waits for the side stream
    when the copier closes, so the loaded tensors are ready for work queued after the load."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self.stream.wait_stream(torch.cuda.current_stream(device))

    def copy(self, dest: torch.Tensor, src: torch.Tensor) -> Any:
        with torch.cuda.stream(self.stream):
            dest.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def done(self, token: Any) -> bool:
        return token is None or token.query()

    def wait(self, token: Any) -> None:
        if token is not None:
            token.synchronize()

    def close(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.stream)


class ThreadCopier:
    """Copies on a worker thread, finishing later: the CPU stand-in for :class:`CudaCopier`
    (tests use it to prove slots are not reused before the copies out of them end)."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="s3dcp-copy")
        self.delay_s = delay_s

    def copy(self, dest: torch.Tensor, src: torch.Tensor) -> Future:
        def run() -> None:
            if self.delay_s:
                threading.Event().wait(self.delay_s)
            dest.copy_(src)

        return self._pool.submit(run)

    def done(self, token: Future) -> bool:
        return token.done()

    def wait(self, token: Future) -> None:
        token.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def copier_for(device: torch.device):
    """The copier for destinations on ``device``."""
    if device.type == "cuda":
        return CudaCopier(device)
    return SyncCopier()


class DeviceCopier:
    """Copies each destination with the copier of its device (made on first use by
    :func:`copier_for`); tokens carry the copier that made them."""

    def __init__(self) -> None:
        self._by_device: dict = {}

    def copy(self, dest: torch.Tensor, src: torch.Tensor) -> Any:
        copier = self._by_device.get(dest.device)
        if copier is None:
            copier = self._by_device[dest.device] = copier_for(dest.device)
        return copier, copier.copy(dest, src)

    def done(self, token: Any) -> bool:
        copier, inner = token
        return copier.done(inner)

    def wait(self, token: Any) -> None:
        copier, inner = token
        copier.wait(inner)

    def close(self) -> None:
        for copier in self._by_device.values():
            copier.close()


class BounceWindow:
    """``slots`` slots of ``slot_bytes`` carved from one arena of ``pool``, taken for GETs and
    given back with the tokens of the copies still reading them (see the module docstring).
    Used by one thread (the reader's ``read_data``)."""

    def __init__(self, slot_bytes: int, slots: int, pool: HostBufferPool, copier) -> None:
        self.slot_bytes = slot_bytes
        self.pool = pool
        self.copier = copier
        self._arena = pool.acquire(slot_bytes * slots, max_in_use=None)
        self._free = [self._arena.buffer[i * slot_bytes:(i + 1) * slot_bytes] for i in range(slots)]
        self._draining: deque[tuple[torch.Tensor, list]] = deque()  # (slot, copy tokens), oldest first
        self.pinned = self._arena.pinned

    def take(self) -> torch.Tensor | None:
        """A free slot (a uint8 tensor of ``slot_bytes``), or None when every slot is busy
        or still being copied out of (call :meth:`wait_draining` when nothing else can move)."""
        self._reap()
        return self._free.pop() if self._free else None

    def give(self, slot: torch.Tensor, tokens: list) -> None:
        """The GET into ``slot`` ended; it is free once the copies ``tokens`` are done."""
        self._draining.append((slot, tokens))
        self._reap()

    def wait_draining(self) -> bool:
        """Wait for the oldest slot still being copied out of; False when there is none."""
        if not self._draining:
            return False
        slot, tokens = self._draining.popleft()
        for t in tokens:
            self.copier.wait(t)
        self._free.append(slot)
        return True

    def _reap(self) -> None:
        while self._draining and all(self.copier.done(t) for t in self._draining[0][1]):
            self._free.append(self._draining.popleft()[0])

    def close(self) -> None:
        """Wait for every copy, then give the arena back (a pinned one stays pooled for the
        next load; plain host memory is freed)."""
        try:
            while self.wait_draining():
                pass
            self.copier.close()
        finally:
            arena, self._arena = self._arena, None
            self._free = []
            if arena is not None:
                self.pool.release(arena)
                if not arena.pinned:
                    self.pool.clear()


_read_pool: HostBufferPool | None = None
_read_pool_lock = threading.Lock()


def read_pool() -> HostBufferPool:
    """The process-wide pool of load bounce arenas (pinned when CUDA is available), apart from
    the staging pool so a load never waits for a save's upload to give an arena back."""
    global _read_pool
    with _read_pool_lock:
        if _read_pool is None:
            _read_pool = HostBufferPool()
        return _read_pool


def release_read_memory() -> None:
    """Free the idle pinned bounce arenas kept for the next load."""
    if _read_pool is not None:
        _read_pool.clear()
