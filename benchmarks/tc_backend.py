"""torch-checkpointing on S3 through s3dcp against s3dcp's own DCP path, same state, same server, one run.

    python benchmarks/tc_backend.py                    # 256 MiB, 3 repeats, embedded S3
    python benchmarks/tc_backend.py --state-mib 1024 --repeats 5

Per repeat, interleaved (A B A B ...): a synchronous save and a load of the same state through
torch-checkpointing's ``CheckpointManager`` with :class:`~s3dcp.interop.torch_checkpointing.
S3StorageConfig` (``tc``) and through ``s3dcp.save`` / ``s3dcp.load`` (``dcp``), and an
asynchronous save each way: the stall (how long the training thread is held: ``manager.save``
then ``manager.lock()`` until the staging copy is done, against ``s3dcp.async_save`` until it
returns) and the time until it is committed. Loads go into preallocated tensors and are checked
equal to the state; tc's load is also split: its item files filled and deserialized through this
backend alone, without torch-checkpointing's copy into the live tensors. Prints the medians and
the tc/dcp ratios; goal (issue 41): tc within 1.1x of dcp for save and load, and its stall no
higher. Exits 0 either way: a busy machine moves both.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

# This file is named like the package it measures: run as a script, its own directory comes first
# on sys.path and `import torch_checkpointing` would import this file. Import the package first,
# then put the directory back for common.py.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != _HERE]

import torch  # noqa: E402
from torch_checkpointing import CheckpointManager  # noqa: E402

sys.path.insert(0, _HERE)

import s3dcp  # noqa: E402
from common import (  # noqa: E402
    MiB, add_common_args, environment_info, measure, median, print_table, release_memory, results_path, s3_target,
    unique_prefix, write_json,
)
from s3dcp.interop.torch_checkpointing import S3StorageConfig  # noqa: E402

GOAL_X = 1.1


def make_state(total_mib: int, seed: int = 0) -> dict:
    """Weights and two AdamW moments in 16 MiB fp32 tensors (one item each for tc: a file)."""
    gen = torch.Generator().manual_seed(seed)
    n = 4 * MiB  # fp32 elements: 16 MiB
    count = max(1, total_mib // 16 // 3)
    return {"model": {f"layer{i}.weight": torch.randn(n, generator=gen) for i in range(count)},
            "optim": {f"{i}": {"exp_avg": torch.randn(n, generator=gen), "exp_avg_sq": torch.rand(n, generator=gen)}
                      for i in range(count)}}


def blank(state):
    return {k: blank(v) if isinstance(v, dict) else torch.zeros_like(v) for k, v in state.items()}


def same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return torch.equal(a, b)


def nbytes(state) -> int:
    return sum(nbytes(v) if isinstance(v, dict) else v.numel() * v.element_size() for v in state.values())


class Ways:
    """The two ways to S3, each save under a fresh name (a committed checkpoint is never written over)."""

    def __init__(self, target, state: dict) -> None:
        self.state = state
        self.root = target.uri(unique_prefix(target, "tc"))
        self.dcp_root = target.uri(unique_prefix(target, "dcp"))
        self.config = target.config
        storage_config = S3StorageConfig(root=self.root, s3=target.config)
        self.storage = storage_config.create_storage()
        self.sync = CheckpointManager(CheckpointManager.Config(
            storage_config=storage_config, save=CheckpointManager.Config.with_sync_save().save))
        self.async_ = CheckpointManager(CheckpointManager.Config(storage_config=storage_config))
        self.n = 0

    def name(self) -> str:
        self.n += 1
        return f"step_{self.n}"

    # ---------------------------------------------------------------- the cases
    def tc_save(self) -> dict:
        name = self.name()
        m = measure(lambda: self.sync.save(name, self.state))
        return {"save_s": m.wall_s, "save_cpu_s": m.cpu_s, "name": name}

    def dcp_save(self) -> dict:
        name = self.name()
        m = measure(lambda: s3dcp.save(self.state, f"{self.dcp_root}/{name}", config=self.config))
        return {"save_s": m.wall_s, "save_cpu_s": m.cpu_s, "name": name}

    def tc_load(self, name: str, into: dict) -> dict:
        m = measure(lambda: self.sync.load(name, into=into))
        return {"load_s": m.wall_s, "load_cpu_s": m.cpu_s}

    def tc_files(self, name: str) -> float:
        """The bytes of the same load through this backend alone: each item's file filled and
        deserialized (``load_torch_serialized_from_storage``, what the reader calls), without
        torch-checkpointing's copy into the live tensors."""
        from torch_checkpointing.storage.torch_serialization import load_torch_serialized_from_storage

        t0 = time.perf_counter()
        for item in self.state:
            load_torch_serialized_from_storage(Path(name) / f"{item}_0.pt", self.storage, map_location="cpu")
        return time.perf_counter() - t0

    def dcp_load(self, name: str, into: dict) -> dict:
        m = measure(lambda: s3dcp.load(into, f"{self.dcp_root}/{name}", config=self.config))
        return {"load_s": m.wall_s, "load_cpu_s": m.cpu_s}

    def tc_async(self) -> dict:
        name = self.name()
        t0 = time.perf_counter()
        write = self.async_.save(name, self.state)
        with self.async_.lock():  # the training thread's next optimizer step waits here, and only here
            stall = time.perf_counter() - t0
        write.result()
        return {"stall_s": stall, "async_total_s": time.perf_counter() - t0}

    def dcp_async(self) -> dict:
        name = self.name()
        t0 = time.perf_counter()
        future = s3dcp.async_save(self.state, f"{self.dcp_root}/{name}", config=self.config)
        stall = time.perf_counter() - t0
        future.result()
        return {"stall_s": stall, "async_total_s": time.perf_counter() - t0}

    def close(self) -> None:
        self.sync.close()
        self.async_.close()


