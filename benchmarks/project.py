"""Project the seed scenario — 500 GB every 1,000 steps from 128 nodes — from measured figures.

    python benchmarks/project.py                          # figures from the newest results/*.json
    python benchmarks/project.py --d2h-gbps 20 --nic-gbps 200 --prefixes 4

The model (docs/projection.md): with async staging the loop stalls only for the copy of each
GPU's shard into warm pinned host memory, so

    stall       = shard bytes / device-to-host bandwidth + fixed overhead per checkpoint
    upload      = node bytes / min(NIC, processes x per-process upload rate)
    requests    = parts (bytes / part size) + 2 per object (create + complete) + 1 metadata
    rate/prefix = requests / upload time / prefixes        (S3: ~3,500 PUT/s per prefix)

Measured inputs (stall overhead and per-process upload rate) come from this machine's
benchmark results; bandwidths of the target cluster are assumptions, printed next to the
result. Where the projected upload outlasts the checkpoint interval, back-pressure would add
the difference to the stall, and the projection says so.

Restore (the time until training resumes), for R data-parallel replicas of the state
(``--replicas``; each rank needs R x checkpoint / ranks), plain against cooperative reads:

    plain        S3 bytes = R x checkpoint; per node R x checkpoint / nodes through its NIC
    cooperative  S3 bytes = checkpoint (each byte once); per node checkpoint / nodes through its
                 NIC, and (R-1)/R of what its ranks need from peers over the interconnect,
                 overlapped with the reads (rounds are pipelined): time = the slower of the two
    GETs         S3 bytes / download part size; each phase also needs GETs / (5,500/s x prefixes)
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

GB = 1e9


def newest(pattern: str) -> dict | None:
    paths = sorted(glob.glob(pattern), key=os.path.getmtime)
    if not paths:
        return None
    with open(paths[-1]) as f:
        data = json.load(f)
    data["_path"] = paths[-1]
    return data


def measured_figures(results_dir: str) -> dict:
    """Per-process figures from the newest stall / train_loop / throughput results, if any."""
    out: dict = {}
    stall = newest(os.path.join(results_dir, "stall-*.json"))
    if stall:
        s = stall["summary"]
        state_bytes = s["state_mib"] * 2**20
        out["stall_s"] = s["stall_warm_median_s"]
        out["memcpy_s"] = s["memcpy_warm_s"]
        out["state_bytes"] = state_bytes
        # what staging adds on top of the copy itself (walking the state, DCP's bookkeeping)
        out["overhead_s"] = max(0.0, s["stall_warm_median_s"] - s["memcpy_warm_s"])
        out["stall_source"] = stall["_path"]
        uploads = [r["upload_gbps"] for r in stall.get("rows", []) if r.get("upload_gbps")]
        if uploads:
            out["upload_gbps"] = sorted(uploads)[len(uploads) // 2]
            out["upload_source"] = stall["_path"]
    train = newest(os.path.join(results_dir, "train_loop-*.json"))
    if train:
        row = next((r for r in train["rows"] if r["mode"] == "s3-async"), None)
        if row and row.get("upload_gbps"):
            out.setdefault("upload_gbps", row["upload_gbps"])
            out.setdefault("upload_source", train["_path"])
    return out


def project(a: argparse.Namespace) -> dict:
    gpus = a.nodes * a.gpus_per_node
    shard = a.checkpoint_gb * GB / gpus
    node_bytes = a.checkpoint_gb * GB / a.nodes
    stall = shard / (a.d2h_gbps * GB) + a.overhead_s
    per_process_upload = a.upload_gbps_per_process * GB
    node_upload_bw = min(a.nic_gbps / 8 * GB, a.gpus_per_node * per_process_upload)
    upload_s = node_bytes / node_upload_bw
    part = int(a.part_size_mib * 2**20)
    objects_per_rank = max(1, -(-int(shard) // int(a.object_size_mib * 2**20)))
    objects = gpus * objects_per_rank
    parts = objects * max(1, -(-int(shard / objects_per_rank) // part))
    requests = parts + 2 * objects + 1
    rate = requests / upload_s / a.prefixes
    interval = a.every_steps * a.step_s
    backpressure = max(0.0, upload_s - interval)
    return {
        "gpus": gpus, "shard_gb": shard / GB, "node_gb": node_bytes / GB,
        "stall_s": stall + backpressure, "stall_copy_s": shard / (a.d2h_gbps * GB),
        "upload_s": upload_s, "node_upload_gbps": node_upload_bw / GB,
        "objects": objects, "parts": parts, "requests": requests, "put_rate_per_prefix": rate,
        "prefix_limit_ok": rate <= a.prefix_limit, "interval_s": interval, "backpressure_s": backpressure,
        "stalled_fraction": (stall + backpressure) / (interval + stall + backpressure),
        "baseline_stalled_fraction": a.baseline_stall_s / (interval + a.baseline_stall_s),
        "goal_met": stall + backpressure < a.goal_s,
    }


def measured_restore(results_dir: str) -> dict:
    """Per-process rates from the newest benchmarks/restore.py result, if any: the plain GET
    rate (R=1: every rank reads its own shard) and the exchange rate (DDP: bytes a rank
    receives per second of its load), both bounded by this machine's 2 shared cores."""
    r = newest(os.path.join(results_dir, "restore-*.json"))
    if not r:
        return {}
    rows = {(x["layout"], x["mode"]): x for x in r["rows"]}
    ranks = len(r["ranks"])
    out = {"source": r["_path"]}
    if ("R=1", "plain") in rows:
        x = rows[("R=1", "plain")]
        out["get_gbps"] = x["s3_mib"] * 2**20 / ranks / x["wall_s"] / GB
    if ("DDP", "coop") in rows:
        x = rows[("DDP", "coop")]
        out["exchange_gbps"] = x["peer_mib"] * 2**20 / ranks / x["wall_s"] / GB
    if ("R=4", "coop") in rows:
        out["r4_wall_ratio"] = rows[("R=4", "coop")].get("wall_vs_plain")
    out["s3_x"] = {layout: (rows[(layout, "plain")]["s3_x"], rows[(layout, "coop")]["s3_x"])
                   for layout, mode in rows if mode == "coop" and (layout, "plain") in rows}
    return out


