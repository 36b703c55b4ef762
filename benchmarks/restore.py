"""Restore at scale: plain DCP reads against cooperative reads, 8 ranks as two simulated nodes.

    python benchmarks/restore.py                        # 128 MiB state, 64 MiB window: ~3 min on 2 cores
    python benchmarks/restore.py --state-mib 256 --window-mib 32 --repeats 3

One server, one job (``tests/multinode.py``: torchrun --nnodes 2 --nproc-per-node 4, twice, on
loopback): the ranks save a state as 8 row shards, then restore it, for each layout, with
plain reads (``S3StorageReader()``) and cooperative reads (``S3StorageReader(cooperative=True)``),
interleaved, the same number of times:

    R=1  8 shards, no replica (nothing shared: cooperative = plain)
    R=2  2 replicas × 4 shards  (HSDP: replica groups across the two nodes)
    R=4  4 replicas × 2 shards
    R=8  8 replicas × 1 shard   (replicated DTensors)
    DDP  plain tensors, every rank loads the whole state

Per layout and mode it prints the bytes read from S3 as s3dcp counts them (``last_stats``)
and as a proxy in front of the server counts them (the Range of every GET of a data object,
on one more run of each), their ratio to the unique stored bytes, the wall time to the last
rank (median), the peak RSS per rank above its state (max over ranks and runs), and
cooperative/plain ratios with the issue's goals: S3 bytes 1.00× the unique bytes for every R,
wall ≤ 0.7× plain at R=4, extra peak RSS per rank ≤ the exchange window.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parent / "tests")]

MiB = 1 << 20
LAYOUTS = ["R=1", "R=2", "R=4", "R=8", "DDP"]
COLS = 1024


# ================================================================================ the job (each rank)
def _state(state_mib: int, world: int) -> dict:
    import torch

    rows = state_mib * MiB // 4 // COLS // 8 // world * world  # 8 tensors, rows divisible by the world
    return {f"layer{i}": torch.randn(rows, COLS, generator=torch.Generator().manual_seed(i)) for i in range(8)}


def job(uri: str, state_mib: int, repeats: int, window_mib: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from common import data_gets, peak_rss_sampler, release_memory
    from multinode import job_env, write_result
    from s3dcp import S3Config, S3StorageReader, S3StorageWriter

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    env = job_env()
    rank, world = env["rank"], env["world"]
    cfg = S3Config().resolved()
    full = _state(state_mib, world)
    flat = init_device_mesh("cpu", (world,))
    dcp.save({k: distribute_tensor(v, flat, [Shard(0)]) for k, v in full.items()},
             storage_writer=S3StorageWriter(uri, config=cfg))
    unique = sum(v.numel() * v.element_size() for v in full.values())

    proxy = None
    port = [None]
    if rank == 0:  # counts what reaches the server, independently of s3dcp's figures
        from urllib.parse import urlsplit

        from fault_proxy import FaultProxy

        u = urlsplit(cfg.endpoint_url)
        proxy = FaultProxy(u.hostname, u.port).start()
        port = [proxy.port]
    dist.broadcast_object_list(port, src=0)
    proxied = cfg.replace(endpoint_url=f"http://127.0.0.1:{port[0]}")

    meshes = {"R=1": (flat, [Shard(0)]), f"R={world}": (flat, [Replicate()])}
    for r in (2, 4):
        meshes[f"R={r}"] = (init_device_mesh("cpu", (r, world // r), mesh_dim_names=("rep", "shard")),
                            [Replicate(), Shard(0)])

    def dest(layout: str) -> dict:
        if layout == "DDP":
            return {k: torch.zeros_like(v) for k, v in full.items()}
        mesh, placements = meshes[layout]
        return {k: distribute_tensor(torch.zeros_like(v), mesh, placements) for k, v in full.items()}

    def check(state: dict) -> None:
        for k, v in state.items():
            got = v.full_tensor() if isinstance(v, DTensor) else v
            assert torch.equal(got, full[k]), f"{k} differs after the restore"

    def run(layout: str, mode: str, config, counted: bool) -> dict:
        state = dest(layout)
        release_memory()
        reader = S3StorageReader(uri, config=config, cooperative=(mode == "coop"),
                                 exchange_window_bytes=window_mib * MiB)
        before = len(proxy.requests) if proxy is not None and counted else 0
        dist.barrier()
        t0 = time.time()
        with peak_rss_sampler(0.005) as rss:
            dcp.load(state, storage_reader=reader)
        t1 = time.time()
        times = [None] * world
        dist.all_gather_object(times, (t0, t1))
        out = {"wall_s": max(t[1] for t in times) - min(t[0] for t in times), "rss_extra": rss.extra,
               "stats": dataclasses.asdict(reader.last_stats)}
        dist.barrier()
        if counted:
            if proxy is not None:
                out["proxy_bytes"], out["proxy_gets"] = data_gets(proxy.requests[before:])
            check(state)
        del state
        gc.collect()
        return out

    results: dict = {"env": env, "unique": unique, "runs": {}}
    for layout in LAYOUTS:
        for i in range(repeats):
            for mode in (("plain", "coop") if i % 2 == 0 else ("coop", "plain")):
                results["runs"].setdefault(f"{layout}/{mode}", []).append(run(layout, mode, cfg, False))
        for mode in ("plain", "coop"):
            results["runs"][f"{layout}/{mode}/counted"] = run(layout, mode, proxied, True)
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
    p.add_argument("--state-mib", type=int, default=128, help="state size (MiB, default 128)")
    p.add_argument("--window-mib", type=int, default=64, help="exchange window per rank (MiB, default 64)")
    add_common_args(p, repeats=2)
    args = p.parse_args()

    with s3_target(args) as target:
        c = target.config
        env = {"AWS_ENDPOINT_URL": c.endpoint_url, "AWS_REGION": c.region or "us-east-1",
               "AWS_ACCESS_KEY_ID": c.access_key_id or "", "AWS_SECRET_ACCESS_KEY": c.secret_access_key or ""}
        uri = target.uri(f"restore-bench/{target.run_id}")
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="s3dcp-restore-") as tmp:
            job_args = ["--job", uri, str(args.state_mib), str(args.repeats), str(args.window_mib)]
            ranks = run_two_nodes(__file__, job_args, outdir=tmp, nproc_per_node=4, env=env, timeout_s=1800)
        elapsed = time.perf_counter() - t0

    unique = ranks[0]["unique"]
    window = args.window_mib * MiB
    rows, verdicts = [], []
    for layout in LAYOUTS:
        by_mode = {}
        for mode in ("plain", "coop"):
            runs = [r["runs"][f"{layout}/{mode}"] for r in ranks]  # [rank][repeat]
            counted = ranks[0]["runs"][f"{layout}/{mode}/counted"]
            stats = runs[0][-1]["stats"]
            row = {"layout": layout, "mode": mode,
                   "s3_mib": stats["job_s3_bytes"] / MiB if mode == "coop" else
                   sum(rr[-1]["stats"]["s3_bytes"] for rr in runs) / MiB,
                   "proxy_mib": counted["proxy_bytes"] / MiB, "gets": counted["proxy_gets"],
                   "wall_s": statistics.median(runs[0][i]["wall_s"] for i in range(len(runs[0]))),
                   "rss_extra_mib": max(x["rss_extra"] for rr in runs for x in rr) / MiB,
                   "peer_mib": stats["job_peer_bytes"] / MiB if mode == "coop" else 0.0,
                   "rounds": stats["rounds"]}
            cs = [r["runs"][f"{layout}/{mode}/counted"]["stats"] for r in ranks]
            row["counted_s3_mib"] = sum(x["s3_bytes"] for x in cs) / MiB  # s3dcp's figure, same run as the proxy's
            row["s3_x"] = row["proxy_mib"] * MiB / unique
            by_mode[mode] = row
            rows.append(row)
        plain, coop = by_mode["plain"], by_mode["coop"]
        coop["wall_vs_plain"] = coop["wall_s"] / plain["wall_s"]
        coop["rss_vs_plain_mib"] = coop["rss_extra_mib"] - plain["rss_extra_mib"]
        verdicts.append((f"{layout}: S3 bytes = 1.00x unique (cooperative)", abs(coop["s3_x"] - 1.0) < 1e-9,
                         f"{coop['s3_x']:.3f}x (plain {plain['s3_x']:.2f}x)"))
        verdicts.append((f"{layout}: extra peak RSS per rank <= window ({args.window_mib} MiB)",
                         coop["rss_extra_mib"] <= args.window_mib,
                         f"{coop['rss_extra_mib']:.1f} MiB (plain {plain['rss_extra_mib']:.1f} MiB)"))
        if layout == "R=4":
            verdicts.append(("R=4: wall <= 0.7x plain", coop["wall_vs_plain"] <= 0.7, f"{coop['wall_vs_plain']:.2f}x"))
    print_table(rows, [("layout", "layout"), ("mode", "mode"), ("s3_mib", "S3 MiB (s3dcp)", ".1f"),
                       ("counted_s3_mib", "(same run)", ".1f"), ("proxy_mib", "S3 MiB (proxy)", ".1f"),
                       ("s3_x", "x unique", ".2f"), ("gets", "GETs"),
                       ("peer_mib", "peer MiB", ".1f"), ("rounds", "rounds"), ("wall_s", "wall s", ".2f"),
                       ("wall_vs_plain", "wall/plain", ".2f"), ("rss_extra_mib", "peak RSS+ MiB", ".1f"),
                       ("rss_vs_plain_mib", "RSS vs plain", "+.1f")],
                title=f"restore on 8 ranks as 2 nodes x 4: {unique / MiB:.0f} MiB unique, window "
                      f"{args.window_mib} MiB, {args.repeats} repeat(s), {elapsed:.0f} s in all")
    for what, ok, value in verdicts:
        print(f"{'PASS' if ok else 'FAIL'}  {what}: {value}")
    path = write_json(results_path(args, "restore"), {"environment": environment_info(), "target": target.describe(),
                                                      "unique_bytes": unique, "window_bytes": window, "rows": rows,
                                                      "verdicts": verdicts, "ranks": ranks})
    print(f"# results: {path}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--job":
        job(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    else:
        main()
