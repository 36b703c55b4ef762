"""Staging for ``dcp.async_save``: the only part of a checkpoint the training loop waits for.

Two modes (``S3Config.staging``)::

    "blocking" (default): async_save ─► stage(): lease an arena of the pool, copy every tensor
        into it (CUDA: pinned arena, non_blocking copies on a side stream, an event)
        ─► synchronize_staging() ─► async_save returns a Future ─► training resumes
    "background": async_save ─► stage(): lease an arena, build the staged dict, copy the small
        tensors, note what the large ones are ─► returns a Future at once; async_save returns
        AsyncSaveResponse(staging_completion, upload_completion) ─► training resumes, and must
        wait for staging_completion before it changes a tensor (the optimizer step)
        meanwhile, on a staging thread (saving/background.py): the large copies ─► the check
        that none changed (saving/guard.py) ─► staging_completion
    then, in DCP's save thread: dcp.save(staged) ─► write_data uploads straight from the arena
        (or raises: torn) ─► commit ─► the save call returns ─► the lease is over: the arena goes back

Background staging needs the whole state within ``staging_budget_bytes`` (budget rounds need
the loop to wait until write_data has copied the last one, which DCP's staging Future cannot
express): a larger state stages as "blocking".

One save's hold on an arena is a :class:`~s3dcp.saving.lease.Lease`, whose whole life, every
path included, is :mod:`s3dcp.saving.lease`'s docstring.

This module owns the stager (:class:`StagingMixin`: the AsyncStager protocol of the writer, the
choice of mode, the rounds). It must not decide when a lease is over (:mod:`s3dcp.saving.lease`),
nor do ``stage()``'s copies itself — their order, the host copy and the CUDA side streams are
:mod:`s3dcp.saving.copies`'s; the staging thread is :mod:`s3dcp.saving.background`'s — nor
upload or commit anything (the writer's).

Host memory taken by staging is ``max_inflight_checkpoints × min(state bytes,
staging_budget_bytes)``, rounded up to 8 MiB (see :mod:`s3dcp.memory.pool`).
"""

from __future__ import annotations

import logging
import time
import weakref
from concurrent.futures import Future
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from ..memory.pool import Arena, HostBufferPool, plan_slabs, release_staging_memory, shared_pool
from ..s3.streams import finalizer
from . import background, statetree
from .copies import Copies
from .guard import TornGuard
from .lease import Lease

__all__ = ["HostBufferPool", "Arena", "Lease", "StagingMixin", "shared_pool", "release_staging_memory"]

log = logging.getLogger("s3dcp")

_POLL_S = 0.05


class _StagedDict(dict):
    """A dict that can carry a weakref finalizer (plain dicts cannot).

    DCP's process executor pickles it for the child process, on a thread of its own, and
    pickling moves the tensors' storage — the whole arena — into shared memory. So it is
    pickled only once the device copies into the arena have landed, and a pinned arena is
    unregistered first (CUDA must not be left holding memory that is freed); it goes on as
    ordinary memory."""

    lease: "weakref.ref[Lease] | None" = None

    def __reduce__(self):
        lease = self.lease() if self.lease is not None else None
        arena = lease.arena if lease is not None else None
        if arena is not None:
            lease.landed.wait()  # a background stage's copies, on its staging thread
            lease.wait_device_copies()
            if arena.pinned:
                arena.unpin()
        return dict, (), None, None, iter(self.items())


