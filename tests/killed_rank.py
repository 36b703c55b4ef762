"""Jobs in which one rank is SIGKILLed on purpose, and what the survivors did after it.

    ranks = KilledJob(target, world, outdir, args)      # target(rank, world, port, outdir, *args)
      a rank:  joined(rank, world, port, outdir, timeout_s)   its own log, the process group
               killed(outdir)                                  "killed" marked, then SIGKILL itself
               report(outdir, rank, outcome); stay()           (outcome, time) written, then alive
    with ranks: ranks.survivors(expected, bound_s)              {rank: (outcome, seconds after the kill)}

Survivors stay alive after reporting: a process that exits closes its connections, which would
end its peers' waits for it and hide a hang. Every rank still running is killed at the end.
"""

from __future__ import annotations

import datetime
import os
import pickle
import signal
import time
from pathlib import Path

import torch.distributed as dist

from test_multiprocess import _context, _free_port

__all__ = ["KilledJob", "joined", "killed", "report", "stay", "write_atomically"]

STAY_S = 300  # how long a survivor stays alive after reporting (the test kills it sooner)


def write_atomically(path: Path, data: bytes) -> None:
    """The test polls for these files: it must never read one half written."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def joined(rank: int, world: int, port: int, outdir: str, timeout_s: float) -> None:
    """This rank's output into its log, and the process group joined (``timeout_s``: gloo's)."""
    log = open(Path(outdir, f"rank{rank}.log"), "w")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


def killed(outdir: str) -> None:
    """Mark the time, then die at once."""
    write_atomically(Path(outdir, "killed"), str(time.time()).encode())
    os.kill(os.getpid(), signal.SIGKILL)


def report(outdir: str, rank: int, outcome) -> None:
    write_atomically(Path(outdir, f"rank{rank}.pkl"), pickle.dumps((outcome, time.time())))


def stay() -> None:
    time.sleep(STAY_S)


class KilledJob:
    """``world`` forked ranks running ``target(rank, world, port, outdir, *args)``."""

    def __init__(self, target, world: int, outdir: Path, args: tuple = ()) -> None:
        self.outdir = Path(outdir)
        self.outdir.mkdir(parents=True, exist_ok=True)
        ctx, port = _context(), _free_port()
        self.procs = [ctx.Process(target=target, args=(r, world, port, str(self.outdir), *args)) for r in range(world)]

    def __enter__(self) -> "KilledJob":
        for p in self.procs:
            p.start()
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(10)

    def survivors(self, expected: list[int], bound_s: float, start_s: float = 150) -> tuple[dict, str]:
        """{rank: (outcome, seconds after the kill)} of the ``expected`` survivors that reported
        within ``bound_s`` of the kill (waiting ``start_s`` for the kill itself), and the ranks'
        log tails for a failure's message."""
        deadline = time.monotonic() + start_s
        marker = self.outdir / "killed"
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        results: dict = {}
        if marker.exists():
            killed_at = float(marker.read_text())
            while len(results) < len(expected) and time.time() < killed_at + bound_s + 5:
                for r in expected:
                    path = self.outdir / f"rank{r}.pkl"
                    if r not in results and path.exists():
                        outcome, at = pickle.loads(path.read_bytes())
                        results[r] = (outcome, at - killed_at)
                time.sleep(0.1)
        logs = "\n".join(f"---- rank {r}\n" + (self.outdir / f"rank{r}.log").read_text(errors="replace")[-1500:]
                         for r in range(len(self.procs)) if (self.outdir / f"rank{r}.log").exists())
        assert marker.exists(), f"the rank to kill never got there\n{logs}"
        return results, logs
