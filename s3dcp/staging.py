"""Staging for ``dcp.async_save``: the only part of a checkpoint the training loop waits for.

    training thread: async_save ─► stage(): copy every tensor into an arena of the pool ─► resume
                                     (CUDA: pinned arena, non_blocking copies on a side stream,
                                      an event; synchronize_staging() waits for the event only)
    background:      dcp.save(staged) ─► write_data uploads straight from the arena ─► release

The :class:`HostBufferPool` keeps its arenas across checkpoints and across writer instances
(one pool per process by default), so only the first checkpoint pays for allocating and
page-faulting host memory; later ones are a memcpy. Host memory taken by staging is
``max_inflight_checkpoints × min(state bytes, staging_budget_bytes)``, rounded up to 8 MiB.

Back-pressure: at most ``S3Config.max_inflight_checkpoints`` arenas are in use. A new
``async_save`` while that many uploads run waits in ``stage()`` for one to finish, instead of
doubling memory.

Bounded memory: with ``staging_budget_bytes`` smaller than the state, ``stage()`` copies what
fits; the rest is copied into the arena in rounds by ``write_data`` as earlier uploads drain,
and the training thread is held (in ``synchronize_staging``) until the last round is copied.
The stall then includes uploading all rounds but the last: a trade of stall for memory.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .config import MiB

__all__ = ["HostBufferPool", "Arena", "StagingMixin", "shared_pool", "release_staging_memory"]

log = logging.getLogger("s3dcp")

_ALIGN = 64  # bytes; every staged tensor starts on a cache line
_ROUND = 8 * MiB  # arena sizes are rounded up so a slightly larger state reuses the arena


class Arena:
    """One contiguous host buffer (pinned when CUDA is there) carved into staged tensors."""

    def __init__(self, capacity: int, pinned: bool) -> None:
        self.capacity = capacity
        self.pinned = pinned
        self.buffer = _allocate(capacity, pinned)
        self.cursor = 0
        self.limit = capacity  # bytes of the buffer this checkpoint may use (its budget)

    def carve(self, nbytes: int) -> torch.Tensor | None:
        """The next ``nbytes`` of the arena as a uint8 tensor, or None when it does not fit."""
        start = -(-self.cursor // _ALIGN) * _ALIGN
        if start + nbytes > self.limit:
            return None
        self.cursor = start + nbytes
        return self.buffer[start:start + nbytes]

    def carve_like(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """An uninitialised tensor of ``tensor``'s dtype and shape in the arena, or None when
        it does not fit."""
        raw = self.carve(tensor.numel() * tensor.element_size())
        if raw is None:
            return None
        return raw.view(tensor.dtype).view(tensor.shape) if tensor.dim() else raw.view(tensor.dtype).reshape(())

    def owns(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" and (
            tensor.untyped_storage().data_ptr() == self.buffer.untyped_storage().data_ptr())


def _allocate(capacity: int, pinned: bool) -> torch.Tensor:
    buf = torch.empty(capacity, dtype=torch.uint8, pin_memory=pinned)
    buf.zero_()  # pre-fault every page now, not during the first checkpoint's copy
    return buf


class HostBufferPool:
    """Reusable staging arenas (see the module docstring).

    ``allocations`` counts arenas ever allocated: after the first checkpoint of a steady
    training job it stops growing.
    """

    def __init__(self, *, pin_memory: bool | None = None) -> None:
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._cond = threading.Condition()
        self._free: list[Arena] = []
        self._in_use = 0
        self._holders: set = set()  # the _Staging of each arena in use
        self.allocations = 0
        self.bytes_allocated = 0

    def acquire(self, nbytes: int, *, max_in_use: int = 1) -> Arena:
        """An arena of at least ``nbytes``, waiting while ``max_in_use`` are taken."""
        needed = max(_ROUND, -(-nbytes // _ROUND) * _ROUND)
        waited = None
        while True:
            self._reclaim_ended()  # saves that are over give their arena back first
            with self._cond:
                if self._in_use < max_in_use:
                    self._in_use += 1
                    arena = self._take_free(needed)
                    break
                running = [s.save_thread for s in self._holders
                           if s.save_thread is not None and s.save_thread.is_alive()]
                if waited is None:
                    waited = time.perf_counter()
                    log.debug("staging waits: %d checkpoint(s) still uploading (max_inflight_checkpoints=%d)",
                              self._in_use, max_in_use)
            if running:
                running[0].join(0.05)  # returns the moment that save is over
            else:
                with self._cond:
                    self._cond.wait(0.05)
        if waited is not None:
            log.debug("staging waited %.3fs for an earlier upload", time.perf_counter() - waited)
        if arena is None:
            try:
                arena = Arena(needed, self.pin_memory)
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

    def _take_free(self, needed: int) -> Arena | None:
        """A free arena that fits (the smallest), or None; called with the lock held. A free
        arena too small is dropped, so memory stays bounded when the state grows."""
        fits = [a for a in self._free if a.capacity >= needed]
        if fits:
            arena = min(fits, key=lambda a: a.capacity)
            self._free.remove(arena)
            return arena
        if self._free:
            dropped = max(self._free, key=lambda a: a.capacity)
            self._free.remove(dropped)
            self.bytes_allocated -= dropped.capacity
        return None

    def release(self, arena: Arena) -> None:
        with self._cond:
            self._free.append(arena)
            self._in_use -= 1
            self._cond.notify_all()

    def _hold(self, staging: "_Staging") -> None:
        with self._cond:
            self._holders.add(staging)

    def _unhold(self, staging: "_Staging") -> None:
        with self._cond:
            self._holders.discard(staging)

    def _reclaim_ended(self) -> None:
        """Take back the arenas of saves that have ended: their thread is gone. That is how a
        save that succeeded is released too (after its commit and the collectives around it),
        and how one that failed anywhere, even before write_data, never holds memory."""
        with self._cond:
            ended = [s for s in self._holders if s.ended()]
        for staging in ended:
            staging.release()

    def clear(self) -> None:
        """Free the arenas not in use (their memory goes back to the system)."""
        with self._cond:
            self.bytes_allocated -= sum(a.capacity for a in self._free)
            self._free.clear()

    @property
    def in_use(self) -> int:
        self._reclaim_ended()
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


# ---------------------------------------------------------------------------- the stager
@dataclass(eq=False)
class _Staging:
    """One checkpoint's staging: its arena, the CUDA event, the items left for rounds."""

    pool: HostBufferPool
    arena: Arena
    event: Any = None  # torch.cuda.Event when copies ran on a side stream
    pending: bool = False  # some tensors did not fit the budget: write_data copies them in rounds
    done: threading.Event = field(default_factory=threading.Event)  # originals no longer needed
    released: bool = False
    save_thread: threading.Thread | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def release(self) -> None:
        """Give the arena back (once) and let the training thread go."""
        self.done.set()
        with self.lock:
            if self.released:
                return
            self.released = True
        self.pool._unhold(self)
        self.pool.release(self.arena)

    def uploaded(self) -> None:
        """write_data is over: the training thread may go on (rounds done). The arena is given
        back when the whole save has ended — its thread is gone — and not now, because the
        commit's collectives still run: a next async_save starting its own collectives on the
        same process group from another thread would interleave with them and deadlock."""
        self.done.set()
        if self.save_thread is None:  # no save thread of its own (a direct call): nothing else ends it
            self.release()

    def ended(self) -> bool:
        """The save that owns this staging is over (its thread is gone) and not yet released."""
        thread = self.save_thread
        return not self.released and thread is not None and not thread.is_alive()


