"""``s3dcp export``: the command line of :mod:`s3dcp.interop.export` (argument parsing and output only).

Importing this module is cheap (no torch): the CLI builds its parser for every command.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any, Callable

from ..interop.export_defaults import DEFAULT_SHARD_SIZE_BYTES, DEFAULT_WINDOW_BYTES

__all__ = ["register_cli", "cmd_export", "parse_size"]

INDEX_NAME = "model.safetensors.index.json"


def register_cli(command: Callable[..., Any]) -> None:
    """Add ``s3dcp export`` to the CLI (``command`` is cli.py's subcommand maker)."""
    p = command("export", cmd_export, "write a checkpoint's tensors as Hugging Face sharded safetensors")
    p.add_argument("uri", help="s3://bucket/prefix/checkpoint")
    p.add_argument("--to-safetensors", required=True, metavar="DEST",
                   help="a local directory or an s3://bucket/prefix to write the files to")
    p.add_argument("--shard-size", type=_size_arg, default=DEFAULT_SHARD_SIZE_BYTES, metavar="SIZE",
                   help="largest shard file: 5GB (default), 500MB, 2GiB, bytes")
    p.add_argument("--only", action="append", default=[], metavar="PREFIX",
                   help="export only tensors whose name starts with PREFIX (repeatable), e.g. model.")
    p.add_argument("--strip-prefix", metavar="PREFIX", help="drop PREFIX from the names written, e.g. model.")
    p.add_argument("--window", type=_size_arg, default=DEFAULT_WINDOW_BYTES, metavar="SIZE",
                   help="tensor bytes downloading ahead of the writer (default 256MiB)")
    p.add_argument("-f", "--force", action="store_true",
                   help="replace an export already at DEST (its index and *.safetensors files are deleted first)")
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


def cmd_export(args) -> int:
    from ..s3.client import S3Client
    from ..config import S3Config
    from ..interop.export import export_safetensors

    client = S3Client(S3Config(endpoint_url=args.endpoint_url, region=args.region))
    bar = _progress_bar(args.quiet or args.json)

    def progress(done: int, total: int) -> None:
        bar.total = total
        bar.n = done
        bar.refresh()

    try:
        report = export_safetensors(
            args.uri, args.to_safetensors, shard_size_bytes=args.shard_size, only=args.only,
            strip_prefix=args.strip_prefix, client=client, window_bytes=args.window, overwrite=args.force,
            on_progress=progress if bar is not None else None)
    finally:
        if bar is not None:
            bar.close()
    if args.json:
        json.dump(report.__dict__, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        unverified = f", {report.unverified_chunks} chunk(s) without checksum" if report.unverified_chunks else ""
        print(f"exported {report.tensors} tensor(s), {report.tensor_bytes} bytes, from {report.source} to "
              f"{report.dest}: {len(report.files)} file(s) + {INDEX_NAME}; {report.verified_chunks} chunk(s) "
              f"verified{unverified}; {len(report.skipped)} item(s) left out; {report.seconds:.1f} s")
    return 0


_UNITS = {"": 1, "b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5e9, ``"512MiB"`` -> 512×2²⁰, ``"1000"`` -> 1000 (Hugging Face's units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"invalid size {text!r}: use a number with a unit, like 5GB, 500MB, 2GiB")
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise ValueError(f"invalid size {text!r}: must be positive")
    return value


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _progress_bar(quiet: bool):
    """A tqdm bar (bytes) on stderr when it is a terminal and tqdm is installed, else None."""
    if quiet or not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr, leave=False, desc="export")
