"""The copies of one ``stage()``: a state's tensors into an arena, as fast as the host allows.

Owns the copy machinery: the order of one stage's copies (:class:`Copies`), the copy threads
that ``memmove`` contiguous host tensors (GIL released), and per CUDA device a side stream for
the non_blocking device-to-host copies and the events that mark their end.

Must not decide who holds the arena, for how long, or when it goes back: that is the lease's
business (:mod:`s3dcp.saving.staging`), which is handed the events and the ``pending`` flag.
Everything here has ended when :meth:`Copies.finish` returns, except the device copies, whose
events say when they land.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import os
from typing import Any, Callable

import torch

from ..format.tensors import has_lazy_bits
from ..memory.pool import Arena


class Copies:
    """One stage's copies, in the order that hides the training thread's per-tensor Python
    behind the bulk copy:

    1. ``Copies(arena, sources)`` reserves each source's place in the arena (integers only)
       and starts copying the contiguous host sources on the copy threads (``memmove``, GIL
       released);
    2. meanwhile :meth:`destinations` makes the staged tensors (views of those places) that the
       staged state dict is built from — a few microseconds of Python per tensor, hundreds of
       tensors in an optimizer state;
    3. :meth:`finish` copies the rest (CUDA sources: ``non_blocking`` on a side stream into the
       pinned arena, an event in :attr:`events` marking their end; strided ones and lazy conjugate or
       negative views: ``copy_``, which gives their values) and waits for the bulk copy.

    A source that does not fit the budget is staged as itself and sets :attr:`pending`
    (write_data copies it in rounds); for such sources on a GPU, :attr:`training_done` gets an
    event per device after the work queued before the stage, where the rounds' copies start."""

    def __init__(self, arena: Arena, sources: list[torch.Tensor]) -> None:
        self.arena = arena
        self.sources = sources
        self.pending = False  # some source is beyond the budget
        self.events: list[tuple[int, Any]] = []  # (CUDA device, event after its copies into the arena)
        self.training_done: dict[int, Any] = {}  # CUDA device -> event after the work queued before the stage
        base = arena.address
        self.starts: list[int | None] = []
        self.moved: list[bool] = []  # copied by the copy threads
        moves: list[tuple[int, int, int]] = []  # (dst address, src address, bytes)
        self._deferred_devices: set[int] = set()  # of CUDA sources beyond the budget (copied in rounds)
        for t in sources:
            nbytes = t.nbytes
            start = arena.reserve(nbytes) if nbytes else None
            self.starts.append(start)
            moved = start is not None and t.is_cpu and t.is_contiguous() and not has_lazy_bits(t)
            self.moved.append(moved)
            if moved:
                moves.append((base + start, t.data_ptr(), nbytes))
            elif start is None and nbytes:
                self.pending = True
                if t.is_cuda:
                    self._deferred_devices.add(t.device.index)
        self._wait = _memcpy_start(moves)
        self._device: dict[int, tuple[list, list]] = {}  # CUDA device -> (staged tensors, sources)
        self._strided: list[tuple[torch.Tensor, torch.Tensor]] = []

    def destinations(self) -> list[torch.Tensor]:
        """The staged tensor of each source, in order."""
        arena = self.arena
        out: list[torch.Tensor] = []
        for t, start, moved in zip(self.sources, self.starts, self.moved):
            if start is None:  # empty (a view of the arena like the others: pinned alike), or beyond the budget
                out.append(arena.view_like(0, t) if t.nbytes == 0 else t.detach())
                continue
            dst = arena.view_like(start, t)
            out.append(dst)
            if moved:
                continue
            if t.is_cuda:
                dsts, srcs = self._device.setdefault(t.device.index, ([], []))
                dsts.append(dst)
                srcs.append(t)
            else:
                self._strided.append((dst, t))
        return out

    def finish(self) -> None:
        """Copy what the copy threads do not, and wait for them: the arena then holds the state."""
        try:
            with torch.no_grad():  # the sources may require grad; their copies never do
                # A copy from a GPU runs on the current stream of the source's device, so each
                # device's sources get that device's side stream, ordered after the work queued
                # on its current stream (the last optimizer step), and an event of their own.
                for device, (dsts, srcs) in self._device.items():
                    stream = _side_stream(device)
                    with torch.cuda.device(device):
                        stream.wait_stream(torch.cuda.current_stream(device))
                        with torch.cuda.stream(stream):
                            torch._foreach_copy_(dsts, srcs, non_blocking=self.arena.pinned)
                        event = torch.cuda.Event()
                        event.record(stream)
                    self.events.append((device, event))
                for device in self._deferred_devices:  # where the rounds' copies must start
                    event = torch.cuda.Event()
                    event.record(torch.cuda.current_stream(device))
                    self.training_done[device] = event
                for dst, src in self._strided:
                    dst.copy_(src)
        finally:
            self._wait()


