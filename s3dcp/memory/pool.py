"""Host memory for staging: arenas of shared-memory slabs, and the pool that keeps them.

An :class:`Arena` is the host memory of one checkpoint: a few :class:`~s3dcp.memory.slabs.Slab`
files (pinned where CUDA is available), each holding what becomes one data object, tensors
placed one after the other (64-byte aligned) until the object size target; a tensor larger than
the target gets a slab of its own. The CRT uploads each object from its slab's file. The
:class:`HostBufferPool` hands arenas out and takes them back, so only the first checkpoint of a
job pays for allocating and page-faulting host memory; later ones are a memcpy. It also bounds
how many checkpoints' staging arenas are in use at once (``max_inflight_checkpoints``):
:meth:`HostBufferPool.acquire` waits for a free one. A composed object's arena or a load's bounce
buffer (one slab each) is not counted among them.

    plan_slabs(sizes, target, budget) ──► slab sizes ──pool.acquire──► Arena ──reserve──► places

Who holds an arena, and when it comes back, is the stager's business (:mod:`s3dcp.saving.staging`):
the pool only asks each holder whether it is over (:meth:`Holder.over`) and takes back the
arenas of those that are.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Protocol, Sequence

import torch

from ..config import MiB
from .ring_buffer import align
from .slabs import Slab, can_pin

__all__ = ["Arena", "HostBufferPool", "Holder", "Placer", "plan_slabs", "shared_pool", "release_staging_memory",
           "ALIGN_BYTES"]

log = logging.getLogger("s3dcp")

ALIGN_BYTES = 64  # every staged tensor starts on a cache line
_POLL_S = 0.05
_MAX_VIEWS = 1 << 16  # staged tensors an arena keeps for reuse

Place = tuple[int, int]  # (slab index, byte offset in the slab)


_TAIL_BYTES = 64 << 10  # room after a slab's tensors for a save's small serialized values


def _rounded(nbytes: int) -> int:
    """A slab's capacity for ``nbytes``: with room for small values after them, rounded up (to
    1/16 of its power of two, at least 1 MiB), so that a slightly larger object next time
    reuses the slab."""
    if nbytes <= 0:
        return 0
    nbytes += _TAIL_BYTES
    grain = max(MiB, (1 << (nbytes.bit_length() - 1)) // 16)
    return -(-nbytes // grain) * grain


class Placer:
    """Where tensors go, one after the other: in the current slab, 64-byte aligned, while the
    slab stays within ``target_bytes`` (an object's size target) and within the slab's limit;
    then in the next slab. A tensor larger than the target gets a slab of its own, and the
    current slab stays current for the tensors after it.

    With ``limits`` (the slab sizes of an arena) a tensor that fits no remaining slab gets no
    place. Without them slabs are opened as needed, at most ``budget_bytes`` in all (a tensor
    that would pass the budget gets no place, a later smaller one may): that is how
    :func:`plan_slabs` sizes an arena, and the same rule then places the same tensors in it."""

    def __init__(self, target_bytes: int | None, limits: Sequence[int] | None = None,
                 budget_bytes: int | None = None) -> None:
        self.target = target_bytes
        self.limits = list(limits) if limits is not None else None
        self.budget = budget_bytes
        self.ends: list[int] = [0] if limits is None else [0] * len(self.limits)
        self.current = 0

    def place(self, nbytes: int) -> Place | None:
        if self.target is not None and nbytes > self.target:
            return self._alone(nbytes)
        while self.current < len(self.ends):
            end = self.ends[self.current]
            start = align(end, ALIGN_BYTES)
            fits_target = end == 0 or self.target is None or start + nbytes <= self.target
            if self.limits is not None:
                if fits_target and start + nbytes <= self.limits[self.current]:
                    return self._take(self.current, start, nbytes)
                # where the plan opened a slab: the next empty one that holds it becomes current;
                # where it had no room (the budget), none does and the current one stays
                for i in range(self.current + 1, len(self.ends)):
                    if self.ends[i] == 0 and nbytes <= self.limits[i]:
                        self.current = i
                        return self._take(i, 0, nbytes)
                return None
            if fits_target:
                if not self._within_budget(start + nbytes - end):
                    return None
                return self._take(self.current, start, nbytes)
            if not self._within_budget(nbytes):
                return None
            self.ends.append(0)
            self.current = len(self.ends) - 1
        return None

    def _alone(self, nbytes: int) -> Place | None:
        """A tensor larger than the target: a slab of its own, after the current one, which
        stays current (the small tensors after a large one fill it on)."""
        if self.limits is None:
            if not self._within_budget(nbytes):
                return None
            self.ends.append(0)
            return self._take(len(self.ends) - 1, 0, nbytes)
        for i in range(self.current, len(self.ends)):
            if self.ends[i] == 0 and nbytes <= self.limits[i]:
                return self._take(i, 0, nbytes)
        return None

    def _take(self, index: int, start: int, nbytes: int) -> Place:
        self.ends[index] = start + nbytes
        return index, start

    def _within_budget(self, more: int) -> bool:
        return self.budget is None or sum(self.ends) + more <= self.budget

    def reset(self) -> None:
        """Every slab empty again (the next round of a budget-bound save)."""
        self.ends = [0] * len(self.ends)
        self.current = 0


def plan_slabs(sizes: Sequence[int], target_bytes: int | None, budget_bytes: int | None = None) -> list[int]:
    """The slab sizes an arena needs for tensors of ``sizes`` bytes placed in order (see
    :class:`Placer`; empty tensors take no place). Always at least one slab. The last answer
    is remembered: a training job stages the same layout every time, and placing hundreds of
    tensors in Python is a few milliseconds of the stall."""
    key = (tuple(sizes), target_bytes, budget_bytes)
    last = _LAST_PLAN[0]
    if last is not None and last[0] == key:
        return list(last[1])
    placer = Placer(target_bytes, budget_bytes=budget_bytes)
    for n in key[0]:
        if n:
            placer.place(n)
    planned = [e for e in placer.ends if e] or [0]
    _LAST_PLAN[0] = (key, planned)
    return list(planned)


_LAST_PLAN: list = [None]  # (key, slab sizes) of plan_slabs' last call


class Arena:
    """The host memory of one checkpoint: slabs (pinned when CUDA is there) carved into
    staged tensors, each slab one data object's bytes (see :class:`Placer`)."""

    def __init__(self, sizes: Sequence[int], pinned: bool, prefault: bool = True) -> None:
        self.slabs = [Slab(_rounded(n), pinned, prefault) for n in sizes]
        self.pinned = all(s.pinned for s in self.slabs)
        self.placer = Placer(None, sizes)
        self.counted = True  # among the pool's staging arenas in use (HostBufferPool.acquire)
        self._typed: dict[tuple[int, torch.dtype], torch.Tensor] = {}  # each slab viewed as each dtype
        self._views: dict[tuple, torch.Tensor] = {}  # view_like's tensors by place, for the next checkpoint
        self._last_places: tuple | None = None  # reserve_all's last sizes and places

    @property
    def capacity(self) -> int:
        return sum(s.capacity for s in self.slabs)

    def fits(self, sizes: Sequence[int]) -> bool:
        """Whether slabs of ``sizes`` bytes can be this arena's (each size within a slab)."""
        have = sorted((s.capacity for s in self.slabs), reverse=True)
        want = sorted(sizes, reverse=True)
        return len(want) <= len(have) and all(w <= h for w, h in zip(want, have))

    def assign(self, sizes: Sequence[int], target_bytes: int | None) -> None:
        """Order the slabs for objects of ``sizes`` (each to a slab that holds it: :meth:`fits`)
        and start placing from the first. Staged views of a slab that moves are dropped."""
        free = sorted(range(len(self.slabs)), key=lambda i: self.slabs[i].capacity)
        order = []
        for n in sizes:
            i = next(i for i in free if self.slabs[i].capacity >= n)
            free.remove(i)
            order.append(i)
        order += free
        if order != list(range(len(self.slabs))):
            self.slabs = [self.slabs[i] for i in order]
            self._typed.clear()
            self._views.clear()
        self.placer = Placer(target_bytes, list(sizes) + [0] * (len(self.slabs) - len(sizes)))

    def reserve(self, nbytes: int) -> Place | None:
        """The place of the next ``nbytes`` (a slab and an aligned offset in it), now taken, or
        None when they fit no remaining slab. Plain integers: staging reserves every tensor's
        place before it makes the tensors that view them."""
        return self.placer.place(nbytes)

    def reserve_all(self, sizes: Sequence[int]) -> list[Place | None]:
        """:meth:`reserve` for each of ``sizes`` in order (0 bytes: no place). The same sizes in
        the same slabs as this arena's last call get the same places again, without placing
        each tensor anew (a few milliseconds of the stall for hundreds of tensors)."""
        key = (tuple(sizes), tuple(self.placer.limits or ()), self.placer.target)
        last = self._last_places
        if last is not None and last[0] == key and self.placer.ends == [0] * len(self.placer.ends):
            self.placer.ends, self.placer.current = list(last[2]), last[3]
            return last[1]
        places = [self.reserve(n) if n else None for n in key[0]]
        self._last_places = (key, places, list(self.placer.ends), self.placer.current)
        return places

    def reset(self) -> None:
        """Every slab empty again (a budget-bound save's next round, once the uploads from the
        arena have ended)."""
        self.placer.reset()

    def could_hold(self, nbytes: int) -> bool:
        """Whether ``nbytes`` would fit an empty slab of the arena (after :meth:`reset`)."""
        return any(nbytes <= limit for limit in self.placer.limits or ())

    def carve_like(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """An uninitialised contiguous tensor of ``tensor``'s dtype and shape in the arena, or
        None when it does not fit."""
        place = self.reserve(tensor.nbytes)
        return None if place is None else self.view_like(place, tensor)

    def view_like(self, place: Place, tensor: torch.Tensor) -> torch.Tensor:
        """A contiguous tensor of ``tensor``'s dtype and shape at ``place`` (from
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
        index, start = place
        key = (index, start, dtype, shape, strides)
        view = self._views.get(key)
        if view is not None:
            return view
        typed = self._typed.get((index, dtype))
        if typed is None:  # a slab's capacity is a whole number of MiB
            typed = self._typed[(index, dtype)] = self.slabs[index].buffer.view(dtype)
        view = typed.as_strided(shape, strides, start // tensor.element_size())
        if tensor.nbytes:
            if len(self._views) >= _MAX_VIEWS:  # a state whose layout keeps changing
                self._views.clear()
            self._views[key] = view
        return view

    @property
    def buffer(self) -> torch.Tensor:
        """The memory of a one-slab arena (a load's bounce window)."""
        if len(self.slabs) != 1:
            raise ValueError("buffer is the memory of a one-slab arena")
        return self.slabs[0].buffer

    def close(self) -> None:
        """Unpin the slabs (if pinned); their memory is freed once no staged tensor uses it."""
        self.unpin()

    def unpin(self) -> None:
        """Unregister the slabs from CUDA now; they stay usable as ordinary memory."""
        for slab in self.slabs:
            slab.unpin()
        self.pinned = False

    def owns(self, tensor: torch.Tensor) -> bool:
        return any(slab.holds(tensor) for slab in self.slabs)


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

    def acquire(self, sizes: Sequence[int] | int, *, target_bytes: int | None = None, max_in_use: int | None = 1,
                prefault: bool = True) -> Arena:
        """An arena with a slab for each of ``sizes`` (bytes; an int: one slab), its places
        given out by a :class:`Placer` with ``target_bytes`` over those sizes, waiting while
        ``max_in_use`` staging arenas are taken. ``max_in_use=None``: an arena of one slab (a
        composed object's, a load's bounce buffer), neither counted among those nor ever a
        staging arena taken for it. A new arena's pages are touched now unless ``prefault`` is
        False (the first copy into it then faults them in)."""
        needed = [max(0, sizes)] if isinstance(sizes, int) else [max(0, n) for n in sizes] or [0]
        counted = max_in_use is not None
        waited = None
        while True:
            self.reclaim()  # saves that are over give their arena back first
            with self._cond:
                if not counted or self._in_use < max_in_use:
                    self._in_use += counted
                    arena, dropped = self._take_free(needed, single_slab=not counted)
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
                    self._in_use -= counted
                    self._cond.notify_all()
                raise
            with self._cond:
                self.allocations += 1
                self.bytes_allocated += arena.capacity
        arena.counted = counted
        arena.assign(needed, target_bytes)
        return arena

    def _take_free(self, needed: list[int], single_slab: bool = False) -> tuple[Arena | None, Arena | None]:
        """A free arena that fits (the smallest), or None; and a free arena that does not,
        dropped so that memory stays bounded when the state grows (the caller closes it).
        ``single_slab``: only arenas of one slab are looked at (a staging arena of several is
        kept for the next stage). Called with the lock held."""
        free = [a for a in self._free if len(a.slabs) == 1] if single_slab else self._free
        fits = [a for a in free if a.fits(needed)]
        if fits:
            arena = min(fits, key=lambda a: a.capacity)
            self._free.remove(arena)
            return arena, None
        if free:
            dropped = max(free, key=lambda a: a.capacity)
            self._free.remove(dropped)
            self.bytes_allocated -= dropped.capacity
            return None, dropped
        return None, None

    def release(self, arena: Arena) -> None:
        with self._cond:
            self._free.append(arena)
            self._in_use -= arena.counted
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
