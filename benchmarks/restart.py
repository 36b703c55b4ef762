"""Restart from each tier: the same checkpoint restored from the local copies, from peer
replicas, and from S3 (plain and cooperative reads), 4 ranks as two simulated nodes.

    python benchmarks/restart.py                        # 512 MiB state, 3 repeats: ~2 min on 2 cores
    python benchmarks/restart.py --state-mib 256 --repeats 5

One server, one job (``tests/multinode.py``: torchrun --nnodes 2 --nproc-per-node 2, twice, on
loopback). Each rank saves its shard of the state once through a ``CheckpointManager`` with
``local_dir`` (each node's: a directory under ``/dev/shm``, the tmpfs a node would use) and
``local_replicas=1``, committed to S3 too. Then, interleaved, the same number of times, every
rank restores it into a zeroed state:

    local      manager.load(): every node's copies intact, read from its own files
    peer       manager.load() with node 1's local_dir moved away (a replaced node): node 1's
               ranks get their objects from node 0, which holds their replicas
    s3-plain   dcp.load with S3StorageReader (what a restart without the local tier reads)
    s3-coop    the same, cooperative=True (no stored byte is needed by two ranks here: the same
               reads, plus the planning)

Each load goes through a proxy in front of the server that counts the GETs of data objects. Printed
per tier: wall seconds to the last rank (median), MiB per tier (s3dcp's figures) and data GETs
seen by the proxy, and the verdicts: local ≥ 5x faster than s3-plain, and no data GET from S3
while every node's copy is intact.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parent / "tests")]

MiB = 1 << 20
TIERS = ["local", "peer", "s3-plain", "s3-coop"]


# ================================================================================ the job (each rank)
def _state(rank: int, state_mib: int, world: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(rank)
    per = state_mib * MiB // world // 4 // 8
    return {f"r{rank}.layer{i}": torch.randn(per, generator=g) for i in range(8)}


def job(uri: str, root: str, state_mib: int, repeats: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from common import data_gets, release_memory
    from multinode import job_env, write_result
    from s3dcp import CheckpointManager, S3Config, S3StorageReader

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    env = job_env()
    rank, world = env["rank"], env["world"]
    local_dir = Path(root) / f"node{env['node']}"
    cfg = S3Config().resolved()

    proxy, port = None, [None]
    if rank == 0:
        from urllib.parse import urlsplit

        from fault_proxy import FaultProxy

        u = urlsplit(cfg.endpoint_url)
        proxy = FaultProxy(u.hostname, u.port).start()
        port = [proxy.port]
    dist.broadcast_object_list(port, src=0)
    proxied = cfg.replace(endpoint_url=f"http://127.0.0.1:{port[0]}")

    state = _state(rank, state_mib, world)
    with CheckpointManager(uri, config=cfg, local_dir=local_dir, local_replicas=1, keep_last=None) as manager:
        manager.save(1, state)
    step_uri = f"{uri}/step-00000001"

    def run(tier: str) -> dict:
        dest = {k: torch.zeros_like(v) for k, v in state.items()}
        hidden = local_dir.with_name(local_dir.name + ".away")
        if tier == "peer" and env["node"] == 1 and env["local_rank"] == 0:
            local_dir.rename(hidden)
        release_memory()
        before = len(proxy.requests) if proxy is not None else 0
        dist.barrier()
        t0 = time.time()
        stats: dict = {}
        if tier in ("local", "peer"):
            with CheckpointManager(uri, config=proxied, local_dir=local_dir, local_replicas=1,
                                   keep_last=None) as restarted:
                restarted.load(dest)
                stats = dict(restarted.last_load_stats)
        else:
            reader = S3StorageReader(step_uri, config=proxied, cooperative=tier == "s3-coop")
            dcp.load(dest, storage_reader=reader)
            stats = {"s3_bytes": reader.last_stats.s3_bytes, "local_bytes": 0, "peer_bytes": 0}
        t1 = time.time()
        times = [None] * world
        dist.all_gather_object(times, (t0, t1))
        counted = data_gets(proxy.requests[before:]) if proxy is not None else (0, 0)
        dist.barrier()
        if tier == "peer" and env["node"] == 1 and env["local_rank"] == 0:
            shutil.rmtree(local_dir, ignore_errors=True)  # what the restore left there
            hidden.rename(local_dir)
        assert all(torch.equal(dest[k], v) for k, v in state.items()), f"{tier}: the restored state differs"
        return {"wall_s": max(t[1] for t in times) - min(t[0] for t in times), "stats": stats,
                "proxy_bytes": counted[0], "proxy_gets": counted[1]}

    results: dict = {"env": env, "state_bytes": sum(v.nbytes for v in state.values()), "runs": {}}
    for i in range(repeats):
        for tier in (TIERS if i % 2 == 0 else TIERS[::-1]):
            results["runs"].setdefault(tier, []).append(run(tier))
    write_result(results)
    dist.barrier()
    if proxy is not None:
        proxy.stop()
    dist.destroy_process_group()


# ================================================================================ the driver
def main() -> None:
    from common import add_common_args, environment_info, print_table, results_path, s3_target, write_json
    from multinode import run_two_nodes

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--state-mib", type=int, default=512, help="state size over all ranks (MiB, default 512)")
    p.add_argument("--local-root", default=None,
                   help="where the nodes' local_dirs go (default: a new directory under /dev/shm)")
    add_common_args(p, repeats=3)
    args = p.parse_args()

    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    root = Path(args.local_root or tempfile.mkdtemp(prefix="s3dcp-restart-", dir=shm))
    try:
        with s3_target(args) as target:
            c = target.config
            env = {"AWS_ENDPOINT_URL": c.endpoint_url, "AWS_REGION": c.region or "us-east-1",
                   "AWS_ACCESS_KEY_ID": c.access_key_id or "", "AWS_SECRET_ACCESS_KEY": c.secret_access_key or ""}
            uri = target.uri(f"restart-bench/{target.run_id}")
            t0 = time.perf_counter()
            with tempfile.TemporaryDirectory(prefix="s3dcp-restart-out-") as out:
                ranks = run_two_nodes(__file__, ["--job", uri, str(root), str(args.state_mib), str(args.repeats)],
                                      outdir=out, nproc_per_node=2, env=env, timeout_s=1800)
            elapsed = time.perf_counter() - t0
    finally:
        if args.local_root is None:
            shutil.rmtree(root, ignore_errors=True)

    state = sum(r["state_bytes"] for r in ranks)
    rows = []
    for tier in TIERS:
        runs = ranks[0]["runs"][tier]
        last = [r["runs"][tier][-1]["stats"] for r in ranks]
        rows.append({"tier": tier, "wall_s": statistics.median(x["wall_s"] for x in runs),
                     "local_mib": sum(s.get("local_bytes", 0) for s in last) / MiB,
                     "peer_mib": sum(s.get("peer_bytes", 0) for s in last) / MiB,
                     "s3_mib": sum(s.get("s3_bytes", 0) for s in last) / MiB,
                     "proxy_gets": max(x["proxy_gets"] for x in runs),
                     "proxy_mib": max(x["proxy_bytes"] for x in runs) / MiB})
    by = {r["tier"]: r for r in rows}
    for r in rows:
        r["x_s3"] = by["s3-plain"]["wall_s"] / r["wall_s"]
    print_table(rows, [("tier", "restored from"), ("wall_s", "wall s", ".3f"), ("x_s3", "x faster than S3", ".1f"),
                       ("local_mib", "local MiB", ".1f"), ("peer_mib", "peer MiB", ".1f"),
                       ("s3_mib", "S3 MiB", ".1f"), ("proxy_gets", "data GETs (proxy)"),
                       ("proxy_mib", "MiB (proxy)", ".1f")],
                title=f"restart of {state / MiB:.0f} MiB on 4 ranks as 2 nodes x 2 (local_dir on "
                      f"{'tmpfs' if shm and str(root).startswith(shm) else root}), medians of {args.repeats}, "
                      f"{elapsed:.0f} s in all")
    verdicts = [("a restore from the local tier >= 5x faster than from S3", by["local"]["x_s3"] >= 5,
                 f"{by['local']['x_s3']:.1f}x"),
                ("no data GET from S3 while every node's copy is intact", by["local"]["proxy_gets"] == 0,
                 f"{by['local']['proxy_gets']} GET(s)"),
                ("a replaced node restores from the peers, no data GET from S3", by["peer"]["proxy_gets"] == 0,
                 f"{by['peer']['proxy_gets']} GET(s), {by['peer']['peer_mib']:.0f} MiB from peers")]
    for what, ok, value in verdicts:
        print(f"{'PASS' if ok else 'FAIL'}  {what}: {value}")
    path = write_json(results_path(args, "restart"), {"environment": environment_info(), "target": target.describe(),
                                                      "state_bytes": state, "rows": rows, "verdicts": verdicts,
                                                      "ranks": ranks})
    print(f"# results: {path}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--job":
        job(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    else:
        main()
