"""The copies of one ``stage()``: a state's tensors into an arena, as fast as the host allows.

Owns the copy machinery: the order of one stage's copies (:class:`Copies`), which of them are
made before stage() returns and which on a staging thread (background staging), the host copy
(one ``torch._foreach_copy_``) and, per CUDA device, a side stream for the non_blocking
device-to-host copies and the events that mark their end.

Must not decide who holds the arena, for how long, or when it goes back: that is the lease's
business (:mod:`s3dcp.saving.staging`), which is handed the events and the ``pending`` flag.
Everything here has ended when :meth:`Copies.run_now` (and, on the staging thread,
:meth:`Copies.run_later`) returns, except the device copies, whose events say when they land.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..memory.pool import Arena


class Copies:
    """One stage's copies:

    1. ``Copies(arena, sources)`` reserves each source's place in the arena (a slab and an
       offset: integers only);
    2. :meth:`destinations` makes the staged tensors (views of those places) that the staged
       state dict is built from, and sorts the copies into those made now and those left for
       later (``later_from_bytes``: sources of at least that many bytes; none by default);
    3. :meth:`run_now` copies on the calling (training) thread: CUDA sources ``non_blocking`` on a
       side stream into the pinned arena (an event in :attr:`events` marking their end), then
       every host source in one ``torch._foreach_copy_``, with the GIL released;
    4. :meth:`run_later`, on a staging thread (background staging), copies the rest the same
       way, one arena slab after the other, saying when each is in (its object can be sent).

    The host copy is torch's own ``copy_``, so it runs on torch's intra-op (OpenMP) threads —
    the threads the training step just used. Copy threads of our own lost to them twice on two
    cores, measured in one process: libgomp's threads spin for a while after every parallel
    region, so a ``memmove`` on other threads right after an optimizer step (or any torch op)
    shared the cores with spinning threads (async_save stalls 1.16x a memcpy against 1.02x for
    few large tensors); and a copy thread needs the GIL back between two tensors, which it
    does not get while the training thread runs Python (up to a 5 ms switch interval), so
    building the staged dict meanwhile did not overlap the copy for hundreds of tensors.

    Copies left for later start after the work the caller had queued when it staged (on a GPU:
    after an event recorded then on each device's current stream, :attr:`training_done`), and
    the copies made now come before the caller's next kernels (its current stream waits for
    them): what a forward pass writes without a version bump, such as BatchNorm's running
    statistics, is small and copied now (see :mod:`s3dcp.saving.guard`). A source that cannot
    say whether it changed (an inference tensor: no version counter) is copied now too.

    A source that does not fit the budget is staged as itself and sets :attr:`pending`
    (write_data copies it in rounds); for such sources on a GPU, :attr:`training_done` gets an
    event per device after the work queued before the stage, where the rounds' copies start."""

    def __init__(self, arena: Arena, sources: list[torch.Tensor]) -> None:
        self.arena = arena
        self.sources = sources
        self.pending = False  # some source is beyond the budget
        self.events: list[tuple[int, Any]] = []  # (CUDA device, event after its copies into the arena)
        self.training_done: dict[int, Any] = {}  # CUDA device -> event after the work queued before the stage
        self.later: list[int] = []  # indices of the sources run_later copies
        self.background = False  # a background stage: the caller does not wait for its copies
        self._deferred_devices: set[int] = set()  # of CUDA sources beyond the budget (copied in rounds)
        self.starts = arena.reserve_all([t.nbytes for t in sources])
        for t, start in zip(sources, self.starts):
            if start is None and t.nbytes:
                self.pending = True
                if t.is_cuda:
                    self._deferred_devices.add(t.device.index)
        # (staged tensors, sources) per CUDA device, and of every other device: the copies made
        # now; and those left for later, by the arena slab they fill (in the order slabs first
        # appear among the sources), so that each slab lands, and can be sent, on its own
        self._now: tuple[dict[int, tuple[list, list]], tuple[list, list]] = ({}, ([], []))
        self._later: dict[int, tuple[dict[int, tuple[list, list]], tuple[list, list]]] = {}

    def destinations(self, later_from_bytes: int | None = None) -> list[torch.Tensor]:
        """The staged tensor of each source, in order. Sources of ``later_from_bytes`` or more
        (None: none) are left to :meth:`run_later`."""
        arena = self.arena
        self.background = later_from_bytes is not None
        out: list[torch.Tensor] = []
        for i, (t, start) in enumerate(zip(self.sources, self.starts)):
            if start is None:  # empty (a view of the arena like the others: pinned alike), or beyond the budget
                out.append(arena.view_like((0, 0), t) if t.nbytes == 0 else t.detach())
                continue
            dst = arena.view_like(start, t)
            out.append(dst)
            later = later_from_bytes is not None and t.nbytes >= later_from_bytes and not t.is_inference()
            if later:
                self.later.append(i)
            by_device, host = self._later.setdefault(start[0], ({}, ([], []))) if later else self._now
            if t.is_cuda:
                dsts, srcs = by_device.setdefault(t.device.index, ([], []))
            else:  # strided sources and lazy conjugate or negative views too: copy_ gives their values
                dsts, srcs = host
            dsts.append(dst)
            srcs.append(t)
        return out

    def run_now(self) -> None:
        """Copy the sources not left for later into their places (all of them, by default):
        the arena then holds them, except the device copies, which land when their
        :attr:`events` say so."""
        with torch.no_grad():  # the sources may require grad; their copies never do
            # A copy from a GPU runs on the current stream of the source's device, so each
            # device's sources get that device's side stream, ordered after the work queued
            # on its current stream (the last optimizer step), and an event of their own.
            later_devices = {d for by_device, _ in self._later.values() for d in by_device} | self._deferred_devices
            copied = self._side_copies(self._now[0],
                                       lambda stream, device: stream.wait_stream(torch.cuda.current_stream(device)))
            if self.background:  # the training loop goes on: its next kernels after these copies
                for device, event in copied:
                    torch.cuda.current_stream(device).wait_event(event)
            for device in later_devices:  # where the later copies (or the rounds) must start
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(device))
                self.training_done[device] = event
            if self._now[1][0]:
                torch._foreach_copy_(*self._now[1])

    @property
    def later_slabs(self) -> list[int]:
        """The arena slabs that :meth:`run_later` fills, in the order it fills them."""
        return list(self._later)

    def run_later(self, landed: Callable[[int, list[tuple[int, Any]]], None] | None = None) -> None:
        """Copy the sources left for later (on a staging thread), slab by slab: each slab's
        device copies on each device's side stream (the first after the work the training
        thread had queued when it staged), then its host copy; then ``landed(slab, events)``:
        its host bytes are in, its device bytes once ``events`` (``(device, event)``, also in
        :attr:`events`) say so."""
        with torch.no_grad():
            ordered: set[int] = set()

            def after_training(stream, device: int) -> None:
                if device not in ordered:  # a stream's later copies stay behind it
                    ordered.add(device)
                    stream.wait_event(self.training_done[device])

            for slab, (by_device, host) in self._later.items():
                made = self._side_copies(by_device, after_training)
                if host[0]:
                    torch._foreach_copy_(*host)
                if landed is not None:
                    landed(slab, made)

    def _side_copies(self, by_device: dict, after: Callable[[Any, int], None]) -> list[tuple[int, Any]]:
        """Each device's copies of ``by_device`` on its side stream, once ``after(side stream,
        device)`` has ordered that stream behind what they must follow; an event after each
        device's copies, returned and put in :attr:`events` at once (a failure on the next
        device leaves the lease what to wait for)."""
        made = []
        for device, (dsts, srcs) in by_device.items():
            stream = _side_stream(device)
            with torch.cuda.device(device):
                after(stream, device)
                with torch.cuda.stream(stream):
                    torch._foreach_copy_(dsts, srcs, non_blocking=self.arena.pinned)
                event = torch.cuda.Event()
                event.record(stream)
            self.events.append((device, event))
            made.append((device, event))
        return made

    def run(self) -> None:
        """Every copy, on the calling thread (a blocking stage)."""
        self.run_now()
        self.run_later()


def _side_stream(device: int):
    """The dedicated CUDA stream of ``device`` for staging's device-to-host copies."""
    stream = _STREAMS.get(device)
    if stream is None:
        stream = _STREAMS[device] = torch.cuda.Stream(device=device)
    return stream


_STREAMS: dict[int, Any] = {}