class StagingMixin:
    """DCP's ``AsyncStager`` protocol for :class:`s3dcp.S3StorageWriter`.

    ``stage()`` and ``synchronize_staging()`` run on the training thread; the writer's other
    methods run where DCP runs the save and call :meth:`_attach` first.
    """

    _synchronize_after_execute: bool = True

    def _init_staging(self, pool: HostBufferPool | None, staging: str) -> None:
        self.staging = staging  # S3Config.staging
        self._pool = pool
        self._lease: Lease | None = None
        self._stage_started = 0.0
        self._stage_s = 0.0  # the last stall: stage() plus synchronize_staging()

    def _staging_getstate(self) -> dict[str, Any]:
        # DCP's process executor pickles the writer on the parent's side of the save: the child
        # gets the staged tensors (shared memory) and a writer without pool or lease. Rounds need
        # the parent's arena, so the child is told to refuse them.
        self._attach()
        lease = self._lease
        if lease is not None:
            lease.landed.wait()
        return {"_pool": None, "_lease": None, "_needs_rounds": lease is not None and lease.pending,
                "_staging_error": lease.error if lease is not None else None}

    @property
    def should_synchronize_after_execute(self) -> bool:
        return self._synchronize_after_execute

    def warm_up(self, state_dict: dict[str, Any]) -> None:
        """Allocate (and page-fault) the staging arena for ``state_dict`` before training."""
        pool = self._staging_pool()
        arena = pool.acquire(self._arena_slabs(state_dict), target_bytes=self.config.object_size_target_bytes,
                             max_in_use=self._max_in_flight())
        pool.release(arena)

    # ------------------------------------------------------------ training thread
    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any] | Future:
        """Copy ``state_dict``'s tensors into the pool and return the staged copy (blocking
        staging), or the Future of it (background staging; module docstring).

        Same structure; tensors (DTensor and ShardedTensor local shards too) become contiguous
        host tensors in the arena; other values are deep-copied so that the training loop may
        change anything once staging is complete.
        """
        self._stage_started = time.perf_counter()
        pool = self._staging_pool()
        owners: list | None = [] if self.staging == "background" else None  # what the state holds per tensor
        found = statetree.tensors(state_dict, owners)  # one walk: sizes the arena, then the copies
        arena = pool.acquire(self._arena_slabs(found), target_bytes=self.config.object_size_target_bytes,
                             max_in_use=self._max_in_flight(), prefault=False)
        lease = Lease(pool, arena)
        pool.hold(lease)
        try:
            previous = self._lease
            if previous is not None and not previous.over():
                from ..errors import ConfigError

                raise ConfigError("this S3StorageWriter is still saving an earlier checkpoint: use one "
                                  "writer per async_save in flight")
            copies = Copies(arena, found)
            # the lease takes the copies' lists themselves: what run() records, also before a
            # failure, is what release() waits for
            lease.pending, lease.events, lease.training_done = copies.pending, copies.events, copies.training_done
            in_background = owners is not None and not copies.pending
            destinations = iter(copies.destinations(_LATER_FROM_BYTES if in_background else None))
            staged = statetree.copy_tree(state_dict, lambda _t: next(destinations))
            guard = TornGuard(found, owners, copies.later) if in_background else None  # before any copy
            copies.run_now()  # the bytes: the rest of the stage is the copy itself
        except BaseException as e:
            lease.land(e)
            lease.release()
            raise
        result = _StagedDict(staged)
        result.lease = weakref.ref(lease)
        weakref.finalize(result, finalizer(lease.release))  # a save that died before it called the writer
        self._lease = lease
        if guard is None:
            if owners is not None:
                _say_blocking_once(self.config.staging_budget_bytes)
            lease.land()
            self._stage_s = time.perf_counter() - self._stage_started
            return result
        lease.stream(copies.later_slabs)  # before the staged dict goes anywhere
        future = background.start(copies, guard, lease, result, lambda: statetree.paths(result),
                                  getattr(self, "checkpoint_id", None) or "the checkpoint")
        self._stage_s = time.perf_counter() - self._stage_started
        return future

    def synchronize_staging(self) -> None:
        """Return once the staged copy is complete and the originals may change again — or
        once the save is over (it failed before its last round: the error is on its future)."""
        lease = self._lease
        if lease is None:
            return
        lease.landed.wait()
        lease.wait_device_copies()
        while not lease.copied.wait(_POLL_S):
            if lease.over():
                lease.release()
                break
        self._stage_s = time.perf_counter() - self._stage_started
        lease.returned.set()

    def close(self) -> None:
        """Nothing to free: the pool outlives writers (see :func:`release_staging_memory`)."""

    # ------------------------------------------------------------ the save's thread
    def _attach(self) -> None:
        """Every writer call of a save starts here: the lease learns which save call holds it."""
        lease = self._lease
        if lease is not None:
            lease.attach()

    def _staging_begin(self) -> Lease | None:
        """First thing in write_data: the lease of this save, its device copies landed."""
        if getattr(self, "_needs_rounds", False):
            from ..errors import ConfigError

            raise ConfigError(
                "staging_budget_bytes is smaller than the state, which needs the writer's own "
                "thread to copy the rest in rounds: use the thread executor, or raise the budget "
                "to fit the whole state for AsyncCheckpointerType.PROCESS")
        self._attach()
        lease = self._lease
        error = getattr(self, "_staging_error", None)  # DCP's process executor: the parent's lease's
        if lease is not None and not lease.slabs_in:  # a background stage lands as write_data goes
            lease.landed.wait()
            lease.wait_device_copies()
            error = lease.error
        if error is not None:  # raised on this rank; DCP's collective takes it to every rank
            self._staging_end(lease)  # write_data's finally does not run for it: nothing uploads from the arena
            raise error
        return lease

    @staticmethod
    def _streams(lease: Lease | None, planner: Any) -> bool:
        """Whether write_data may send the objects of a background stage as its slabs come in
        (:meth:`Lease.wait_in`), rather than once the whole stage has landed: only DCP's own
        planner is known to read no tensor's bytes while it resolves the items to write (another
        may transform them: a cast reads them). Either way write_data waits for the landing
        before it returns (:meth:`_staging_landed`)."""
        return lease is not None and bool(lease.slabs_in) and type(planner) is DefaultSavePlanner

    @staticmethod
    def _staging_landed(lease: Lease | None) -> None:
        """Wait until a background stage has landed; raise its error (torn, or a copy failed):
        write_data then stops and deletes what this rank sent, and the save fails on every rank."""
        if lease is None or not lease.slabs_in:
            return
        lease.landed.wait()
        lease.wait_device_copies()
        if lease.error is not None:
            raise lease.error

    def _staging_end(self, lease: Lease | None) -> None:
        """Last thing in write_data, success or failure: the originals are no longer needed. A
        lease not attached to a DCP save call (the writer driven by hand) ends here too."""
        if lease is None:
            return
        lease.copied.set()
        if not lease.attached:
            lease.release()

    def _stage_rounds(self, deferred: list, lease: Lease, put: Callable[[list], None],
                      drain: Callable[[], None]) -> None:
        """Copy the ``(item, tensor)`` pairs that did not fit the staging budget into the
        arena as it frees up, handing each batch to ``put``; ``drain()`` waits for every
        upload so far (then the whole arena is free again). The training thread is let go once
        the last original is copied."""
        arena = lease.arena
        target = self.config.object_size_target_bytes
        batch: list = []
        batch_bytes = 0
        for device, event in lease.training_done.items():
            # this thread's stream of the device, which the copies below run on, waits for the
            # work the training thread had queued when it called async_save (on any stream)
            with torch.cuda.device(device):
                torch.cuda.current_stream(device).wait_event(event)
        for item, tensor in deferred:
            nbytes = tensor.nbytes
            copied = arena.carve_like(tensor)
            if copied is None and arena.could_hold(nbytes):
                if batch:
                    put(batch)
                    batch, batch_bytes = [], 0
                drain()
                arena.reset()
                copied = arena.carve_like(tensor)
            if copied is None:  # larger than the whole budget: one temporary host copy, a real
                # one even of a contiguous CPU tensor: the caller may change the original as
                # soon as the lease says copied, while this copy is still uploading
                copied = torch.empty(tensor.shape, dtype=tensor.dtype)
            copied.copy_(tensor)
            batch.append((item, copied))
            batch_bytes += nbytes
            if batch_bytes >= target:
                put(batch)
                batch, batch_bytes = [], 0
        lease.copied.set()  # every original has been copied: training may go on
        if batch:
            put(batch)

    # ------------------------------------------------------------ sizing
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

    def _arena_slabs(self, state: dict[str, Any] | list[torch.Tensor]) -> list[int]:
        """The slab sizes of the arena for ``state`` (a state dict, or the tensors found in
        one): its tensors placed in order, each slab one object of at most
        ``object_size_target_bytes``, all of them within ``staging_budget_bytes``."""
        found = state if isinstance(state, list) else statetree.tensors(state)
        return plan_slabs([t.nbytes for t in found], self.config.object_size_target_bytes,
                          self.config.staging_budget_bytes)


_WARNED_INFLIGHT = False

# Background staging copies tensors of at least this size on its thread; smaller ones (norms'
# running statistics, step counters, biases: bytes that cost next to nothing) before stage()
# returns, which also covers what a forward pass writes without a version bump (saving/guard.py).
_LATER_FROM_BYTES = 64 * 1024


_SAID_BLOCKING = False


def _say_blocking_once(budget: int | None) -> None:
    global _SAID_BLOCKING
    if not _SAID_BLOCKING:
        _SAID_BLOCKING = True
        log.warning("staging='background' needs the whole state within staging_budget_bytes=%s: a save beyond "
                    "it stages as 'blocking' (async_save returns a Future once the state is copied; the rest "
                    "is copied in rounds while the loop waits)", budget)
