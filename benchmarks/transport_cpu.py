"""Client CPU of one multipart upload and one ranged read: s3dcp's sockets against the CRT, in one run.

    python benchmarks/transport_cpu.py                       # 512 MiB, 3 interleaved repeats, 12 s apart
    python benchmarks/transport_cpu.py --size-mib 1024 --gap-s 5 --repeats 5

One process uploads the same tensor, then reads it back into another, with
``S3Config(transport="sockets")`` (the default) and ``transport="crt"``, interleaved, waiting
``--gap-s`` before each transfer as a job waits between checkpoints (long enough for the CRT to
trim its part buffers, as it does in a job). Around each transfer the process's ``getrusage``
gives user and system CPU seconds and minor page faults (every thread of the process; the
server is another process). Printed: medians per transfer and per GiB, and the sockets/CRT
ratios of this run; every read is checked equal to what was uploaded.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (  # noqa: E402
    MiB, add_common_args, environment_info, median, print_table, results_path, s3_target, unique_prefix,
    write_json,
)

TRANSPORTS = ("sockets", "crt")


def _usage() -> tuple[float, float, int]:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime, u.ru_stime, u.ru_minflt


def timed(fn) -> dict:
    user0, sys0, faults0 = _usage()
    t0 = time.perf_counter()
    fn()
    wall = time.perf_counter() - t0
    user1, sys1, faults1 = _usage()
    return {"wall_s": wall, "user_s": user1 - user0, "sys_s": sys1 - sys0, "cpu_s": user1 - user0 + sys1 - sys0,
            "minor_faults": faults1 - faults0}


def main(argv=None) -> int:
    import torch
    from dataclasses import replace

    from s3dcp.s3.client import S3Client

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=512, help="bytes per upload (default 512)")
    parser.add_argument("--gap-s", type=float, default=12.0, help="seconds between uploads (default 12)")
    add_common_args(parser, repeats=3)
    args = parser.parse_args(argv)

    data = torch.randint(0, 256, (args.size_mib * MiB,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    out = torch.empty_like(data)
    view, out_view = memoryview(data.numpy()), memoryview(out.numpy())
    results: dict[tuple[str, str], list[dict]] = {}
    with s3_target(args) as target:
        clients = {t: S3Client(replace(target.config, transport=t)) for t in TRANSPORTS}
        prefix = unique_prefix(target, "transport-cpu")
        for t in TRANSPORTS:  # warm: connections and threads, not measured
            clients[t].put(target.bucket, f"{prefix}/warm-{t}", view[:8 * MiB]).result()
            clients[t].get_range_into(target.bucket, f"{prefix}/warm-{t}", 0, out_view[:8 * MiB]).result()
        for r in range(args.repeats):
            for t in TRANSPORTS:
                key = f"{prefix}/{t}-{r}"
                time.sleep(args.gap_s)
                results.setdefault(("upload", t), []).append(
                    timed(lambda: clients[t].put(target.bucket, key, view).result()))
                out.zero_()
                time.sleep(args.gap_s)
                results.setdefault(("read", t), []).append(
                    timed(lambda: clients[t].get_range_into(target.bucket, key, 0, out_view).result()))
                if not torch.equal(out, data):
                    raise SystemExit(f"error: the {t} read of {key} differs from what was uploaded")
        for client in clients.values():
            client.close()
    gib = args.size_mib / 1024
    rows = []
    for (op, t), trials in results.items():
        row = {"op": op, "transport": t, **{k: median(m[k] for m in trials) for k in trials[0]}}
        row["cpu_per_gib"] = row["cpu_s"] / gib
        row["gbps"] = args.size_mib * MiB / row["wall_s"] / 1e9
        rows.append(row)
    for op in ("upload", "read"):
        ours, crt = (next(r for r in rows if r["op"] == op and r["transport"] == t) for t in TRANSPORTS)
        ours["cpu_vs_crt"] = ours["cpu_s"] / crt["cpu_s"]
        ours["wall_vs_crt"] = ours["wall_s"] / crt["wall_s"]
    print_table(rows, [("op", "op"), ("transport", "transport"), ("wall_s", "wall s", ".2f"), ("gbps", "GB/s", ".2f"),
                       ("user_s", "user s", ".2f"), ("sys_s", "sys s", ".2f"), ("cpu_s", "CPU s", ".2f"),
                       ("cpu_per_gib", "CPU s/GiB", ".2f"), ("minor_faults", "minor faults", ".0f"),
                       ("cpu_vs_crt", "CPU x crt", ".2f"), ("wall_vs_crt", "wall x crt", ".2f")],
                title=f"one {args.size_mib} MiB transfer, {args.gap_s:g} s apart, medians of {args.repeats}")
    path = write_json(results_path(args, "transport_cpu"), {
        "benchmark": "transport_cpu", "environment": environment_info(), "target": target.describe(),
        "settings": {k: v for k, v in vars(args).items() if k != "endpoint"}, "rows": rows,
        "trials": {f"{op}/{t}": v for (op, t), v in results.items()}})
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