_THREADED_MIN_BYTES = 4 * 1024 * 1024  # below this, handing work to threads costs more than it saves
_COPY_THREADS = max(1, min(4, os.cpu_count() or 1))
_copier: concurrent.futures.ThreadPoolExecutor | None = None
_copier_pid = 0


def _memcpy_start(moves: list[tuple[int, int, int]]) -> Callable[[], None]:
    """Start copying every ``(dst, src, nbytes)`` on ``_COPY_THREADS`` threads, each given an
    equal share of the bytes (a move that straddles two shares is split there); returns the
    function that waits for the end. ``ctypes.memmove`` releases the GIL, so the caller runs
    Python meanwhile. Against ``copy_`` per tensor this saves torch's per-call overhead and its
    intra-op thread wake-ups (hundreds of microseconds per tensor on a busy machine) — what an
    optimizer-style state of many small tensors pays for. Moves are not cut any finer: glibc
    copies large blocks with non-temporal stores, and 4 MiB pieces made a 512 MiB copy 10-15%
    slower than one flat memcpy (measured). A small total is copied by the caller, when it
    waits."""
    total = sum(n for _, _, n in moves)
    if total <= _THREADED_MIN_BYTES:
        return lambda: _run_moves(moves)
    share = -(-total // _COPY_THREADS)
    lanes: list[list[tuple[int, int, int]]] = [[] for _ in range(_COPY_THREADS)]
    lane, filled = 0, 0
    for move in moves:
        dst, src, n = move
        if filled + n <= share:  # the common case: the move as it is
            lanes[lane].append(move)
            filled += n
            continue
        done = 0
        while done < n:
            if filled >= share and lane + 1 < _COPY_THREADS:
                lane, filled = lane + 1, 0
            step = n - done if lane + 1 == _COPY_THREADS else min(n - done, share - filled)
            lanes[lane].append((dst + done, src + done, step))
            done += step
            filled += step
    global _copier, _copier_pid
    if _copier is None or _copier_pid != os.getpid():  # none yet, or a forked child: the
        # parent's executor has no threads here, and it would queue the work forever
        _copier = concurrent.futures.ThreadPoolExecutor(_COPY_THREADS, thread_name_prefix="s3dcp-stage")
        _copier_pid = os.getpid()
    running = [_copier.submit(_run_moves, work) for work in lanes if work]

    def wait() -> None:
        for f in running:
            f.result()

    return wait


def _run_moves(work: list[tuple[int, int, int]], memmove=ctypes.memmove) -> None:
    for dst, src, n in work:
        memmove(dst, src, n)


def _side_stream(device: int):
    """The dedicated CUDA stream of ``device`` for staging's device-to-host copies."""
    stream = _STREAMS.get(device)
    if stream is None:
        stream = _STREAMS[device] = torch.cuda.Stream(device=device)
    return stream


_STREAMS: dict[int, Any] = {}
