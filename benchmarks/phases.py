"""Client CPU of a DCP save or load, split by phase of DCP's call order.

    save: plan    reset, storage_meta, set_up_storage_writer, prepare_local/global_plan
          write   write_data, until its future is done (resolve, checksums, uploads)
          commit  finish (the metadata object)
          dcp     everything else between the start and the end: DCP's own planner, its
                  collectives and its bookkeeping
    load: meta    read_metadata (the metadata GET and its decoding)
          plan    set_up_storage_reader, prepare_local/global_plan
          read    read_data, until its future is done (GETs, copies, checksums)
          dcp     everything else (DCP's load planner, its collectives)

:func:`clocked` wraps the methods of one storage writer or reader instance (any plugin:
s3dcp's, s3torchconnector's, DCP's own), so each plugin is measured the same way. CPU is the
process's (every thread: the CRT's event loops count with the caller), so a phase's figure is
what the process spent while that phase ran; with one rank the phases do not overlap.
"""

from __future__ import annotations

import time
from typing import Any

SAVE_PHASES = {"reset": "plan", "storage_meta": "plan", "set_up_storage_writer": "plan",
               "prepare_local_plan": "plan", "prepare_global_plan": "plan", "write_data": "write",
               "finish": "commit"}
LOAD_PHASES = {"reset": "plan", "read_metadata": "meta", "set_up_storage_reader": "plan",
               "prepare_local_plan": "plan", "prepare_global_plan": "plan", "read_data": "read"}
SAVE_ORDER = ("plan", "write", "commit", "dcp")
LOAD_ORDER = ("meta", "plan", "read", "dcp")


class PhaseCpu:
    """CPU seconds (and wall seconds) per phase; :meth:`start` and :meth:`stop` bracket the
    whole operation."""

    def __init__(self, phases: dict[str, str]) -> None:
        self.phases = phases
        self.seconds: dict[str, float] = {p: 0.0 for p in set(phases.values())}
        self.wall: dict[str, float] = {p: 0.0 for p in set(phases.values())}
        self._start: float | None = None
        self._start_wall: float | None = None
        self.total_s = 0.0
        self.total_wall_s = 0.0

    def start(self) -> None:
        self._start = time.process_time()
        self._start_wall = time.perf_counter()

    def stop(self) -> dict[str, float]:
        """Per phase CPU seconds, with ``dcp``: the rest of the operation's CPU."""
        self.total_s = time.process_time() - (self._start or 0.0)
        self.total_wall_s = time.perf_counter() - (self._start_wall or 0.0)
        out = dict(self.seconds)
        out["dcp"] = max(0.0, self.total_s - sum(self.seconds.values()))
        return out

    def walls(self) -> dict[str, float]:
        """Per phase wall seconds (after :meth:`stop`), with ``dcp``: the rest of the call."""
        out = dict(self.wall)
        out["dcp"] = max(0.0, self.total_wall_s - sum(self.wall.values()))
        return out


def clocked(plugin: Any, phases: dict[str, str]) -> tuple[Any, PhaseCpu]:
    """``plugin`` with each method named in ``phases`` wrapped to add its CPU to its phase
    (``write_data`` / ``read_data`` until their future is done, as DCP waits for it at once)."""
    clock = PhaseCpu(phases)
    for name, phase in phases.items():
        method = getattr(plugin, name, None)
        if method is None:
            continue

        def wrapped(*args, __method=method, __phase=phase, **kwargs):
            c0, w0 = time.process_time(), time.perf_counter()
            try:
                result = __method(*args, **kwargs)
                if hasattr(result, "wait"):
                    result.wait()
                return result
            finally:
                clock.seconds[__phase] += time.process_time() - c0
                clock.wall[__phase] += time.perf_counter() - w0

        setattr(plugin, name, wrapped)
    return plugin, clock


def floor_cpu_s_per_gib(nbytes: int = 256 * 1024 * 1024) -> dict[str, float]:
    """CPU seconds per GiB of what a save cannot avoid, measured here on ``nbytes``: the wire
    checksum of every part (``crc32c``), the item checksum (``crc64nvme``), and the socket
    copies of sending the bytes over loopback (``send``: the sending thread's CPU; the receiver
    stands for the server). ``save_floor`` is their sum: parts go to the socket from the
    tensors' memory (s3dcp.s3.sockets), so no copy is part of it. ``memcpy`` (one copy into
    warm buffers) is what a path that stages the bytes, as the CRT's PUT does, pays on top; a
    load pays the socket receive, that copy into the tensors and the checksums."""
    import socket
    import threading

    import torch
    from awscrt import checksums

    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm: the pages are there, as in the CRT's reused buffers
    view = memoryview(src.numpy()).cast("B")
    out: dict[str, float] = {}

    def cpu_of(fn) -> float:
        c0 = time.thread_time()
        fn()
        return (time.thread_time() - c0) / (nbytes / 2**30)

    out["memcpy"] = cpu_of(lambda: dst.copy_(src))
    out["crc32c"] = cpu_of(lambda: checksums.crc32c(view))
    out["crc64nvme"] = cpu_of(lambda: checksums.crc64nvme(view))
    a, b = socket.socketpair()
    drained = threading.Thread(target=lambda: _drain(b, nbytes), daemon=True)
    drained.start()
    step = 1 << 20
    out["send"] = cpu_of(lambda: [a.sendall(view[i:i + step]) for i in range(0, nbytes, step)])
    drained.join()
    a.close()
    b.close()
    out["save_floor"] = out["crc32c"] + out["crc64nvme"] + out["send"]
    return out


def _drain(sock, nbytes: int) -> None:
    sink = bytearray(1 << 20)
    got = 0
    while got < nbytes:
        n = sock.recv_into(sink)
        if n == 0:
            return
        got += n