def project_restore(a: argparse.Namespace, replicas: int) -> dict:
    """Restore time and GETs of the seed's job with ``replicas`` copies of the state, plain and
    cooperative (see the module docstring)."""
    unique = a.checkpoint_gb * GB
    gpus = a.nodes * a.gpus_per_node
    nic = a.nic_gbps / 8 * GB
    procs = a.gpus_per_node * a.get_gbps_per_process * GB if a.get_gbps_per_process else float("inf")
    node_in = min(nic, procs)
    get_rate = 5500.0 * a.prefixes  # S3 GET/s per prefix
    part = a.download_part_mib * 2**20
    out = {"replicas": replicas}
    for mode, s3_bytes in (("plain", replicas * unique), ("coop", unique)):
        gets = s3_bytes / part
        read_s = max(s3_bytes / a.nodes / node_in, gets / get_rate)
        exchange_s = 0.0
        if mode == "coop" and replicas > 1:
            need_node = replicas * unique / gpus * a.gpus_per_node
            exchange_s = need_node * (replicas - 1) / replicas / (a.interconnect_gbps / 8 * GB)
        out[f"{mode}_s3_gb"] = s3_bytes / GB
        out[f"{mode}_gets"] = gets
        out[f"{mode}_s"] = max(read_s, exchange_s)
        out[f"{mode}_bound"] = ("interconnect" if exchange_s > read_s else
                                "GET rate" if gets / get_rate > s3_bytes / a.nodes / node_in else
                                "NIC" if nic <= procs else "processes")
    out["speedup"] = out["plain_s"] / out["coop_s"]
    return out


