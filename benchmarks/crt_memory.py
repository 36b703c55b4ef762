"""Memory a checkpointing process needs, and what the CRT's part-buffer cap costs in speed.

    python benchmarks/crt_memory.py                  # 512 MiB state, 3 interleaved repeats
    python benchmarks/crt_memory.py --state-mib 1024 --repeats 2

Each trial runs in a fresh process: build the state (that RSS is the baseline), then either a
synchronous ``dcp.save`` or an ``async_save`` (staging pool + upload), sampling peak RSS. Two
settings of ``S3Config.crt_memory_limit_bytes`` run interleaved: s3dcp's default (sized from
the part size and throughput target, 299 MiB with the defaults) and ``0`` (the CRT's own
default, 2+ GiB). Printed: upload GB/s and peak RSS above the state (and above state + pool
for async), as MiB and as a fraction of the state, and the throughput ratio of the two
settings measured in this run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (  # noqa: E402
    MiB, add_common_args, environment_info, median, print_table, results_path, s3_target, unique_prefix,
    write_json,
)


def trial(uri: str, state_mib: int, mode: str, crt_mib: int | None) -> dict:
    """One save in this (fresh) process; prints its figures as JSON."""
    import psutil
    import torch
    import torch.distributed.checkpoint as dcp

    from common import peak_rss_sampler
    from s3dcp import HostBufferPool, S3Config, S3StorageWriter
    from stall import make_state

    config = S3Config(crt_memory_limit_bytes=None if crt_mib is None else crt_mib * MiB)
    state = make_state(state_mib, shape="large")
    nbytes = sum(t.numel() * t.element_size() for t in state["model"].values()) + sum(
        t.numel() * t.element_size() for s in state["optim"]["state"].values() for t in s.values())
    me = psutil.Process()
    torch.manual_seed(0)
    base = me.memory_info().rss
    pool = HostBufferPool()
    with peak_rss_sampler() as rss:
        t0 = time.perf_counter()
        writer = S3StorageWriter(uri, config=config, pool=pool)
        if mode == "sync":
            dcp.save(state, storage_writer=writer)
        else:
            dcp.async_save(state, storage_writer=writer).result()
        seconds = time.perf_counter() - t0
    return {"state_bytes": nbytes, "seconds": seconds, "gbps": nbytes / seconds / 1e9,
            "rise_mib": (rss.peak - base) / MiB, "pool_mib": pool.bytes_allocated / MiB}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--state-mib", type=int, default=512, help="state size (default 512)")
    parser.add_argument("--modes", nargs="+", choices=["sync", "async"], default=["sync", "async"])
    add_common_args(parser, repeats=3)
    args = parser.parse_args(argv)

    settings = {"s3dcp default (299 MiB)": None, "CRT default (0)": 0}
    results: dict[tuple[str, str], list[dict]] = {}
    with s3_target(args) as target:
        env = dict(os.environ, AWS_ENDPOINT_URL=target.endpoint_url, AWS_REGION=target.config.region,
                   AWS_ACCESS_KEY_ID=target.config.access_key_id,
                   AWS_SECRET_ACCESS_KEY=target.config.secret_access_key,
                   PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.abspath(__file__)),
                                               os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]))
        for r in range(args.repeats):
            for mode in args.modes:
                for name, crt in settings.items():
                    uri = target.uri(unique_prefix(target, "crt-memory", f"{mode}-{crt}-{r}"))
                    code = (f"import json, crt_memory; print(json.dumps(crt_memory.trial({uri!r}, {args.state_mib}, "
                            f"{mode!r}, {crt!r})))")
                    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                         check=False)
                    if out.returncode != 0:
                        print(out.stderr[-3000:], file=sys.stderr)
                        return 1
                    results.setdefault((mode, name), []).append(json.loads(out.stdout.strip().splitlines()[-1]))
    rows = []
    for (mode, name), trials in results.items():
        state_mib = trials[0]["state_bytes"] / MiB
        rise = median(t["rise_mib"] for t in trials)
        pool = median(t["pool_mib"] for t in trials)
        extra = rise - (pool if mode == "async" else 0.0)
        rows.append({"mode": mode, "setting": name, "gbps": median(t["gbps"] for t in trials),
                     "rise_mib": rise, "pool_mib": pool, "extra_mib": extra, "extra_of_state": extra / state_mib})
    for mode in args.modes:
        ours = next(r for r in rows if r["mode"] == mode and r["setting"].startswith("s3dcp"))
        crt = next(r for r in rows if r["mode"] == mode and r["setting"].startswith("CRT"))
        ours["gbps_vs_crt_default"] = ours["gbps"] / crt["gbps"]
    print_table(rows, [("mode", "mode"), ("setting", "crt_memory_limit"), ("gbps", "upload GB/s", ".3f"),
                       ("gbps_vs_crt_default", "x CRT default", ".2f"), ("rise_mib", "peak RSS rise MiB", ".0f"),
                       ("pool_mib", "pool MiB", ".0f"), ("extra_mib", "beyond state+pool MiB", ".0f"),
                       ("extra_of_state", "beyond / state", ".2f")],
                title=f"{args.state_mib} MiB state, medians of {args.repeats} (fresh process per trial)")
    path = write_json(results_path(args, "crt_memory"), {
        "benchmark": "crt_memory", "environment": environment_info(), "target": target.describe(),
        "settings": {k: v for k, v in vars(args).items() if k != "endpoint"}, "rows": rows})
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
