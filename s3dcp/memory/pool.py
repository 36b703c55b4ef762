"""Host memory for staging: arenas, and the pool that keeps them across checkpoints.

An :class:`Arena` is one contiguous host buffer (pinned where CUDA is available) that one
checkpoint's tensors are carved from. The :class:`HostBufferPool` hands arenas out and takes
them back, so only the first checkpoint of a job pays for allocating and page-faulting host
memory; later ones are a memcpy. It also bounds how many arenas are in use at once
(``max_inflight_checkpoints``): :meth:`HostBufferPool.acquire` waits for a free one.

Who holds an arena, and when it comes back, is the stager's business (:mod:`s3dcp.saving.staging`):
the pool only asks each holder whether it is over (:meth:`Holder.over`) and takes back the
arenas of those that are.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
import time
import weakref
from typing import Callable, Protocol

import torch

from ..config import MiB

__all__ = ["Arena", "HostBufferPool", "Holder", "shared_pool", "release_staging_memory", "ALIGN_BYTES"]

log = logging.getLogger("s3dcp")

ALIGN_BYTES = 64  # every staged tensor starts on a cache line
_ROUND = 8 * MiB  # arena sizes are rounded up so a slightly larger state reuses the arena
_POLL_S = 0.05
_MAX_VIEWS = 1 << 16  # staged tensors an arena keeps for reuse


class Arena:
    """One contiguous host buffer (pinned when CUDA is there) carved into staged tensors."""

    def __init__(self, capacity: int, pinned: bool, prefault: bool = True) -> None:
        self.capacity = capacity
        self.buffer, unpin, self.pinned = _allocate(capacity, pinned, prefault)
        # Unpinned before the memory can be freed: the pool closes an arena it drops, and a
        # collected arena's finalizer runs while its buffer is still alive.
        self._unpin = weakref.finalize(self, unpin) if unpin is not None else None
        self.cursor = 0
        self.limit = capacity  # bytes of the buffer this checkpoint may use (its budget)
        self._typed: dict[torch.dtype, torch.Tensor] = {}  # the buffer viewed as each dtype
        self._views: dict[tuple, torch.Tensor] = {}  # view_like's tensors by place, for the next checkpoint

    def carve(self, nbytes: int) -> torch.Tensor | None:
        """The next ``nbytes`` of the arena as a uint8 tensor, or None when it does not fit."""
        start = -(-self.cursor // ALIGN_BYTES) * ALIGN_BYTES
        if start + nbytes > self.limit:
            return None
        self.cursor = start + nbytes
        return self.buffer[start:start + nbytes]

    def carve_like(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """An uninitialised contiguous tensor of ``tensor``'s dtype and shape in the arena, or
        None when it does not fit."""
        start = self.reserve(tensor.nbytes)
        return None if start is None else self.view_like(start, tensor)

    def reserve(self, nbytes: int) -> int | None:
        """The offset of the next ``nbytes`` of the arena (aligned), now taken, or None when
        they do not fit. Plain integers: staging reserves every tensor's place (and starts
        copying into it) before it makes the tensors that view them."""
        start = -(-self.cursor // ALIGN_BYTES) * ALIGN_BYTES
        end = start + nbytes
        if end > self.limit:
            return None
        self.cursor = end
        return start

    def view_like(self, start: int, tensor: torch.Tensor) -> torch.Tensor:
        """A contiguous tensor of ``tensor``'s dtype and shape at offset ``start`` (from
        :meth:`reserve`). This runs once per tensor on the training thread, inside the stall:
        one ``as_strided`` of a cached typed view the first time, and the same tensor again for
        every later checkpoint that puts a tensor of that dtype and shape at that place (a
        dictionary lookup instead of ``as_strided``'s ~1.5 µs: ~1 ms of the stall for 750
        optimizer tensors, measured here). An arena serves one checkpoint at a time, so no two
        staged states share them; empty tensors are never reused (they all sit at 0)."""
        dtype, shape = tensor.dtype, tensor.shape
        if tensor.is_contiguous():  # the common case: its strides are the ones wanted
            strides = tensor.stride()
        else:
            strides, step = [], 1
            for size in reversed(shape):
                strides.append(step)
                step *= size
            strides = tuple(reversed(strides))
        place = (start, dtype, shape, strides)
        view = self._views.get(place)
        if view is not None:
            return view
        typed = self._typed.get(dtype)
        if typed is None:
            typed = self._typed[dtype] = self.buffer.view(dtype)  # capacity is a multiple of 8 MiB
        view = typed.as_strided(shape, strides, start // tensor.element_size())
        if tensor.nbytes:
            if len(self._views) >= _MAX_VIEWS:  # a state whose layout keeps changing
                self._views.clear()
            self._views[place] = view
        return view

    @property
    def address(self) -> int:
        """Where the buffer starts in host memory."""
        return self.buffer.data_ptr()

    def close(self) -> None:
        """Unpin the buffer (if pinned); its memory is freed once no staged tensor uses it."""
        self.unpin()

    def unpin(self) -> None:
        """Unregister the buffer from CUDA now; it stays usable as ordinary memory."""
        if self._unpin is not None:
            self._unpin()
        self.pinned = False

    def owns(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" and (
            tensor.untyped_storage().data_ptr() == self.buffer.untyped_storage().data_ptr())


def _allocate(capacity: int, pinned: bool,
              prefault: bool) -> tuple[torch.Tensor, Callable[[], None] | None, bool]:
    """A pre-faulted host buffer of exactly ``capacity`` bytes, how to unpin it, and whether it
    is pinned.

    Pinned arenas are ordinary memory registered with CUDA (``cudaHostRegister``), not
    ``pin_memory=True``: torch's caching host allocator rounds a pinned block up to a power of
    two (9 GB of state would pin 16 GB) and keeps it for the life of the process, while a
    registered buffer is exactly its size and is unregistered when the pool lets it go. It is
    mapped on its own pages: CUDA registers whole pages, and two arenas from the heap sharing
    one would fail the second registration. Where registering fails, torch's pinned allocator
    is the fallback, and ordinary memory where that fails too; in a child forked after the
    parent used CUDA (which CUDA cannot be used from) arenas are ordinary memory.

    ``prefault`` touches every page now (``warm_up``: the first checkpoint then copies into
    warm memory); without it the first copy into the arena faults the pages in, which costs
    less than touching them twice when the arena is made inside the stall anyway."""
    if pinned and can_pin():
        buf = _page_aligned(capacity)
        if prefault:
            buf.zero_()
        unpin = _register(buf)
        if unpin is not None:
            return buf, unpin, True
        try:
            buf = torch.empty(capacity, dtype=torch.uint8, pin_memory=True)
            buf.zero_()
            return buf, None, True
        except RuntimeError as e:
            log.warning("torch's pinned allocator failed too (%s); staging uses ordinary memory", e)
    buf = torch.empty(capacity, dtype=torch.uint8)
    if prefault:
        buf.zero_()
    return buf, None, False


def can_pin() -> bool:
    """Whether this process can pin memory: CUDA is there, and this is not a child forked after
    its parent initialised CUDA."""
    return torch.cuda.is_available() and not torch.cuda._is_in_bad_fork()


def _page_aligned(capacity: int) -> torch.Tensor:
    """``capacity`` bytes of anonymous memory on pages of their own, as a uint8 tensor; unmapped
    when the last tensor viewing it is gone."""
    return torch.frombuffer(mmap.mmap(-1, capacity), dtype=torch.uint8)


def _register(buf: torch.Tensor) -> Callable[[], None] | None:
    """Register ``buf`` with CUDA; return how to unregister it, or None if registering failed."""
    cudart = torch.cuda.cudart()
    ptr, pid = buf.data_ptr(), os.getpid()
    err = cudart.cudaHostRegister(ptr, buf.numel(), 0)
    if int(err) != 0:
        _clear_cuda_error()
        log.warning("cudaHostRegister of %d bytes failed (%s); staging uses torch's pinned allocator "
                    "instead (rounded up to a power of two)", buf.numel(), cudart.cudaGetErrorString(err))
        return None

    def unpin() -> None:
        if os.getpid() == pid:  # a forked child cannot call CUDA, and never registered it
            cudart.cudaHostUnregister(ptr)

    return unpin


def _clear_cuda_error() -> None:
    """Reset CUDA's last error after a failed call. torch's binding of ``cudaHostRegister``
    leaves it set, and the next kernel launch anywhere in the process would report it as its
    own failure. Best effort: through the libcudart torch loaded."""
    try:
        with open("/proc/self/maps") as maps:
            path = next((line.split()[-1] for line in maps if "libcudart.so" in line), None)
        if path is not None:
            ctypes.CDLL(path).cudaGetLastError()
    except OSError:
        log.debug("could not reset CUDA's last error", exc_info=True)


class Holder(Protocol):
    """What holds an arena of the pool (a save's staging lease)."""

    def over(self) -> bool:
        """Whether the save is over, so its arena may be taken back."""

    def release(self) -> None:
        """Give the arena back (idempotent)."""


class HostBufferPool:
    """Reusable staging arenas (see the module docstring).

    ``allocations`` counts arenas ever allocated: after the first checkpoint of a steady
    training job it stops growing.
    """

    def __init__(self, *, pin_memory: bool | None = None) -> None:
        self.pin_memory = can_pin() if pin_memory is None else pin_memory
        self._cond = threading.Condition()
        self._free: list[Arena] = []
        self._in_use = 0
        self._holders: set = set()
        self.allocations = 0
        self.bytes_allocated = 0

    def acquire(self, nbytes: int, *, max_in_use: int = 1, prefault: bool = True) -> Arena:
        """An arena of at least ``nbytes``, waiting while ``max_in_use`` are taken. A new
        arena's pages are touched now unless ``prefault`` is False (see :func:`_allocate`)."""
        needed = max(_ROUND, -(-nbytes // _ROUND) * _ROUND)
        waited = None
        while True:
            self.reclaim()  # saves that are over give their arena back first
            with self._cond:
                if self._in_use < max_in_use:
                    self._in_use += 1
                    arena, dropped = self._take_free(needed)
                    break
                if waited is None:
                    waited = time.perf_counter()
                    log.debug("staging waits: %d checkpoint(s) still uploading (max_inflight_checkpoints=%d)",
                              self._in_use, max_in_use)
                self._cond.wait(_POLL_S)  # woken at once by release(); the poll sees saves that ended
        if dropped is not None:
            dropped.close()  # unpinning gigabytes takes a while: not under the lock
        if waited is not None:
            log.debug("staging waited %.3fs for an earlier upload", time.perf_counter() - waited)
        if arena is None:
            try:
                arena = Arena(needed, self.pin_memory, prefault)
            except BaseException:
                with self._cond:
                    self._in_use -= 1
                    self._cond.notify_all()
                raise
            with self._cond:
                self.allocations += 1
                self.bytes_allocated += needed
        arena.cursor = 0
        arena.limit = max(nbytes, 1)
        return arena

    def _take_free(self, needed: int) -> tuple[Arena | None, Arena | None]:
        """A free arena that fits (the smallest), or None; and a free arena too small, dropped
        so that memory stays bounded when the state grows (the caller closes it). Called with
        the lock held."""
        fits = [a for a in self._free if a.capacity >= needed]
        if fits:
            arena = min(fits, key=lambda a: a.capacity)
            self._free.remove(arena)
            return arena, None
        if self._free:
            dropped = max(self._free, key=lambda a: a.capacity)
            self._free.remove(dropped)
            self.bytes_allocated -= dropped.capacity
            return None, dropped
        return None, None

    def release(self, arena: Arena) -> None:
        with self._cond:
            self._free.append(arena)
            self._in_use -= 1
            self._cond.notify_all()

    def hold(self, holder: Holder) -> None:
        with self._cond:
            self._holders.add(holder)

    def unhold(self, holder: Holder) -> None:
        with self._cond:
            self._holders.discard(holder)

    def reclaim(self) -> None:
        """Take back the arenas of holders whose save is over (succeeded or failed anywhere)."""
        with self._cond:
            holders = list(self._holders)
        for holder in holders:
            if holder.over():
                holder.release()

    def clear(self) -> None:
        """Free the arenas not in use (their memory goes back to the system)."""
        self.reclaim()
        with self._cond:
            dropped, self._free = self._free, []
            self.bytes_allocated -= sum(a.capacity for a in dropped)
        for arena in dropped:
            arena.close()

    @property
    def in_use(self) -> int:
        self.reclaim()
        return self._in_use


_shared: HostBufferPool | None = None
_shared_lock = threading.Lock()


def shared_pool() -> HostBufferPool:
    """The process-wide pool that writers use unless given one."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = HostBufferPool()
        return _shared


def release_staging_memory() -> None:
    """Free the shared pool's idle arenas (e.g. when training is over)."""
    if _shared is not None:
        _shared.clear()
