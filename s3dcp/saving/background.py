"""Background staging: the copies of one stage that run while the training loop goes on.

    training thread: stage() ─► arena, staged dict, small copies, the guard's look ─► start()
                     ─► returns a Future at once (DCP: AsyncSaveResponse.staging_completion)
    staging thread:  large copies, slab by slab (CUDA: side stream, after the caller's queued
                     work; each slab's event synchronised) ─► each slab in (lease.slab_in)
                     ─► the guard compares ─► lease.land(error or None)
                     ─► the Future is done ─► the thread ends
    DCP's save thread: gets the staged dict from that Future at once (StagingFuture), plans,
                     and calls write_data, which sends each slab's object once the slab is in,
                     and before it returns waits for the landing: the lease's error is raised
                     (on every rank, through DCP's collective, and this rank's objects deleted)

The Future never fails: a torn copy or a failed copy is the lease's error, raised by
``write_data``. A failed staging Future would make DCP's save thread raise before its first
collective on this rank alone, and the other ranks would wait for it until their timeout.

An optimizer step taken while a background stage still copies waits for it: one global step
pre-hook of ``torch.optim`` (registered at the first background stage, kept for the process)
holds every ``Optimizer.step`` until the stages in flight have landed (a step given a
``closure``, as Lightning's, once the closure has run: forward and backward overlap the copy;
a ``torch.optim`` step calls its closure before it writes). The loop should wait
itself (``staging_completion``, ``CheckpointManager.wait_staged()``): the hook is the net for
the step that did not, and it covers what the version counters do not see: a fused optimizer's
writes, and a foreach one's on DTensors (FSDP2), bump none (saving/guard.py).

Owns the staging thread (one per process, started at the first background stage; it holds a
stage's sources, arena and staged dict only until that stage has landed). It
must not choose what is copied when (:mod:`s3dcp.saving.copies`) nor what counts as torn
(:mod:`s3dcp.saving.guard`).
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
from concurrent.futures import Future
from typing import Any, Callable

import torch

from .copies import Copies
from .guard import TornGuard
from .lease import Lease

__all__ = ["start", "StagingFuture"]

log = logging.getLogger("s3dcp")


def start(copies: Copies, guard: TornGuard, lease: Lease, staged: dict, names: Callable[[], list[str]],
          where: str) -> Future:
    """Run ``copies.run_later()`` on the staging thread and check ``guard`` after it; return the
    Future of ``staged`` (set once the lease has landed). ``names()`` names the sources, for an
    error; ``where`` is the checkpoint."""
    future = StagingFuture(staged, lease)
    future.set_running_or_notify_cancel()
    args = (copies, guard, lease, staged, future, names, where)
    failure: BaseException | None = None
    try:
        _hold_optimizer_steps()
        with _LOCK:
            _IN_FLIGHT.add(lease)
        queued = _WORKER.submit(lambda: _run(*args))  # False: no thread to be had (a process at its limit)
    except BaseException as e:  # noqa: BLE001 - the lease must land: one left in _IN_FLIGHT holds every step for ever
        queued, failure = False, e
    if not queued:  # _run lands the lease and takes it out of _IN_FLIGHT
        log.warning("could not start s3dcp's staging thread (%s); staging on the training thread",
                    "no thread to be had" if failure is None else f"{type(failure).__name__}: {failure}")
        _run(*args)
        if failure is not None and not isinstance(failure, Exception):
            raise failure  # KeyboardInterrupt, SystemExit: still the caller's, once the stage has landed
    return future


class StagingFuture(Future):
    """The Future of a background stage: done, and its callbacks run (DCP's
    ``staging_completion``), once every copy has landed and been checked.

    One caller gets its result at once: DCP's thread executor, which plans the save from the
    staged dict and calls the writer. Planning needs only the dict's structure, and write_data
    reads a slab's bytes once they are in (:meth:`~s3dcp.saving.lease.Lease.wait_in`), so the
    plan's collectives and the first objects' uploads run beside the copies of the others.
    Every other caller of :meth:`result` waits for the copies, as with any Future.

    DCP's save thread waits to plan until ``async_save`` is returning (its last step is to take
    this Future's completion: :meth:`add_done_callback`), or the stage has landed: the planning
    is Python, and a training thread that needs the GIL back for its last lines waits out
    switch intervals (5 ms each) behind it (:meth:`~s3dcp.saving.lease.Lease.attach`)."""

    def __init__(self, staged: dict, lease: Lease) -> None:
        super().__init__()
        self._staged = staged
        self._lease = lease

    def add_done_callback(self, fn: Callable[[Future], Any]) -> None:
        self._lease.returned.set()
        super().add_done_callback(fn)

    def result(self, timeout: float | None = None) -> Any:
        caller = sys._getframe(1)
        if (caller.f_globals.get("__name__"), caller.f_code.co_name) == _PLANS_THE_SAVE:
            return self._staged
        return super().result(timeout)


# DCP's thread executor's function that waits for the staged dict, then runs the save with it
_PLANS_THE_SAVE = ("torch.distributed.checkpoint._async_thread_executor", "save_wrapper")


class _Worker:
    """The process's staging thread: background stages, one after the other, handed over through
    a queue (``Thread.start`` waits until the new thread runs, milliseconds of the stall on a busy
    machine, so the thread is started once and kept). It holds nothing between two stages. A
    forked child starts a thread (and a queue) of its own (:func:`_after_fork_in_child`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, job: Callable[[], None]) -> bool:
        """Queue ``job`` for the thread (started if need be); False if no thread could start."""
        thread = self._thread
        if thread is None or not thread.is_alive():  # a parent's thread is not alive in a fork
            with self._lock:
                if self._thread is None or not self._thread.is_alive():
                    self._queue = queue.SimpleQueue()  # nothing of a parent's queue is this process's
                    thread = threading.Thread(target=self._serve, args=(self._queue,), name="s3dcp-staging",
                                              daemon=True)
                    try:
                        thread.start()
                    except RuntimeError:
                        return False
                    self._thread = thread
        self._queue.put(job)
        return True

    @staticmethod
    def _serve(jobs: queue.SimpleQueue) -> None:
        while True:
            job = jobs.get()
            try:
                job()  # _run: its outcome is on the lease and the Future
            except BaseException:  # noqa: BLE001 - pragma: no cover; the thread serves the next stage
                log.warning("s3dcp's staging thread failed", exc_info=True)
            del job  # nothing of a stage stays with the thread until the next one