def print_restore(a: argparse.Namespace, sources: dict) -> list[dict]:
    print("\nRestore (time until training resumes), plain DCP reads vs cooperative reads")
    rate = f"{a.get_gbps_per_process:g} GB/s per process (given)" if a.get_gbps_per_process else \
        "the NIC's (no per-process cap given)"
    print(f"  GET rate {rate}; NIC {a.nic_gbps:g} Gbit/s, "
          f"interconnect {a.interconnect_gbps:g} Gbit/s per node, download parts {a.download_part_mib:g} MiB, "
          f"{a.prefixes} prefix(es) at ~5,500 GET/s (assumed)")
    rows = [project_restore(a, r) for r in sorted({1, 2, 4, 8, 16, a.replicas})]
    head = f"  {'R':>4}  {'plain: S3 GB':>12}  {'GETs':>9}  {'time s':>7}  {'bound':>8}   " \
           f"{'coop: S3 GB':>11}  {'GETs':>9}  {'time s':>7}  {'bound':>12}  {'speedup':>7}"
    print(head)
    for r in rows:
        print(f"  {r['replicas']:>4}  {r['plain_s3_gb']:>12.0f}  {r['plain_gets']:>9.0f}  {r['plain_s']:>7.1f}  "
              f"{r['plain_bound']:>8}   {r['coop_s3_gb']:>11.0f}  {r['coop_gets']:>9.0f}  {r['coop_s']:>7.1f}  "
              f"{r['coop_bound']:>12}  {r['speedup']:>6.1f}x")
    m = measured_restore(a.results)
    if m:
        ratios = ", ".join(f"{k} {p:.2f}x/{c:.2f}x" for k, (p, c) in m["s3_x"].items())
        print(f"  measured on this machine ({m['source']}): S3 bytes / unique bytes, plain/cooperative: {ratios}; "
              f"wall at R=4 {m.get('r4_wall_ratio') or float('nan'):.2f}x plain; "
              f"per process {m.get('get_gbps', 0):.3f} GB/s from S3 and {m.get('exchange_gbps', 0):.3f} GB/s from "
              "peers (2 shared cores for 8 ranks and the server: not a cluster's rates)")
    return rows


def project_restart(a: argparse.Namespace) -> list[dict]:
    """Restart of the seed's job from each tier, and the GPU time a failure costs (restore plus
    the steps since the checkpoint it restores, half an interval on average, plus relaunching):

        local    each node reads its ranks' copies from its local_dir (tmpfs: memory bandwidth)
        peer     one node replaced: it receives its ranks' copies from the node holding their
                 replicas over the interconnect; every other node reads locally
        s3       every node reads its share from S3 (NIC or GET rate, as the restore above)
    """
    node_bytes = a.checkpoint_gb * GB / a.nodes
    local_s = node_bytes / (a.local_read_gbps * GB)
    peer_s = max(local_s, node_bytes / (a.interconnect_gbps / 8 * GB))
    s3_s = project_restore(a, 1)["plain_s"]
    gpus = a.nodes * a.gpus_per_node
    s3_interval = a.every_steps * a.step_s
    local_interval = a.local_every_steps * a.step_s

    def lost(restore_s: float, interval_s: float) -> float:  # GPU-hours per failure
        return gpus * (a.relaunch_s + restore_s + interval_s / 2) / 3600

    return [
        {"case": f"S3 only, every {a.every_steps} steps: any failure", "tier": "s3", "restore_s": s3_s,
         "gpu_hours": lost(s3_s, s3_interval)},
        {"case": f"local every {a.local_every_steps} steps (S3 every {a.every_steps}): a process dies",
         "tier": "local", "restore_s": local_s, "gpu_hours": lost(local_s, local_interval)},
        {"case": "  ... a node is lost, local_replicas=1", "tier": "peer", "restore_s": peer_s,
         "gpu_hours": lost(peer_s, local_interval)},
        {"case": "  ... a node is lost, no replicas (the last S3 step)", "tier": "s3", "restore_s": s3_s,
         "gpu_hours": lost(s3_s, s3_interval)},
        {"case": "  ... a node and its replica partner lost together", "tier": "s3", "restore_s": s3_s,
         "gpu_hours": lost(s3_s, s3_interval)},
    ]


