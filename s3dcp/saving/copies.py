"""The copies of one ``stage()``: a state's tensors into an arena, as fast as the host allows.

Owns the copy machinery: the order of one stage's copies (:class:`Copies`), the host copy (one
``torch._foreach_copy_``) and, per CUDA device, a side stream for the non_blocking
device-to-host copies and the events that mark their end.

Must not decide who holds the arena, for how long, or when it goes back: that is the lease's
business (:mod:`s3dcp.saving.staging`), which is handed the events and the ``pending`` flag.
Everything here has ended when :meth:`Copies.run` returns, except the device copies, whose
events say when they land.
"""

from __future__ import annotations

from typing import Any

import torch

from ..memory.pool import Arena


class Copies:
    """One stage's copies:

    1. ``Copies(arena, sources)`` reserves each source's place in the arena (a slab and an
       offset: integers only);
    2. :meth:`destinations` makes the staged tensors (views of those places) that the staged
       state dict is built from;
    3. :meth:`run` copies: CUDA sources ``non_blocking`` on a side stream into the pinned arena
       (an event in :attr:`events` marking their end), then every host source in one
       ``torch._foreach_copy_``, with the GIL released.

    The host copy is torch's own ``copy_``, so it runs on torch's intra-op (OpenMP) threads —
    the threads the training step just used. Copy threads of our own lost to them twice on two
    cores, measured in one process: libgomp's threads spin for a while after every parallel
    region, so a ``memmove`` on other threads right after an optimizer step (or any torch op)
    shared the cores with spinning threads (async_save stalls 1.16x a memcpy against 1.02x for
    few large tensors); and a copy thread needs the GIL back between two tensors, which it
    does not get while the training thread runs Python (up to a 5 ms switch interval), so
    building the staged dict meanwhile did not overlap the copy for hundreds of tensors.

    A source that does not fit the budget is staged as itself and sets :attr:`pending`
    (write_data copies it in rounds); for such sources on a GPU, :attr:`training_done` gets an
    event per device after the work queued before the stage, where the rounds' copies start."""

    def __init__(self, arena: Arena, sources: list[torch.Tensor]) -> None:
        self.arena = arena
        self.sources = sources
        self.pending = False  # some source is beyond the budget
        self.events: list[tuple[int, Any]] = []  # (CUDA device, event after its copies into the arena)
        self.training_done: dict[int, Any] = {}  # CUDA device -> event after the work queued before the stage
        self._deferred_devices: set[int] = set()  # of CUDA sources beyond the budget (copied in rounds)
        self.starts = arena.reserve_all([t.nbytes for t in sources])
        for t, start in zip(sources, self.starts):
            if start is None and t.nbytes:
                self.pending = True
                if t.is_cuda:
                    self._deferred_devices.add(t.device.index)
        self._device: dict[int, tuple[list, list]] = {}  # CUDA device -> (staged tensors, sources)
        self._host: tuple[list, list] = ([], [])  # (staged tensors, sources) of every other device

    def destinations(self) -> list[torch.Tensor]:
        """The staged tensor of each source, in order."""
        arena = self.arena
        out: list[torch.Tensor] = []
        host_dsts, host_srcs = self._host
        for t, start in zip(self.sources, self.starts):
            if start is None:  # empty (a view of the arena like the others: pinned alike), or beyond the budget
                out.append(arena.view_like((0, 0), t) if t.nbytes == 0 else t.detach())
                continue
            dst = arena.view_like(start, t)
            out.append(dst)
            if t.is_cuda:
                dsts, srcs = self._device.setdefault(t.device.index, ([], []))
                dsts.append(dst)
                srcs.append(t)
            else:  # strided sources and lazy conjugate or negative views too: copy_ gives their values
                host_dsts.append(dst)
                host_srcs.append(t)
        return out

    def run(self) -> None:
        """Copy every source into its place: the arena then holds the state, except the device
        copies, which land when their :attr:`events` say so."""
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
            if self._host[0]:
                torch._foreach_copy_(*self._host)


def _side_stream(device: int):
    """The dedicated CUDA stream of ``device`` for staging's device-to-host copies."""
    stream = _STREAMS.get(device)
    if stream is None:
        stream = _STREAMS[device] = torch.cuda.Stream(device=device)
    return stream


_STREAMS: dict[int, Any] = {}
