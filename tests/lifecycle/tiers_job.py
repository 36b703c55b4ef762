"""A rank of tests/lifecycle/test_tiers.py's jobs: two nodes × 2 ranks (torchrun ``--nnodes 2``,
tests/multinode.py), or the same layout forked by tests/test_multiprocess.py with ``GROUP_RANK``
set per rank. One job runs a list of phases, each with a manager of its own (a restart of every
process, as far as the tiers can tell: nothing is shared between managers but the nodes'
local_dirs and the bucket); the test checks every phase's result.

    tiers_job.py URI ROOT PHASE[,PHASE...]

Each node's local_dir is ROOT/node<GROUP_RANK>. A rank's state at a step is a pure function of
(saving rank, step, variant), so a load is checked bitwise against it, and the variant found says
which save of a step was read. Between phases one rank of the job changes the nodes' files
(removes a node's copies, corrupts a byte, puts stale copies back) with every rank waiting.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from s3dcp import CheckpointManager
from s3dcp.errors import unwrap_error
from s3dcp.lifecycle.deletion import delete_checkpoint

VARIANTS = ("x", "y", "y2", "y3", "z", "w")
STEP20 = "step-00000020"


def state(rank: int, step: int, variant: str = "x") -> dict:
    g = torch.Generator().manual_seed(1000 * step + rank + 100_000 * VARIANTS.index(variant))
    return {f"r{rank}.w": torch.randn(768 * 1024, generator=g),  # 3 MiB
            f"r{rank}.b": torch.randn(333, generator=g).to(torch.bfloat16), "step": step}


def blank(ranks) -> dict:
    out = {"step": -1}
    for r in ranks:
        out[f"r{r}.w"] = torch.zeros(768 * 1024)
        out[f"r{r}.b"] = torch.zeros(333, dtype=torch.bfloat16)
    return out


class Records(logging.Handler):
    """The s3dcp log lines of this rank, WARNING and up."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record) -> None:
        self.lines.append(record.getMessage())


class Ctx:
    def __init__(self, uri: str, root: str, rank: int, world: int, node: int, local_rank: int, config=None) -> None:
        self.uri, self.root, self.config = uri, Path(root), config
        self.rank, self.world, self.node, self.local_rank = rank, world, node, local_rank
        self.records = Records()
        logging.getLogger("s3dcp").addHandler(self.records)

    def dir(self, node: int | None = None) -> Path:
        return self.root / f"node{self.node if node is None else node}"

    def manager(self, replicas: int = 1, local_dir: Path | None = None, **kw) -> CheckpointManager:
        kw.setdefault("config", self.config)
        return CheckpointManager(self.uri, local_dir=local_dir or self.dir(), s3_every=2, local_keep_last=3,
                                 local_replicas=replicas, **kw)

    def load(self, manager: CheckpointManager, step: int | None = None, ranks=None) -> dict:
        """Load (the newest, or ``step``); which save was read (its variant), bitwise."""
        ranks = [self.rank] if ranks is None else ranks
        out = blank(ranks)
        began = time.monotonic()
        try:
            got = manager.load(out, step=step)
        except Exception as e:  # noqa: BLE001 - the outcome is what the test checks
            e = unwrap_error(e)
            return {"error": type(e).__name__, "message": str(e), "s": time.monotonic() - began}
        variant = next((v for v in VARIANTS if all(
            torch.equal(out[k], t) for r in ranks for k, t in state(r, got, v).items() if isinstance(t, torch.Tensor))),
            None)
        return {"step": got, "variant": variant, "equal": variant is not None and out["step"] == got,
                "stats": manager.last_load_stats, "s": time.monotonic() - began}

    def save(self, manager: CheckpointManager, steps, variant: str) -> list:
        """Save ``steps`` (``variant``'s state); what each became (or its error), after wait()."""
        out = []
        for step in steps:
            try:
                manager.save(step, state(self.rank, step, variant))
                manager.wait()
                stats = manager.last_save_stats
                out.append({"step": step, "stored_in": list(stats.stored_in), "local_error": stats.local_error,
                            "s3_error": stats.s3_error})
            except Exception as e:  # noqa: BLE001
                e = unwrap_error(e)
                out.append({"step": step, "error": type(e).__name__, "message": str(e)})
        return out

    def by_one(self, change) -> None:
        """``change()`` on rank 0, every rank waiting before and after."""
        dist.barrier()
        if self.rank == 0:
            change()
        dist.barrier()


def _modes(root: Path) -> list:
    """(path, mode) of everything under ``root`` whose mode is not private (dirs 0700, files 0600)."""
    loose = []
    for path in [root, *root.rglob("*")]:
        mode = stat.S_IMODE(path.lstat().st_mode)
        if mode & 0o077 or path.is_symlink():
            loose.append([str(path.relative_to(root.parent)), oct(mode)])
    return loose


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))


def _stash(c: Ctx) -> None:
    """Keep a copy of every node's step-20 directories (the save of that moment) aside."""
    shutil.rmtree(c.root / "stash", ignore_errors=True)
    for node in (0, 1):
        shutil.copytree(c.dir(node) / STEP20, c.root / "stash" / f"node{node}")


def _unstash_others(c: Ctx) -> None:
    """Put the stashed step-20 copies back where a node holds no copy of that rank now: stale
    copies of another save of the step, as a node that missed the later save keeps them."""
    for node in (0, 1):
        for d in (c.root / "stash" / f"node{node}").iterdir():
            target = c.dir(node) / STEP20 / d.name
            if not target.exists():
                shutil.copytree(d, target)


