"""Client CPU of one 512 MiB upload and one ranged read, each way s3dcp can move it, in one run.

    python benchmarks/transport_cpu.py                       # 512 MiB, 3 interleaved repeats, 12 s apart
    python benchmarks/transport_cpu.py --size-mib 1024 --gap-s 5 --repeats 5

Uploads, all through S3Client (the product's own calls):

    crt-memory        put() of the bytes in memory: the CRT's PUT reading a stream over them
                      (what small objects and .metadata take; what data objects took before slabs)
    crt-file          put_file(stream_parts=False) of a shared-memory slab holding the bytes: the
                      CRT reads each part from the file into a buffer of its pool
    crt-file-stream   put_file() of the slab: the CRT streams each part from the file straight into
                      its requests (S3FileIoOptions(should_stream=True)): what a save does
    sockets           put() with S3Config(transport="sockets"): each part sent from the memory over
                      s3dcp's own connections (the opt-in transport)

Reads: get_range_into() of the object into a tensor, through the CRT (``download_part_size_bytes``
8 MiB, the default, and 4 MiB) and over sockets. Every read is checked equal to what was uploaded.

Each transfer waits ``--gap-s`` first, as a job waits between checkpoints (long enough for the
CRT to trim its part buffers, as it does in a job). Around each the process's ``getrusage`` gives
user and system CPU seconds and minor page faults (every thread of the process; the server is
another process). Printed: medians, per GiB, and each row's ratio to the product's path
(crt-file-stream for uploads, crt 8 MiB for reads).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (  # noqa: E402
    MiB, add_common_args, environment_info, median, print_table, results_path, s3_target, unique_prefix,
    write_json,
)

UPLOADS = ("crt-memory", "crt-file", "crt-file-stream", "sockets")
READS = ("crt", "crt-4mib", "sockets")
PRODUCT = {"upload": "crt-file-stream", "read": "crt"}


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

    from s3dcp.memory.slabs import Slab
    from s3dcp.s3.client import S3Client

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=512, help="bytes per upload (default 512)")
    parser.add_argument("--gap-s", type=float, default=12.0, help="seconds between transfers (default 12)")
    add_common_args(parser, repeats=3)
    args = parser.parse_args(argv)

    n = args.size_mib * MiB
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    slab = Slab(n, pinned=False)
    slab.buffer.copy_(data)
    out = torch.empty_like(data)
    view, out_view = memoryview(data.numpy()), memoryview(out.numpy())
    results: dict[tuple[str, str], list[dict]] = {}
    with s3_target(args) as target:
        crt = S3Client(replace(target.config, transport="crt"))
        crt4 = S3Client(replace(target.config, transport="crt", download_part_size_bytes=4 * MiB))
        sockets = S3Client(replace(target.config, transport="sockets"))
        prefix = unique_prefix(target, "transport-cpu")
        uploads = {
            "crt-memory": lambda key: crt.put(target.bucket, key, view).result(),
            "crt-file": lambda key: crt.put_file(target.bucket, key, slab.path, n, keep=slab,
                                                 stream_parts=False).result(),
            "crt-file-stream": lambda key: crt.put_file(target.bucket, key, slab.path, n, keep=slab).result(),
            "sockets": lambda key: sockets.put(target.bucket, key, view).result(),
        }
        reads = {
            "crt": lambda key: crt.get_range_into(target.bucket, key, 0, out_view).result(),
            "crt-4mib": lambda key: crt4.get_range_into(target.bucket, key, 0, out_view).result(),
            "sockets": lambda key: sockets.get_range_into(target.bucket, key, 0, out_view).result(),
        }
        for client in (crt, crt4, sockets):  # warm: connections and threads, not measured
            client.put(target.bucket, f"{prefix}/warm", view[:8 * MiB]).result()
            client.get_range_into(target.bucket, f"{prefix}/warm", 0, out_view[:8 * MiB]).result()
        for r in range(args.repeats):
            for way, upload in uploads.items():
                time.sleep(args.gap_s)
                results.setdefault(("upload", way), []).append(timed(lambda: upload(f"{prefix}/{way}-{r}")))
            for way, read in reads.items():
                out.zero_()
                time.sleep(args.gap_s)
                results.setdefault(("read", way), []).append(timed(lambda: read(f"{prefix}/crt-file-stream-{r}")))
                if not torch.equal(out, data):
                    raise SystemExit(f"error: the {way} read differs from what was uploaded")
        for client in (crt, crt4, sockets):
            client.close()
    gib = n / 2**30
    rows = []
    for (op, way), trials in results.items():
        row = {"op": op, "way": way, **{k: median(m[k] for m in trials) for k in trials[0]}}
        row["cpu_per_gib"] = row["cpu_s"] / gib
        row["gbps"] = n / row["wall_s"] / 1e9
        rows.append(row)
    for row in rows:
        product = next(r for r in rows if r["op"] == row["op"] and r["way"] == PRODUCT[row["op"]])
        row["cpu_x_product"] = row["cpu_s"] / product["cpu_s"]
        row["wall_x_product"] = row["wall_s"] / product["wall_s"]
    print_table(rows, [("op", "op"), ("way", "way"), ("wall_s", "wall s", ".2f"), ("gbps", "GB/s", ".2f"),
                       ("user_s", "user s", ".2f"), ("sys_s", "sys s", ".2f"), ("cpu_s", "CPU s", ".2f"),
                       ("cpu_per_gib", "CPU s/GiB", ".2f"), ("minor_faults", "minor faults", ".0f"),
                       ("cpu_x_product", "CPU x product", ".2f"), ("wall_x_product", "wall x product", ".2f")],
                title=f"one {args.size_mib} MiB transfer, {args.gap_s:g} s apart, medians of {args.repeats} "
                      f"(product: upload {PRODUCT['upload']}, read {PRODUCT['read']})")
    path = write_json(results_path(args, "transport_cpu"), {
        "benchmark": "transport_cpu", "environment": environment_info(), "target": target.describe(),
        "settings": {k: v for k, v in vars(args).items() if k != "endpoint"}, "rows": rows,
        "trials": {f"{op}/{way}": v for (op, way), v in results.items()}})
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
