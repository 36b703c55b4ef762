"""Client CPU of one multipart upload: s3dcp's sockets against the CRT's PUT, measured in one run.

    python benchmarks/upload_cpu.py                       # 512 MiB, 3 interleaved repeats, 12 s apart
    python benchmarks/upload_cpu.py --size-mib 1024 --gap-s 5 --repeats 5

One process uploads the same buffer with ``S3Config(put_transport="sockets")`` (the default)
and ``put_transport="crt"``, interleaved, waiting ``--gap-s`` between uploads as a job waits
between checkpoints (long enough for the CRT to trim its part buffers, as it does in a job).
Around each upload the process's ``getrusage`` gives user and system CPU seconds and minor page
faults (every thread of the process; the server is another process). Printed: medians per
upload and per GiB, and the sockets/CRT ratios of this run.
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


def upload_once(client, bucket: str, key: str, data) -> dict:
    user0, sys0, faults0 = _usage()
    t0 = time.perf_counter()
    client.put(bucket, key, data).result()
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
    view = memoryview(data.numpy())
    results: dict[str, list[dict]] = {t: [] for t in TRANSPORTS}
    with s3_target(args) as target:
        clients = {t: S3Client(replace(target.config, put_transport=t)) for t in TRANSPORTS}
        prefix = unique_prefix(target, "upload-cpu")
        for t in TRANSPORTS:  # warm: connections and threads, not measured
            clients[t].put(target.bucket, f"{prefix}/warm-{t}", view[:8 * MiB]).result()
        for r in range(args.repeats):
            for t in TRANSPORTS:
                time.sleep(args.gap_s)
                results[t].append(upload_once(clients[t], target.bucket, f"{prefix}/{t}-{r}", view))
        for client in clients.values():
            client.close()
    gib = args.size_mib / 1024
    rows = []
    for t in TRANSPORTS:
        row = {"transport": t, **{k: median(m[k] for m in results[t]) for k in results[t][0]}}
        row["cpu_per_gib"] = row["cpu_s"] / gib
        row["gbps"] = args.size_mib * MiB / row["wall_s"] / 1e9
        rows.append(row)
    ours, crt = rows
    ours["cpu_vs_crt"] = ours["cpu_s"] / crt["cpu_s"]
    ours["wall_vs_crt"] = ours["wall_s"] / crt["wall_s"]
    print_table(rows, [("transport", "put_transport"), ("wall_s", "wall s", ".2f"), ("gbps", "GB/s", ".2f"),
                       ("user_s", "user s", ".2f"), ("sys_s", "sys s", ".2f"), ("cpu_s", "CPU s", ".2f"),
                       ("cpu_per_gib", "CPU s/GiB", ".2f"), ("minor_faults", "minor faults", ".0f"),
                       ("cpu_vs_crt", "CPU x crt", ".2f"), ("wall_vs_crt", "wall x crt", ".2f")],
                title=f"one {args.size_mib} MiB upload, {args.gap_s:g} s apart, medians of {args.repeats}")
    path = write_json(results_path(args, "upload_cpu"), {
        "benchmark": "upload_cpu", "environment": environment_info(), "target": target.describe(),
        "settings": {k: v for k, v in vars(args).items() if k != "endpoint"}, "rows": rows,
        "trials": results})
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