def phase_save(c: Ctx) -> dict:
    m = c.manager(replicas=1)
    out = {"saves": c.save(m, (10, 20), "x")}
    m.close()
    dist.barrier()
    out["held"] = sorted(p.name for p in (c.dir() / STEP20).iterdir())
    out["loose"] = _modes(c.dir())  # every directory 0700, every file 0600: replicas and markers too
    return out


def phase_restart(c: Ctx) -> dict:
    return c.load(c.manager())


def phase_lost(c: Ctx) -> dict:
    c.by_one(lambda: shutil.rmtree(c.dir(1)))
    return c.load(c.manager())


def phase_corrupt(c: Ctx) -> dict:
    victim = c.dir(0) / STEP20 / "rank-0"
    c.by_one(lambda: (shutil.copytree(c.dir(0), c.dir(1), dirs_exist_ok=True),
                      _flip(next(victim.glob("__0_*.distcp")))))
    out = c.load(c.manager())
    c.by_one(lambda: _flip(next(victim.glob("__0_*.distcp"))))
    return out


def phase_garbled(c: Ctx) -> dict:
    def garble():
        for rank_dir in (c.dir(1) / STEP20).iterdir():
            (rank_dir / ".metadata").write_bytes(b"\x80\x04 not a metadata")

    c.by_one(garble)
    out = c.load(c.manager())
    c.by_one(lambda: [shutil.copy(c.dir(0) / STEP20 / d.name / ".metadata", d / ".metadata")
                      for d in (c.dir(1) / STEP20).iterdir()])
    return out


def phase_rollback_s3(c: Ctx) -> dict:
    """Issue 38, row 2: back to 10, then 15 (to S3) and 20 "y2" (on the nodes only), without
    replicas; the nodes keep the other node's replicas of "x" (put back: a run killed before its
    replication leaves the same): 20 "y2" is resumed (before: 15), no rank waits (row 1)."""
    c.by_one(lambda: _stash(c))
    m = c.manager(replicas=0)
    out = {"back": c.load(m, step=10), "saves": c.save(m, (15, 20), "y2")}
    m.close()
    c.by_one(lambda: _unstash_others(c))
    out["held"] = sorted(p.name for p in (c.dir() / STEP20).iterdir())
    out["load"] = c.load(c.manager())
    return out


def phase_rollback(c: Ctx) -> dict:
    """Issue 38, row 1: back to 10 again, step 20 saved again ("y", to S3), replicated this time:
    the save's copies and replicas replace "y2"'s on both nodes; S3's save is the step's truth."""
    c.by_one(lambda: _stash(c))
    m = c.manager(replicas=1)
    out = {"back": c.load(m, step=10), "saves": c.save(m, (20,), "y")}
    m.close()
    c.by_one(lambda: _unstash_others(c))
    out["load"] = c.load(c.manager())
    return out


def phase_rm(c: Ctx) -> dict:
    """Step 20 deleted from S3 (s3dcp rm): the nodes' copies of it are not loaded (those of "y"
    went to S3, those of "y2" are of an earlier save); 15 is the newest; saved again, 20 is read."""
    m = c.manager(replicas=0)
    c.by_one(lambda: delete_checkpoint(m.client, m.base.child(m.name(20))))  # s3dcp rm
    out = {"gone": c.load(m, step=20), "load": c.load(m)}
    out["saves"] = c.save(m, (20,), "y3")
    out["after"] = c.load(m)
    m.close()
    return out


def phase_swap(c: Ctx) -> dict:
    """The node order changes between runs: each node finds the other's local_dir."""
    other = c.dir(1 - c.node)
    m = c.manager(replicas=1, local_dir=other)
    out = {"load": c.load(m), "saves": c.save(m, (30,), "z")}
    out["after"] = c.load(c.manager(replicas=1, local_dir=other))
    m.close()
    return out


def phase_outage(c: Ctx) -> dict:
    """S3 unreachable (nothing listens at its endpoint): the restore comes from the nodes, with a
    warning; the steps meant for S3 are kept on the nodes, saying why they are not in S3."""
    from s3dcp import S3Config

    dead = S3Config(endpoint_url="http://127.0.0.1:9", max_retries=1, connect_timeout_s=1, request_timeout_s=5)
    m = c.manager(replicas=0, config=dead)
    out = {"load": c.load(m), "saves": c.save(m, (40, 50), "w")}
    out["after"] = c.load(m)
    m.close()
    out["warnings"] = [line for line in c.records.lines if "could not" in line]
    return out


PHASES = {name[6:]: fn for name, fn in list(globals().items()) if name.startswith("phase_")}


def run(ctx: Ctx, phases: list[str]) -> dict:
    results = {}
    for name in phases:
        began = len(ctx.records.lines)
        results[name] = PHASES[name](ctx)
        results[name + ".log"] = ctx.records.lines[began:]
        dist.barrier()
    return results


def main() -> None:
    from multinode import job_env, write_result

    uri, root, phases = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
    env = job_env()
    dist.init_process_group("gloo")
    result: dict = {"env": env}
    try:
        result.update(run(Ctx(uri, root, env["rank"], env["world"], env["node"], env["local_rank"]), phases))
    finally:
        write_result(result)
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