def run(args, target) -> dict:
    state = make_state(args.state_mib)
    size = nbytes(state)
    paths = Ways(target, state)
    rows = {"tc": [], "dcp": []}
    try:
        paths.tc_async(), paths.dcp_async()  # warm up: the writer subprocess, the pools, the connections
        for r in range(args.repeats):
            for way in ("tc", "dcp"):
                saved = getattr(paths, f"{way}_save")()
                into = blank(state)
                release_memory()
                loaded = getattr(paths, f"{way}_load")(saved["name"], into)
                if not same(into, state):
                    raise SystemExit(f"error: {way} loaded something else than it saved")
                row = {**saved, **loaded, **getattr(paths, f"{way}_async")()}
                if way == "tc":
                    release_memory()
                    row["files_s"] = paths.tc_files(saved["name"])
                rows[way].append(row)
                print(f"# repeat {r + 1} {way}: save {row['save_s']:.3f} s ({row['save_cpu_s']:.2f} CPU s), load "
                      f"{row['load_s']:.3f} s ({row['load_cpu_s']:.2f} CPU s), async stall {row['stall_s']:.3f} s, "
                      f"async to commit {row['async_total_s']:.3f} s", flush=True)
                del into
    finally:
        paths.close()
    keys = ("save_s", "save_cpu_s", "load_s", "load_cpu_s", "stall_s", "async_total_s")
    summary = {way: {k: median(r[k] for r in rs) for k in keys} for way, rs in rows.items()}
    ratios = {k: summary["tc"][k] / summary["dcp"][k] for k in keys}
    summary["tc"]["files_s"] = median(r["files_s"] for r in rows["tc"])
    ratios["files_s"] = summary["tc"]["files_s"] / summary["dcp"]["load_s"]
    return {"state_mib": size / MiB, "tensors": sum(1 for _ in _leaves(state)), "summary": summary,
            "ratios": ratios, "rows": rows}


def _leaves(state):
    for v in state.values():
        yield from (_leaves(v) if isinstance(v, dict) else [v])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--state-mib", type=int, default=256, help="state size (default 256)")
    add_common_args(parser, repeats=3)
    args = parser.parse_args(argv)
    with s3_target(args) as target:
        result = run(args, target)
    s, x = result["summary"], result["ratios"]
    rows = [{"path": way, **s[way]} for way in ("tc", "dcp")] + [{"path": "tc / dcp", **x}]
    print_table(rows, [("path", "path"), ("save_s", "save s", ".3f"), ("save_cpu_s", "save CPU s", ".2f"),
                       ("load_s", "load s", ".3f"), ("load_cpu_s", "load CPU s", ".2f"),
                       ("stall_s", "async stall s", ".3f"), ("async_total_s", "async to commit s", ".3f")],
                title=f"torch-checkpointing (tc) vs s3dcp's DCP path (dcp), {result['state_mib']:.0f} MiB, "
                      f"{result['tensors']} tensors, medians of {args.repeats}")
    lines = [f"{what}: tc {x[key]:.2f}x dcp ({'PASS' if x[key] <= GOAL_X else 'FAIL'}, goal <= {GOAL_X}x)"
             for what, key in (("save", "save_s"), ("load", "load_s"))]
    lines.append(f"stall: tc {x['stall_s']:.2f}x dcp ({'PASS' if x['stall_s'] <= GOAL_X else 'FAIL'}, "
                 f"goal: as low, within {GOAL_X}x)")
    lines.append(f"of tc's load, the files through this backend alone (filled, deserialized; no copy into the "
                 f"live tensors) took {s['tc']['files_s']:.3f} s, {x['files_s']:.2f}x dcp's whole load")
    for line in lines:
        print("verdict " + line)
    path = write_json(results_path(args, "torch_checkpointing"), {
        "benchmark": "torch_checkpointing", "environment": environment_info(), "target": target.describe(),
        "settings": {k: v for k, v in vars(args).items() if k != "endpoint"}, **result, "verdict": lines})
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
