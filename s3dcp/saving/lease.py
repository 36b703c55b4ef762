"""A save's hold on an arena of the staging pool, and when it is over.

One save's hold on an arena is a :class:`Lease`. Its whole life, every path included:

1. ``stage()`` takes an arena from the pool (waiting while ``max_inflight_checkpoints`` are in
   use: back-pressure instead of doubling memory) and copies the state into it (in the order
   of :class:`~s3dcp.saving.copies.Copies`). The lease has *landed* once those copies are in —
   at the end of ``stage()``, or for a background stage once the staging thread has copied
   the rest and checked it (:mod:`s3dcp.saving.background`), with the error, if any, that the
   save must fail with. Giving the arena back waits for that.
2. The first writer call of the save, on whichever thread runs it (``reset``, ``storage_meta``,
   ``set_up_storage_writer``, ..., or pickling for the process executor), *attaches* the lease
   to that save call: the frame of DCP's save function on that thread's stack.
3. ``write_data`` uploads from the arena. With ``staging_budget_bytes`` below the state size
   it first copies the tensors that did not fit, in rounds, as uploads drain
   (:meth:`~s3dcp.saving.staging.StagingMixin._stage_rounds`); ``synchronize_staging`` holds the training thread
   until the last round is copied.
4. The lease is over when the save call it is attached to has returned — committed or failed,
   at any step — and then the pool takes the arena back: when the save's thread ends (DCP's
   thread executor ends it right after the save; see :class:`_SaveThread`), else at the next
   ``stage()``. Not earlier: after ``write_data`` the commit's collectives still run, and the
   next save's collectives issued beside them from another thread would deadlock a multi-rank
   job. Nothing here depends on which thread runs
   the save or whether DCP's executor makes a new thread per save; a thread reused for the next
   save has simply left the earlier save's frame.
5. Safety nets: a lease never attached (the save died before calling the writer) ends when
   the staged dict is garbage-collected; a writer driven by hand, outside DCP's save, releases
   at the end of ``write_data``. ``synchronize_staging`` stops waiting for rounds the moment
   the lease is over, so a save that fails early returns its error through its future.

Owns the :class:`Lease` and how its end is noticed (the save call it is attached to, the end
of the save's thread). It must not copy tensors (:mod:`s3dcp.saving.copies`) nor stage
(:mod:`s3dcp.saving.staging`).
"""

from __future__ import annotations

import logging
import sys
import threading
import weakref
from typing import Any

import torch

from ..memory.pool import Arena, HostBufferPool
from ..s3.streams import finalizer

__all__ = ["Lease"]

log = logging.getLogger("s3dcp")

# DCP's functions that run one whole save on the thread that calls the writer; the outermost on
# the stack is the save call a lease attaches to (thread executor, process executor, plain save).
_SAVE_CALLS = {
    ("torch.distributed.checkpoint._async_thread_executor", "save_wrapper"),
    ("torch.distributed.checkpoint._async_process_executor", "_execute_save_impl"),
    ("torch.distributed.checkpoint.state_dict_saver", "save"),
    ("torch.distributed.checkpoint.state_dict_saver", "_save_state_dict"),
}


class _SaveCall:
    """DCP's save function running on some thread: its frame, and whether it still runs.

    Whether it runs is asked of the frame object itself, never by walking another thread's
    stack: on CPython 3.11 ``sys._current_frames()`` can deadlock against the garbage
    collector (python/cpython#106883, not fixed in 3.11), and a walk of ``f_back`` of a
    running thread returned a logging handler instead of a frame once in CI."""

    __slots__ = ("frame", "async_save")

    def __init__(self, frame) -> None:
        self.frame = frame
        # started by dcp.async_save (its thread executor), not by a plain dcp.save
        self.async_save = (frame.f_globals.get("__name__"), frame.f_code.co_name) == _ASYNC_SAVE_WRAPPER

    @classmethod
    def of_caller(cls) -> "_SaveCall | None":
        """The outermost DCP save call on the current thread's stack, or None (not in a save)."""
        found = None
        frame = sys._getframe(1)
        while frame is not None:
            if (frame.f_globals.get("__name__"), frame.f_code.co_name) in _SAVE_CALLS:
                found = frame
            frame = frame.f_back
        return cls(found) if found is not None else None

    def running(self) -> bool:
        """Whether the call has not returned yet: a frame still executing cannot be cleared
        (documented), and one that has returned loses the locals it no longer needs."""
        try:
            self.frame.clear()
        except RuntimeError:
            return True
        return False


_ASYNC_SAVE_WRAPPER = ("torch.distributed.checkpoint._async_thread_executor", "save_wrapper")
# How long the save thread lets the training thread finish dcp.async_save first (see attach).
_RETURN_WAIT_S = 0.5


