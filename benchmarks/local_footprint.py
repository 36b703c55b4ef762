"""What the local tier takes of a node's tmpfs: the copies in local_dir and the staging pool,
measured while a run checkpoints (docs/restart.md, "What it costs"; docs/memory.md).

    python benchmarks/local_footprint.py                      # 256 MiB state, local_keep_last=2, 6 saves
    python benchmarks/local_footprint.py --state-mib 512 --keep-last 3 --saves 8

One process (one rank: its share is the whole state) saves through a CheckpointManager with
``local_dir`` under ``/dev/shm`` and ``s3_every=2`` (async, as a training loop does), while a
thread samples, every 5 ms, the bytes of every file under local_dir and of the process's own
shared-memory files (the staging pool's slabs: unlinked files of the same tmpfs). Printed, as
multiples of the state: the peak and the final local_dir, and the peak of the two together. Expected: local_keep_last + 1 copies at the peak (the
copy being written beside the ones kept), local_keep_last after, plus about one state of staging.
With local_replicas=1 each node also holds its peer node's copies (twice the local_dir figures;
tests/lifecycle/test_tiers.py shows every rank's copy on both nodes).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

MiB = 1 << 20


def _tree_bytes(root: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:  # deleted meanwhile
                pass
    return total


def _staging_bytes() -> int:
    """Bytes of this process's shared-memory files (the staging pool's slabs: unlinked, so only
    their descriptors find them), as the tmpfs holds them (allocated blocks)."""
    total = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/dev/shm/"):
                total += os.fstat(int(fd)).st_blocks * 512
        except OSError:  # closed meanwhile
            pass
    return total


class Sampler:
    """Peaks of local_dir's bytes and of the tmpfs's used bytes, sampled on a thread."""

    def __init__(self, local_dir: Path, interval_s: float = 0.005) -> None:
        self.local_dir, self.interval_s = local_dir, interval_s
        self.peak_local = self.peak_both = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            local = _tree_bytes(self.local_dir)
            self.peak_local = max(self.peak_local, local)
            self.peak_both = max(self.peak_both, local + _staging_bytes())
            time.sleep(self.interval_s)


def main() -> None:
    from common import add_common_args, environment_info, print_table, results_path, s3_target, write_json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-mib", type=int, default=256)
    parser.add_argument("--keep-last", type=int, default=2, help="local_keep_last")
    parser.add_argument("--saves", type=int, default=6)
    args = add_common_args(parser, repeats=1).parse_args()

    import torch

    from s3dcp import CheckpointManager

    shm = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())
    local_dir = Path(tempfile.mkdtemp(prefix="s3dcp-footprint-", dir=shm))
    state_bytes = args.state_mib * MiB
    try:
        with s3_target(args) as target:
            state = {f"layer{i}": torch.randn(state_bytes // 8 // 4) for i in range(8)}
            manager = CheckpointManager(f"s3://{target.bucket}/footprint-{os.getpid()}", config=target.config,
                                        local_dir=local_dir / "run", s3_every=2, local_keep_last=args.keep_last)
            with Sampler(local_dir) as sampler:
                for step in range(1, args.saves + 1):
                    manager.save(step, state)
                    for t in state.values():  # the loop goes on changing the state
                        t.add_(1)
                manager.close()
                time.sleep(0.05)
            final_local = _tree_bytes(local_dir)
        rows = [{"what": "local_dir, peak", "bytes": sampler.peak_local, "x_state": sampler.peak_local / state_bytes,
                 "expected": args.keep_last + 1},
                {"what": "local_dir, after the run", "bytes": final_local, "x_state": final_local / state_bytes,
                 "expected": args.keep_last},
                {"what": "local_dir + staging slabs, peak", "bytes": sampler.peak_both,
                 "x_state": sampler.peak_both / state_bytes, "expected": args.keep_last + 2}]
        print_table(rows, ["what", ("bytes", "bytes", ",d"), ("x_state", "x state", ".2f"), "expected"],
                    title=f"{args.state_mib} MiB state, local_keep_last={args.keep_last}, {args.saves} saves "
                          "(x_state: multiples of the state; expected: keep_last + 1 copies, + ~1 state of staging)")
        write_json(results_path(args, "local_footprint"),
                   {"args": vars(args), "rows": rows, "environment": environment_info()})
    finally:
        shutil.rmtree(local_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
