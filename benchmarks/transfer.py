"""Upload and download of one N MiB object: s3dcp's S3Client (awscrt) vs boto3 (s3transfer).

    python benchmarks/transfer.py                        # 256 MiB, 3 repeats, embedded SeaweedFS
    python benchmarks/transfer.py --size-mib 32 --repeats 1
    python benchmarks/transfer.py --endpoint http://127.0.0.1:9000 --bucket b --server-pid 1234

s3dcp: ``S3Client.put`` straight from a bytearray, ``get_range_into`` a preallocated bytearray.
boto3: ``upload_fileobj`` / ``download_fileobj`` over file objects that read from / write into the
same buffers, with a TransferConfig of the same part size and ``--boto3-concurrency`` threads.
Before timing, each method uploads, downloads into a zeroed buffer and compares the bytes
(untimed), so a method that moves wrong bytes fails instead of looking fast. The timed cases then
run interleaved (s3dcp put, s3dcp get, boto3 put, boto3 get, and again); medians are reported.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (  # noqa: E402
    MiB,
    add_common_args,
    environment_info,
    interleaved,
    print_table,
    results_path,
    s3_target,
    summarize,
    write_json,
)

from s3dcp.s3.streams import BufferStream  # noqa: E402 - what S3Client.put reads from, for boto3 too


class _WriteView(io.RawIOBase):
    """A seekable write-only file over a preallocated buffer: s3transfer seeks to each part's
    offset and writes it, so bytes land in place, as with ``get_range_into``."""

    def __init__(self, buf) -> None:
        super().__init__()
        self._view = memoryview(buf).cast("B")
        self._pos = 0
        self._lock = threading.Lock()

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._view.nbytes}[whence]
        self._pos = base + offset
        return self._pos

    def write(self, b) -> int:
        data = memoryview(b).cast("B")
        with self._lock:
            end = self._pos + data.nbytes
            if end > self._view.nbytes:
                raise ValueError(f"download wrote past the end of the buffer ({end} > {self._view.nbytes})")
            self._view[self._pos:end] = data
            self._pos = end
        return data.nbytes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="Upload/download of one object: s3dcp S3Client (awscrt) vs boto3 upload_fileobj/"
                    "download_fileobj (s3transfer), against an embedded SeaweedFS server by default.")
    parser.add_argument("--size-mib", type=int, default=256, metavar="N", help="object size (default 256)")
    parser.add_argument("--part-mib", type=int, default=16, metavar="N",
                        help="part size for both methods (multipart threshold too; default 16)")
    parser.add_argument("--boto3-concurrency", type=int, default=10, metavar="N",
                        help="s3transfer max_concurrency (default 10)")
    parser.add_argument("--s3dcp-concurrency", type=int, default=None, metavar="N",
                        help="S3Config.max_concurrency (default: S3Config's default)")
    parser.add_argument("--methods", nargs="+", choices=("s3dcp", "boto3"), default=["s3dcp", "boto3"])
    add_common_args(parser, repeats=3)
    args = parser.parse_args(argv)

    import random

    from boto3.s3.transfer import TransferConfig

    nbytes = args.size_mib * MiB
    part = args.part_mib * MiB
    print(f"# transfer: {args.size_mib} MiB object, {args.part_mib} MiB parts, {args.repeats} repeat(s)", flush=True)
    source = bytearray(random.Random(1234).randbytes(nbytes))  # incompressible, reproducible
    dest = bytearray(nbytes)
    dest[:] = b"\x01" * nbytes  # fault the pages in now, not in the first timed download

    with s3_target(args) as target:
        changes = dict(part_size_bytes=part, multipart_threshold_bytes=part)
        if args.s3dcp_concurrency:
            changes["max_concurrency"] = args.s3dcp_concurrency
        cfg = target.config.replace(**changes)
        from s3dcp.s3.client import S3Client

        client = S3Client(cfg)
        boto = target.boto3_client(max_pool_connections=max(10, args.boto3_concurrency + 2))
        tcfg = TransferConfig(multipart_threshold=part, multipart_chunksize=part,
                              max_concurrency=args.boto3_concurrency, use_threads=True)
        prefix = target.prefix("transfer")
        keys = {m: f"{prefix}/{m}.bin" for m in ("s3dcp", "boto3")}

        def s3dcp_put():
            client.put(target.bucket, keys["s3dcp"], memoryview(source)).result()

        def s3dcp_get():
            client.get_range_into(target.bucket, keys["s3dcp"], 0, dest).result()

        def boto3_put():
            boto.upload_fileobj(BufferStream([source]), target.bucket, keys["boto3"], Config=tcfg)

        def boto3_get():
            boto.download_fileobj(target.bucket, keys["boto3"], _WriteView(dest), Config=tcfg)

        ops = {"s3dcp": (s3dcp_put, s3dcp_get), "boto3": (boto3_put, boto3_get)}
        # Untimed: every method's round trip must give back the very bytes (also warms up
        # connections and the server).
        for method in args.methods:
            put, get = ops[method]
            put()
            dest[:] = bytes(nbytes)
            get()
            if dest != source:
                diff = next(i for i, (a, b) in enumerate(zip(dest, source)) if a != b)
                raise SystemExit(f"error: {method} download differs from the upload at byte {diff}")
            print(f"# verified: {method} round trip of {nbytes} bytes is byte-exact", flush=True)

        def delete_key(key):
            def setup():  # a fresh key per upload, so SeaweedFS does not pile up overwritten data
                client.delete(target.bucket, [key]).result()
            return setup

        runs = {}
        for method in args.methods:
            put, get = ops[method]
            runs[f"{method}/put"] = (delete_key(keys[method]), put)
            runs[f"{method}/get"] = get

        def progress(name, r, m):
            srv = "-" if m.server_cpu_s is None else f"{m.server_cpu_s:.2f}"
            print(f"  rep {r}: {name:<10} {m.wall_s:7.3f} s  {nbytes / m.wall_s / 1e9:6.3f} GB/s  "
                  f"client cpu {m.cpu_s:6.2f} s  server cpu {srv} s", flush=True)

        results = interleaved(runs, args.repeats, server_pid=target.server_pid, progress=progress)
        client.delete(target.bucket, list(keys.values())).result()
        client.close()

    rows = []
    for name, ms in results.items():
        method, op = name.split("/")
        s = summarize(ms, nbytes)
        rows.append({"method": method, "op": op, **s, "cpu_s": [m.cpu_s for m in ms],
                     "server_cpu_s": [m.server_cpu_s for m in ms]})
    by = {(r["method"], r["op"]): r for r in rows}
    for r in rows:
        if r["method"] == "s3dcp" and ("boto3", r["op"]) in by:
            b = by[("boto3", r["op"])]
            r["speedup_vs_boto3"] = r["gbps"] / b["gbps"] if r["gbps"] and b["gbps"] else None
            r["cpu_ratio_vs_boto3"] = (r["cpu_s_per_gib"] / b["cpu_s_per_gib"]
                                       if r["cpu_s_per_gib"] and b["cpu_s_per_gib"] else None)
    print()
    print_table(rows, [("method", "method"), ("op", "op"), ("wall_s", "median s", ".3f"), ("gbps", "GB/s", ".3f"),
                       ("cpu_s_per_gib", "client CPU s/GiB", ".2f"),
                       ("server_cpu_s_per_gib", "server CPU s/GiB", ".2f"),
                       ("speedup_vs_boto3", "GB/s s3dcp/boto3", ".2f"),
                       ("cpu_ratio_vs_boto3", "CPU s3dcp/boto3", ".2f")],
                title=f"transfer: {args.size_mib} MiB, {args.part_mib} MiB parts, median of {args.repeats}")
    path = write_json(results_path(args, "transfer"), {
        "benchmark": "transfer",
        "params": {"size_mib": args.size_mib, "part_mib": args.part_mib, "repeats": args.repeats,
                   "boto3_concurrency": args.boto3_concurrency, "s3dcp_max_concurrency": cfg.max_concurrency,
                   "checksum": cfg.checksum, "methods": args.methods},
        "target": target.describe(),
        "environment": environment_info(),
        "results": rows,
        "units": {"gbps": "1e9 bytes/s", "cpu_s_per_gib": "CPU seconds per GiB (2^30 bytes)"},
    })
    print(f"# results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