class _StagedDict(dict):
    """A dict that can carry a weakref finalizer (plain dicts cannot)."""


class StagingMixin:
    """DCP's ``AsyncStager`` protocol for :class:`s3dcp.S3StorageWriter`.

    ``stage()`` runs on the training thread; everything else of the save runs in DCP's
    background executor. See the module docstring for memory and back-pressure.
    """

    _synchronize_after_execute: bool = True

    def _init_staging(self, pool: HostBufferPool | None) -> None:
        self._pool = pool
        self._staging: _Staging | None = None
        self._stage_started = 0.0
        self._stage_s = 0.0  # the last stall: stage() plus synchronize_staging()

    def _staging_getstate(self) -> dict[str, Any]:
        # In DCP's process executor the child gets the staged tensors (shared memory) and a
        # copy of the writer without the pool; rounds need the parent's arena, so say so.
        # The thread pickling us is the parent's side of that save: when it is gone, so is
        # the save, and the arena can be reclaimed.
        self._note_save_thread()
        pending = self._staging is not None and self._staging.pending
        return {"_pool": None, "_staging": None, "_needs_rounds": pending}

    def _note_save_thread(self) -> None:
        staging = self._staging
        if staging is not None and staging.save_thread is None and \
                threading.current_thread() is not threading.main_thread():
            staging.save_thread = threading.current_thread()

    @property
    def should_synchronize_after_execute(self) -> bool:
        return self._synchronize_after_execute

    def warm_up(self, state_dict: dict[str, Any]) -> None:
        """Allocate (and page-fault) the staging arena for ``state_dict`` before training."""
        pool = self._staging_pool()
        arena = pool.acquire(self._arena_bytes(state_dict), max_in_use=self._max_in_flight())
        pool.release(arena)

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Copy ``state_dict``'s tensors into the pool and return the staged copy.

        Same structure; tensors (DTensor and ShardedTensor local shards too) become contiguous
        host tensors in the arena; other values are deep-copied so that the training loop may
        change anything once staging is synchronised.
        """
        self._stage_started = time.perf_counter()
        pool = self._staging_pool()
        arena = pool.acquire(self._arena_bytes(state_dict), max_in_use=self._max_in_flight())
        staging = _Staging(pool, arena)
        pool._hold(staging)
        try:
            stream = _side_stream(state_dict)
            if stream is not None:
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    staged = _copy_tree(state_dict, lambda t: _stage_tensor(t, staging))
                staging.event = torch.cuda.Event()
                staging.event.record(stream)
            else:
                staged = _copy_tree(state_dict, lambda t: _stage_tensor(t, staging))
        except BaseException:
            staging.release()
            raise
        result = _StagedDict(staged)
        weakref.finalize(result, staging.release)  # safety net: a save that died before write_data
        if not staging.pending:
            staging.done.set()
        self._staging = staging
        self._stage_s = time.perf_counter() - self._stage_started
        return result

    def synchronize_staging(self) -> None:
        """Return once the staged copy is complete and the originals may change again."""
        staging = self._staging
        if staging is None:
            return
        if staging.event is not None:
            staging.event.synchronize()
        while not staging.done.wait(0.05):
            # A save that failed before write_data never releases the originals: stop
            # waiting when its thread is gone.
            if staging.ended():
                staging.release()
                break
        self._stage_s = time.perf_counter() - self._stage_started

    def close(self) -> None:
        """Nothing to free: the pool outlives writers (see :func:`release_staging_memory`)."""

    # ---------------------------------------------------------------- used by write_data
    def _staging_begin(self) -> "_Staging | None":
        """Called first thing in the save (on its thread): wait for the copies to land."""
        if getattr(self, "_needs_rounds", False):
            from .errors import ConfigError

            raise ConfigError(
                "staging_budget_bytes is smaller than the state, which needs the writer's own "
                "thread to copy the rest in rounds: use the thread executor, or raise the budget "
                "to fit the whole state for AsyncCheckpointerType.PROCESS")
        staging = self._staging
        if staging is not None:
            self._note_save_thread()
            if staging.event is not None:
                staging.event.synchronize()
        return staging

    def _max_in_flight(self) -> int:
        """``max_inflight_checkpoints``, except with several ranks: each save runs DCP's
        collectives on its own thread, and two saves' collectives on one process group from two
        threads can be issued in different orders on different ranks and deadlock. So a
        multi-rank job keeps one save in flight (and says so once)."""
        wanted = self.config.max_inflight_checkpoints
        if wanted > 1:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                global _WARNED_INFLIGHT
                if not _WARNED_INFLIGHT:
                    _WARNED_INFLIGHT = True
                    log.warning("max_inflight_checkpoints=%d needs a single process: with %d ranks the "
                                "saves' collectives would run from two threads at once; keeping one in flight",
                                wanted, dist.get_world_size())
                return 1
        return wanted

    def _staging_pool(self) -> HostBufferPool:
        if self._pool is None:
            self._pool = shared_pool()
        return self._pool

    def _arena_bytes(self, state_dict: dict[str, Any]) -> int:
        total = 0
        for t in _tensors(state_dict):
            total += -(-_nbytes(t) // _ALIGN) * _ALIGN
        budget = self.config.staging_budget_bytes
        return min(total, budget) if budget is not None else total


# ---------------------------------------------------------------------------- tree copying
def _copy_tree(value: Any, stage_tensor: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        local = stage_tensor(value._local_tensor)
        return DTensor(local, value._spec, requires_grad=False)
    if _is_sharded_tensor(value):
        return _copy_sharded_tensor(value, stage_tensor)
    if isinstance(value, torch.Tensor):
        return stage_tensor(value)
    if isinstance(value, dict):
        return {k: _copy_tree(v, stage_tensor) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy_tree(v, stage_tensor) for v in value]
    if isinstance(value, tuple):
        return tuple(_copy_tree(v, stage_tensor) for v in value)
    if isinstance(value, (int, float, str, bytes, bool, type(None))):
        return value
    return copy.deepcopy(value)


def _tensors(value: Any):
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        yield value._local_tensor
    elif _is_sharded_tensor(value):
        for shard in value.local_shards():
            yield shard.tensor
    elif isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def _is_sharded_tensor(value: Any) -> bool:
    try:
        from torch.distributed._shard.sharded_tensor import ShardedTensor
    except ImportError:  # pragma: no cover
        return False
    return isinstance(value, ShardedTensor)


def _copy_sharded_tensor(st, stage_tensor):
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor

    shards = [Shard(stage_tensor(s.tensor), s.metadata) for s in st.local_shards()]
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        shards, st.metadata(), process_group=st._process_group)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _stage_tensor(t: torch.Tensor, staging: _Staging) -> torch.Tensor:
    """Copy ``t`` into the arena; when it does not fit (budget), keep the original for the
    rounds in write_data."""
    t = t.detach()
    nbytes = _nbytes(t)
    if nbytes == 0:
        return torch.empty(t.shape, dtype=t.dtype)
    out = staging.arena.carve_like(t)
    if out is None:
        staging.pending = True
        return t
    out.copy_(t, non_blocking=t.device.type == "cuda" and staging.arena.pinned)
    return out


def _side_stream(state_dict: dict[str, Any]):
    """A dedicated CUDA stream for the device-to-host copies, when any tensor is on CUDA."""
    if not torch.cuda.is_available():
        return None
    if not any(t.device.type == "cuda" for t in _tensors(state_dict)):
        return None
    global _STREAM
    if _STREAM is None:
        _STREAM = torch.cuda.Stream()
    return _STREAM


_STREAM = None
_WARNED_INFLIGHT = False