_WORKER = _Worker()


def _run(copies: Copies, guard: TornGuard, lease: Lease, staged: dict, future: Future,
         names: Callable[[], list[str]], where: str) -> None:
    error: BaseException | None = None
    try:
        _seam("copying")
        issued: list = []  # slabs whose device copies are issued, with their events

        def slab_in(slab: int) -> None:
            lease.slab_in(slab)
            _seam("slab in")

        copies.run_later(lambda slab, events: issued.append((slab, events)) if events else slab_in(slab))
        for slab, events in issued:
            for device, event in events:
                with torch.cuda.device(device):
                    event.synchronize()
            slab_in(slab)
        lease.wait_device_copies()
        _seam("copied")
        error = guard.check(names, where)
    except BaseException as e:  # noqa: BLE001 - the save fails with it, on every rank (module docstring)
        error = e
        try:  # a copy that failed because the loop resized or replaced its source: say so
            torn = guard.check(names, where)
        except BaseException:  # noqa: BLE001 - the copy's own error stays the one raised
            torn = None
        if torn is not None:
            torn.__cause__, error = e, torn
    finally:
        guard.release()
        lease.land(error)
        lease.returned.set()  # nothing is left for the save's thread to wait for
        with _LOCK:
            _IN_FLIGHT.discard(lease)
        future.set_result(staged)


_LOCK = threading.Lock()
_IN_FLIGHT: set[Lease] = set()  # leases of background stages not landed yet (each leaves in _run's finally)
_HOOKED: list = []  # the global optimizer step pre-hook's handle, once registered


def _hold_optimizer_steps() -> None:
    """Register, once per process, the optimizer step pre-hook that waits for the stages in flight."""
    with _LOCK:
        if not _HOOKED:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            _HOOKED.append(register_optimizer_step_pre_hook(_before_optimizer_step))


def _before_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> tuple | None:
    """Every ``torch.optim`` step: wait until the background stages in flight have landed.

    A step given a ``closure`` (Lightning's automatic optimization: forward and backward run
    inside it) waits after the closure instead, so that they overlap the copy: the step gets a
    closure that runs the caller's, then waits (``torch.optim`` runs the closure before it
    writes a parameter)."""
    closure = kwargs.get("closure")
    if closure is None:
        _wait_for_stages()
        return None

    def closure_then_wait() -> Any:
        loss = closure()
        _wait_for_stages()
        return loss

    return args, {**kwargs, "closure": closure_then_wait}


def _wait_for_stages() -> None:
    with _LOCK:
        waiting = list(_IN_FLIGHT)
    for lease in waiting:
        if not lease.landed.is_set():
            log.debug("an optimizer step waits for background staging to complete")
            lease.landed.wait()


def _after_fork_in_child() -> None:
    """A forked child has none of its parent's stages: their jobs run on the parent's staging
    thread only, so their leases would never land here and hold every optimizer step of the
    child for ever; a lock another thread of the parent held is held for ever too."""
    global _LOCK, _WORKER
    _LOCK = threading.Lock()
    _IN_FLIGHT.clear()
    _WORKER = _Worker()


if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _seam(phase: str) -> Any:
    """A test seam on the staging thread: ``"copying"`` before its copies, ``"copied"`` after
    they landed and before the check (tests change a tensor there, to change it while staging
    is under way without racing it)."""
    return None