def print_restart(a: argparse.Namespace) -> list[dict]:
    rows = project_restart(a)
    print(f"\nRestart from the nearest copy (local tier: {a.local_read_gbps:g} GB/s per node from local_dir, "
          f"assumed for tmpfs; relaunch {a.relaunch_s:g} s; GPU time lost per failure = GPUs x (relaunch + "
          "restore + half an interval of steps))")
    width = max(len(r["case"]) for r in rows)
    print(f"  {'case'.ljust(width)}  {'tier':>5}  {'restore s':>9}  {'GPU-hours lost':>14}")
    for r in rows:
        print(f"  {r['case'].ljust(width)}  {r['tier']:>5}  {r['restore_s']:>9.2f}  {r['gpu_hours']:>14.1f}")
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default="results", help="where the measured results are (default results/)")
    p.add_argument("--nodes", type=int, default=128)
    p.add_argument("--gpus-per-node", type=int, default=8, help="ranks (GPUs) per node (default 8)")
    p.add_argument("--checkpoint-gb", type=float, default=500.0)
    p.add_argument("--every-steps", type=int, default=1000)
    p.add_argument("--step-s", type=float, default=2.5,
                   help="training step time; the seed's 18 min = 30%% idle implies ~2.5 s (default 2.5)")
    p.add_argument("--d2h-gbps", type=float, default=20.0,
                   help="device-to-pinned-host copy bandwidth per GPU, GB/s (assumed; H100 PCIe5 ~25-50)")
    p.add_argument("--nic-gbps", type=float, default=100.0, help="node NIC, Gbit/s (assumed)")
    p.add_argument("--upload-gbps-per-process", type=float, default=None,
                   help="upload rate one process reaches, GB/s (default: measured, see --results)")
    p.add_argument("--overhead-s", type=float, default=None,
                   help="fixed staging overhead per checkpoint, s (default: measured stall minus memcpy)")
    p.add_argument("--part-size-mib", type=float, default=64.0)
    p.add_argument("--object-size-mib", type=float, default=512.0, help="S3Config.object_size_target_bytes")
    p.add_argument("--prefixes", type=int, default=1,
                   help="key prefixes the objects are spread over (S3Config.key_prefix_spread; default 1)")
    p.add_argument("--prefix-limit", type=float, default=3500.0, help="S3 PUT/s per prefix (default 3,500)")
    p.add_argument("--baseline-stall-s", type=float, default=18 * 60.0, help="the seed's stall (18 min)")
    p.add_argument("--goal-s", type=float, default=10.0, help="stall goal (default 10 s)")
    p.add_argument("--replicas", type=int, default=16,
                   help="data-parallel replicas of the state at restore (HSDP replica groups; default 16)")
    p.add_argument("--interconnect-gbps", type=float, default=400.0,
                   help="per-node bandwidth of the exchange between ranks, Gbit/s (assumed: NCCL over "
                        "InfiniBand/RoCE; gloo over the front-end NIC: pass the NIC's)")
    p.add_argument("--get-gbps-per-process", type=float, default=None,
                   help="download rate one process reaches, GB/s (default: no cap below the NIC)")
    p.add_argument("--download-part-mib", type=float, default=8.0, help="S3Config.download_part_size_bytes (MiB)")
    p.add_argument("--local-read-gbps", type=float, default=20.0,
                   help="per node, reading its local_dir (GB/s; assumed: tmpfs ~ memory bandwidth, NVMe ~6)")
    p.add_argument("--local-every-steps", type=int, default=100,
                   help="checkpoint interval the local tier makes affordable (S3 every --every-steps)")
    p.add_argument("--relaunch-s", type=float, default=60.0,
                   help="relaunching the job after a failure, before the restore (assumed)")
    p.add_argument("--json", metavar="PATH", help="write assumptions and projection as JSON")
    a = p.parse_args(argv)

    m = measured_figures(a.results)
    sources = {}
    if a.upload_gbps_per_process is None:
        if "upload_gbps" not in m:
            p.error("no measured upload rate: run benchmarks/stall.py or train_loop.py first, "
                    "or pass --upload-gbps-per-process")
        a.upload_gbps_per_process = m["upload_gbps"]
        sources["upload_gbps_per_process"] = m["upload_source"]
    if a.overhead_s is None:
        a.overhead_s = m.get("overhead_s", 0.0)
        if "stall_source" in m:
            sources["overhead_s"] = m["stall_source"]
    r = project(a)
    restore_measured = measured_restore(a.results)

    print("Assumptions and inputs")
    rows = [
        ("nodes x GPUs per node", f"{a.nodes} x {a.gpus_per_node} = {r['gpus']} ranks"),
        ("checkpoint", f"{a.checkpoint_gb:g} GB every {a.every_steps} steps of {a.step_s:g} s"
                       f" (interval {r['interval_s']:.0f} s)"),
        ("device-to-host bandwidth per GPU", f"{a.d2h_gbps:g} GB/s (assumed)"),
        ("NIC per node", f"{a.nic_gbps:g} Gbit/s (assumed)"),
        ("upload rate per process", f"{a.upload_gbps_per_process:.3f} GB/s "
                                    f"({'measured: ' + sources['upload_gbps_per_process'] if 'upload_gbps_per_process' in sources else 'given'})"),
        ("staging overhead per checkpoint", f"{a.overhead_s:.3f} s "
                                            f"({'measured: ' + sources['overhead_s'] if 'overhead_s' in sources else 'given'})"),
        ("part size / object size", f"{a.part_size_mib:g} MiB / {a.object_size_mib:g} MiB"),
        ("prefixes", f"{a.prefixes} (S3 limit ~{a.prefix_limit:.0f} PUT/s each)"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k.ljust(width)}  {v}")
    print("\nProjection")
    out = [
        ("shard per GPU / data per node", f"{r['shard_gb']:.2f} GB / {r['node_gb']:.2f} GB"),
        ("stall per checkpoint", f"{r['stall_s']:.2f} s  (copy {r['stall_copy_s']:.3f} s + overhead "
                                 f"{a.overhead_s:.3f} s + back-pressure {r['backpressure_s']:.1f} s)"
                                 f"  -> goal < {a.goal_s:g} s: {'met' if r['goal_met'] else 'NOT met'}"),
        ("upload per node (background)", f"{r['upload_s']:.1f} s at {r['node_upload_gbps']:.2f} GB/s"
                                         f" ({'fits in' if r['backpressure_s'] == 0 else 'exceeds'} the interval)"),
        ("requests", f"{r['parts']} parts in {r['objects']} objects, {r['requests']} PUT/POST in all"),
        ("request rate per prefix", f"{r['put_rate_per_prefix']:.0f}/s -> "
                                    f"{'under' if r['prefix_limit_ok'] else 'OVER'} the limit"),
        ("time stalled", f"{100 * r['stalled_fraction']:.3f}% (the monolithic baseline: "
                         f"{100 * r['baseline_stalled_fraction']:.1f}%)"),
    ]
    width = max(len(k) for k, _ in out)
    for k, v in out:
        print(f"  {k.ljust(width)}  {v}")
    if not r["prefix_limit_ok"]:
        need = -(-int(r["put_rate_per_prefix"] * a.prefixes) // int(a.prefix_limit))
        print(f"\n  spread the objects over >= {need} prefixes to stay under S3's per-prefix rate: "
              f"S3Config(key_prefix_spread={need})")
    restore = print_restore(a, sources)
    restart = print_restart(a)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"assumptions": vars(a), "sources": sources, "projection": r, "restore": restore,
                       "restore_measured": restore_measured, "restart": restart}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
