"""A rank of tests/lifecycle/test_tiers.py's two-node job (tests/multinode.py runs it).

    tiers_job.py save   URI ROOT REPLICAS          steps 10 (local + S3) and 20 (local only)
    tiers_job.py crash  URI ROOT REPLICAS          step 30, rank 3 killed while writing its copy
    tiers_job.py load   URI ROOT REPLICAS [all]    manager.load; "all": every rank loads every
                                                   saving rank's tensors (a resharded load)

Each node's local_dir is ROOT/node<GROUP_RANK>. A rank's state at a step is a pure function of
(saving rank, step), so a load is checked bitwise against it without sharing anything.
"""

from __future__ import annotations

import os
import signal
import sys

import torch
import torch.distributed as dist

from multinode import job_env, write_result
from s3dcp import CheckpointManager

MiB = 1 << 20


def state(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {f"r{rank}.w": torch.randn(768 * 1024, generator=g),  # 3 MiB
            f"r{rank}.b": torch.randn(333, generator=g).to(torch.bfloat16), "step": step}


def blank(ranks) -> dict:
    out = {"step": -1}
    for r in ranks:
        out[f"r{r}.w"] = torch.zeros(768 * 1024)
        out[f"r{r}.b"] = torch.zeros(333, dtype=torch.bfloat16)
    return out


def main() -> None:
    phase, uri, root, replicas = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    env = job_env()
    dist.init_process_group("gloo")
    local_dir = os.path.join(root, f"node{env['node']}")
    manager = CheckpointManager(uri, local_dir=local_dir, s3_every=2, local_keep_last=3, local_replicas=replicas)
    result: dict = {"env": env}
    try:
        if phase == "save":
            for step in (10, 20):
                manager.save(step, state(env["rank"], step))
            manager.wait()
        elif phase == "crash":
            if env["rank"] == 3:  # dies after the first object of its copy is written
                from s3dcp.saving import local_copy

                real = local_copy.LocalCopy.write

                def write_then_die(self, name, buffers):
                    real(self, name, buffers)
                    os.kill(os.getpid(), signal.SIGKILL)

                local_copy.LocalCopy.write = write_then_die
            manager.save(30, state(env["rank"], 30))
            manager.wait()
        else:
            ranks = range(4) if "all" in sys.argv[5:] else [env["rank"]]
            out = blank(ranks)
            step = manager.load(out)
            expected = {k: v for r in ranks for k, v in state(r, step).items()}
            result.update(step=step, stats=manager.last_load_stats,
                          equal=all(torch.equal(out[k], v) for k, v in expected.items() if isinstance(v, torch.Tensor))
                          and out["step"] == step)
        manager.close()
    finally:
        write_result(result)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
