"""How long dcp.async_save blocks the caller, against the floor: a warm memcpy of the same bytes.

    python benchmarks/stall.py                      # 512 MiB state, 6 checkpoints, embedded S3
    python benchmarks/stall.py --state-mib 2048 --checkpoints 10

Per checkpoint: the time async_save blocked (the stall), the ratio to the warm-memcpy floor
measured in the same run, how long the upload took to commit, and this process's RSS. Also the
floor of a cold copy (into freshly allocated memory: what a pool-less stager pays every time)
and the time of a synchronous dcp.save of the same state. Targets (issue 7): warm stall within
1.2x the floor, at most 1/10 of the synchronous save, RSS flat over the checkpoints.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import psutil  # noqa: E402
import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from common import (  # noqa: E402
    MiB, add_common_args, environment_info, median, peak_rss_sampler, print_table, release_memory,
    results_path, s3_target, unique_prefix, write_json,
)


def make_state(total_mib: int, seed: int = 0) -> dict:
    """Weights, AdamW-like moments and a few small tensors: large and small items mixed."""
    gen = torch.Generator().manual_seed(seed)
    per_param = total_mib * MiB // 3 // 4  # fp32 elements per (param, exp_avg, exp_avg_sq) triple
    sizes = []
    left = per_param
    while left > 0:
        n = min(left, 4 * 1024 * 1024)  # 16 MiB tensors, the last one smaller
        sizes.append(n)
        left -= n
    state = {"model": {}, "optim": {"state": {}, "step": 0}}
    for i, n in enumerate(sizes):
        state["model"][f"layer{i}.weight"] = torch.randn(n, generator=gen)
        state["model"][f"layer{i}.bias"] = torch.randn(256, generator=gen).to(torch.bfloat16)
        state["optim"]["state"][i] = {"exp_avg": torch.randn(n, generator=gen),
                                      "exp_avg_sq": torch.rand(n, generator=gen)}
    return state


def tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from tensors(v)


def memcpy_floor(state: dict) -> tuple[float, float]:
    """(cold, warm) seconds to copy every tensor of ``state`` into host buffers: cold into new
    allocations, warm into the same buffers again."""
    srcs = list(tensors(state))
    t0 = time.perf_counter()
    dsts = [torch.empty_like(t) for t in srcs]
    for d, s in zip(dsts, srcs):
        d.copy_(s)
    cold = time.perf_counter() - t0
    warm = []
    for _ in range(3):
        t0 = time.perf_counter()
        for d, s in zip(dsts, srcs):
            d.copy_(s)
        warm.append(time.perf_counter() - t0)
    del dsts
    release_memory()
    return cold, min(warm)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--state-mib", type=int, default=512, help="state size (default 512)")
    parser.add_argument("--checkpoints", type=int, default=6, help="async checkpoints in a row (default 6)")
    parser.add_argument("--gap-s", type=float, default=0.5,
                        help="pause between a checkpoint's commit and the next async_save (default 0.5)")
    parser.add_argument("--crt-memory-mib", type=int, default=None,
                        help="cap the CRT's part buffers (S3Config.crt_memory_limit_bytes; default: CRT's own)")
    add_common_args(parser, repeats=1)
    args = parser.parse_args(argv)

    from s3dcp import HostBufferPool, S3StorageWriter

    state = make_state(args.state_mib)
    nbytes = sum(t.numel() * t.element_size() for t in tensors(state))
    cold, warm = memcpy_floor(state)
    print(f"# state {nbytes / MiB:.0f} MiB in {len(list(tensors(state)))} tensors; memcpy floor: "
          f"warm {warm:.3f} s ({nbytes / warm / 1e9:.1f} GB/s), cold {cold:.3f} s", flush=True)
    rows = []
    with s3_target(args) as target:
        if args.crt_memory_mib:
            target.config = target.config.replace(crt_memory_limit_bytes=args.crt_memory_mib * MiB)
        pool = HostBufferPool()
        me = psutil.Process()
        release_memory()
        rss_start = me.memory_info().rss
        with peak_rss_sampler() as rss:
            for k in range(args.checkpoints):
                writer = S3StorageWriter(target.uri(unique_prefix(target, "stall", f"ckpt{k}")),
                                         config=target.config, pool=pool)
                t0 = time.perf_counter()
                future = dcp.async_save(state, storage_writer=writer)
                stall = time.perf_counter() - t0
                future.result()
                committed = time.perf_counter() - t0
                rows.append({"checkpoint": k + 1, "stall_s": stall, "vs_floor": stall / warm,
                             "stage_s": writer.last_stats.stage_s, "commit_s": committed,
                             "upload_gbps": writer.last_stats.upload_gbps,
                             "rss_mib": me.memory_info().rss / MiB, "pool_allocations": pool.allocations})
                time.sleep(args.gap_s)
        sync = []
        for k in range(2):
            t0 = time.perf_counter()
            dcp.save(state, storage_writer=S3StorageWriter(
                target.uri(unique_prefix(target, "stall", f"sync{k}")), config=target.config))
            sync.append(time.perf_counter() - t0)
    print()
    print_table(rows, [("checkpoint", "#"), ("stall_s", "stall s", ".3f"), ("vs_floor", "x floor", ".2f"),
                       ("commit_s", "committed s", ".2f"), ("upload_gbps", "upload GB/s", ".3f"),
                       ("rss_mib", "RSS MiB", ".0f"), ("pool_allocations", "pool allocs")],
                title="async_save stall per checkpoint")
    warm_stalls = [r["stall_s"] for r in rows[1:]] or [rows[0]["stall_s"]]
    summary = {
        "state_mib": nbytes / MiB,
        "memcpy_warm_s": warm, "memcpy_cold_s": cold,
        "stall_first_s": rows[0]["stall_s"], "stall_warm_median_s": median(warm_stalls),
        "warm_stall_vs_floor": median(warm_stalls) / warm,
        "sync_save_s": median(sync), "stall_vs_sync": median(warm_stalls) / median(sync),
        "rss_start_mib": rss_start / MiB, "rss_peak_mib": rss.peak / MiB,
        "pool_mib": pool.bytes_allocated / MiB,
        "rss_peak_vs_state_plus_pool": (rss.peak - rss_start) / (pool.bytes_allocated or 1),
        "rss_spread_mib": (max(r["rss_mib"] for r in rows[1:]) - min(r["rss_mib"] for r in rows[1:]))
        if len(rows) > 1 else 0.0,
    }
    print(f"\nwarm stall {summary['stall_warm_median_s']:.3f} s = {summary['warm_stall_vs_floor']:.2f}x the warm "
          f"memcpy floor ({warm:.3f} s; cold copy {cold:.3f} s); first checkpoint {rows[0]['stall_s']:.3f} s")
    print(f"synchronous dcp.save {summary['sync_save_s']:.2f} s: the warm stall is "
          f"1/{1 / summary['stall_vs_sync']:.0f} of it")
    print(f"RSS: {rss_start / MiB:.0f} MiB before (the state itself), peak {rss.peak / MiB:.0f} MiB, pool "
          f"{pool.bytes_allocated / MiB:.0f} MiB, spread over checkpoints 2..{len(rows)}: "
          f"{summary['rss_spread_mib']:.0f} MiB")
    path = write_json(results_path(args, "stall"), {
        "benchmark": "stall", "environment": environment_info(), "target": target.describe(),
        "settings": {k: v for k, v in vars(args).items() if k != "endpoint"}, "summary": summary, "rows": rows})
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