class Lease:
    """One save's hold on an arena of the pool (see the module docstring for its life)."""

    def __init__(self, pool: HostBufferPool, arena: Arena) -> None:
        self.pool = pool
        self.arena = arena
        self.events: list[tuple[int, Any]] = []  # (CUDA device, event after its copies into the arena)
        self.training_done: dict[int, Any] = {}  # CUDA device -> event after the work queued before stage()
        self.pending = False  # tensors beyond the budget: write_data copies them in rounds
        self.copied = threading.Event()  # every original is copied: the caller may change them
        # async_save returns: synchronize_staging is done (blocking), or DCP is taking the
        # staging Future's completion (background: StagingFuture.add_done_callback)
        self.returned = threading.Event()
        # stage()'s own copies have landed (a background stage's too, on its staging thread);
        # error: why the staged copy must not be saved (it is torn, or a copy failed)
        self.landed = threading.Event()
        self.error: BaseException | None = None
        # a background stage: per arena slab, its copies are in (write_data sends it then)
        self.slabs_in: list[threading.Event] = []
        self._save: _SaveCall | None = None
        self._released = False
        self._lock = threading.Lock()

    def attach(self) -> None:
        """Tie the lease to the DCP save call running on this thread (first call wins).

        A save started by ``dcp.async_save`` first lets the training thread finish async_save
        (:attr:`returned`): the save's planning is pure Python, and a training thread that needs
        the GIL back for its last lines waits out switch intervals (5 ms each) behind it. Not
        with rounds pending: the training thread then waits for this thread to copy them."""
        if self._save is None and not self._released:
            self._save = _SaveCall.of_caller()
            if self._save is not None:
                _this_thread().leases.add(self)
            if self._save is not None and self._save.async_save and not self.pending:
                if not self.returned.wait(_RETURN_WAIT_S):
                    log.debug("async_save did not return within %.1f s; the save goes on", _RETURN_WAIT_S)

    @property
    def attached(self) -> bool:
        return self._save is not None

    def over(self) -> bool:
        """The save is over: released, or the save call it is attached to has returned."""
        if self._released:
            return True
        save = self._save
        return save is not None and not save.running()

    def wait_device_copies(self) -> None:
        """Block until the device-to-host copies into the arena have landed."""
        for device, event in self.events:
            with torch.cuda.device(device):  # the waiting thread makes no CUDA context on device 0
                event.synchronize()

    def stream(self, filled_later: list[int]) -> None:
        """A background stage: the arena's slabs not in ``filled_later`` are in already; the
        staging thread says of each of the others when it is (:meth:`slab_in`)."""
        self.slabs_in = [threading.Event() for _ in self.arena.slabs]
        later = set(filled_later)
        for i, event in enumerate(self.slabs_in):
            if i not in later:
                event.set()

    def slab_in(self, slab: int) -> None:
        self.slabs_in[slab].set()

    def wait_in(self, tensor: torch.Tensor) -> None:
        """Block until the bytes of ``tensor`` (a staged tensor) are in the arena: those of its
        slab, for a background stage; at once for any other tensor. Raises the stage's error if
        it failed before they were (then every slab says it is in)."""
        arena = self.arena
        for slab, event in zip(arena.slabs if arena is not None else (), self.slabs_in):
            if slab.holds(tensor):
                event.wait()
                if self.error is not None:  # set before land() sets the slabs' events
                    raise self.error
                return

    def land(self, error: BaseException | None = None) -> None:
        """stage()'s copies are in the arena (``error``: they must not be saved); with no
        rounds pending, every original has been copied."""
        self.error = error
        for event in self.slabs_in:  # nothing waits on a slab for ever
            event.set()
        self.landed.set()
        if not self.pending:
            self.copied.set()

    def release(self) -> None:
        """Give the arena back, once, and let the training thread go."""
        self.copied.set()
        self.returned.set()
        with self._lock:
            if self._released:
                return
            self._released = True
        # a background stage's copies still running write into the arena: they end first
        self.landed.wait()
        # A stage that failed after its device copies were issued gives the arena back at once:
        # the next stage must not copy into it (nor the pool unpin it) while they still land.
        self.wait_device_copies()
        with self._lock:
            # Taken out under the lock, dropped outside it: dropping the save call's frame can
            # free the staged dict, whose finalizer calls release() again.
            save, self._save = self._save, None  # the frame (and what it holds) is not ours to keep
            arena, self.arena = self.arena, None  # a writer kept around does not keep the memory
        del save
        self.pool.unhold(self)
        self.pool.release(arena)


class _SaveThread(threading.local):
    """The leases attached on this thread, given back when the thread ends.

    DCP's thread executor runs each save on a thread of its own, which ends right after the
    save. Its end is the moment to give the arena back and free the staged copy (hundreds of
    tensor objects, ~2 ms of deallocation for 750): otherwise that waits for the next
    ``stage()`` to find the save over, on the training thread, inside its stall. A thread
    that lives on (a plain ``dcp.save`` on the main thread, an executor that keeps its thread)
    leaves it to that next check, as before."""

    def __init__(self) -> None:
        self.leases: weakref.WeakSet[Lease] = weakref.WeakSet()
        # The thread's locals die with it; this object's finalizer then hands the leases to
        # s3dcp's finalizer thread (a finalizer itself only queues work).
        self.token = _Token()
        weakref.finalize(self.token, finalizer(lambda leases=self.leases: _release_over(leases)))


class _Token:
    """An object to hang a finalizer on (``object()`` takes no weak references)."""


_SAVE_THREADS: _SaveThread | None = None  # made on first use: it starts the finalizer thread
_SAVE_THREADS_LOCK = threading.Lock()


def _this_thread() -> _SaveThread:
    global _SAVE_THREADS
    if _SAVE_THREADS is None:
        with _SAVE_THREADS_LOCK:
            if _SAVE_THREADS is None:
                _SAVE_THREADS = _SaveThread()
    return _SAVE_THREADS


def _release_over(leases: "weakref.WeakSet[Lease]") -> None:
    for lease in list(leases):
        if lease.over():
            lease.release()
