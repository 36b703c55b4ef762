"""``s3dcp export``: runs :func:`s3dcp.interop.export.export_safetensors` with a progress bar and prints
its report (the command's arguments are in :mod:`s3dcp.cli.parser`).

Importing this module is cheap (no torch): the CLI imports it for every command.
"""

from __future__ import annotations

import sys

from .common import s3_client
from .output import print_json

__all__ = ["cmd_export"]


def cmd_export(args) -> int:
    from ..errors import CheckpointExistsError
    from ..format.safetensors import INDEX_NAME
    from ..interop.export import export_safetensors

    client = s3_client(args)
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
    except CheckpointExistsError as e:  # its message names the library's overwrite=True
        raise CheckpointExistsError(f"{args.to_safetensors} already holds a safetensors export; pass --force to "
                                    "replace it (its index and *.safetensors files are deleted first)") from e
    finally:
        if bar is not None:
            bar.close()
    if args.json:
        print_json(report.__dict__)
    else:
        unverified = f", {report.unverified_chunks} chunk(s) without checksum" if report.unverified_chunks else ""
        print(f"exported {report.tensors} tensor(s), {report.tensor_bytes} bytes, from {report.source} to "
              f"{report.dest}: {len(report.files)} file(s) + {INDEX_NAME}; {report.verified_chunks} chunk(s) "
              f"verified{unverified}; {len(report.skipped)} item(s) left out; {report.seconds:.1f} s")
    return 0


def _progress_bar(quiet: bool):
    """A tqdm bar (bytes) on stderr when it is a terminal and tqdm is installed, else None."""
    if quiet or not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr, leave=False, desc="export")
