"""The ``s3dcp`` command line: the argparse tree (every command, its arguments and help) and the
argument types (durations, sizes). Parsing only: each command's ``run`` is a function of the
module that does the work; a refused command line raises :class:`CommandLineError`.
"""

from __future__ import annotations

import argparse
import re
from typing import Callable

from .._version import __version__
from ..interop.export_defaults import DEFAULT_SHARD_SIZE_BYTES, DEFAULT_WINDOW_BYTES
from ..localserver import DEFAULT_BUCKET
from .browse import cmd_inspect, cmd_ls
from .cleanup import cmd_gc, cmd_materialize, cmd_rm
from .common import UsageError
from .export import cmd_export
from .server import cmd_mb, cmd_server
from .verify import cmd_download, cmd_verify

__all__ = ["CommandLineError", "build_parser", "parse_duration", "parse_size"]

_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


class CommandLineError(UsageError):
    """argparse refused the command line; ``parser`` is the (sub)parser whose usage applies."""

    def __init__(self, parser: argparse.ArgumentParser, message: str) -> None:
        super().__init__(message)
        self.parser = parser


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser that raises instead of exiting, so main() can answer in JSON."""

    def error(self, message: str):
        raise CommandLineError(self, message)


def build_parser() -> argparse.ArgumentParser:
    """The whole ``s3dcp`` parser; ``args.run(args)`` runs the command it parsed."""
    common = _Parser(add_help=False)
    common.add_argument("--endpoint-url", default=argparse.SUPPRESS, metavar="URL",
                        help="S3 endpoint (default: AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL / the profile / AWS)")
    common.add_argument("--region", default=argparse.SUPPRESS, help="S3 region (default: AWS_REGION / the profile)")
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="print tracebacks of errors")

    parser = _Parser(
        prog="s3dcp", description="Inspect, verify, copy out and clean up PyTorch DCP checkpoints in S3.",
        epilog="Exit status: 0 ok, 1 the operation failed, 2 usage error. "
               "Credentials come from the usual AWS environment (variables, profile, instance role).")
    parser.add_argument("--version", action="version", version=f"s3dcp {__version__}")
    parser.add_argument("--endpoint-url", default=None, metavar="URL",
                        help="S3 endpoint (default: AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL / the profile / AWS); "
                             "also accepted after the command")
    parser.add_argument("--region", default=None, help="S3 region (default: AWS_REGION / the profile)")
    parser.add_argument("--debug", action="store_true", help="print tracebacks of errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def command(name: str, run: Callable, help: str, s3: bool = True) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=[common] if s3 else [], help=help, description=help)
        if not s3:
            p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="print tracebacks of errors")
        p.set_defaults(run=run)
        return p

    p = command("ls", cmd_ls, "list the checkpoints below a prefix (directories holding .metadata or .distcp objects)")
    p.add_argument("uri", help="s3://bucket/prefix")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--local-dir", metavar="D", help="also this node's copies in D (a CheckpointManager's local_dir) "
                   "of the runs below the prefix, and the step a restart would take")

    p = command("inspect", cmd_inspect, "show a checkpoint's contents from its metadata alone")
    p.add_argument("uri", help="s3://bucket/prefix/checkpoint")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--local-dir", metavar="D", help="where S3 holds no .metadata of it: the one of a copy in D")

    p = command("verify", cmd_verify, "download every item and check its checksum (exit 1 if any is bad or has none)")
    p.add_argument("uri", help="s3://bucket/prefix/checkpoint")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument("--local-dir", metavar="D", help="check this node's copies of it in D instead of S3's objects "
                   "(against S3's metadata where S3 committed it, else each copy's own)")

    p = command("rm", cmd_rm, "delete a checkpoint (its .metadata first, then its data objects)")
    p.add_argument("uri", help="s3://bucket/prefix/checkpoint")
    p.add_argument("-y", "--yes", action="store_true", help="required to delete a committed checkpoint")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")

    p = command("materialize", cmd_materialize,
                "copy every object an incremental checkpoint references into it (server-side), so it stands alone")
    p.add_argument("uri", help="s3://bucket/prefix/checkpoint")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = command("gc", cmd_gc, "delete leftovers of failed saves and abort stale multipart uploads")
    p.add_argument("uri", help="s3://bucket/prefix (every checkpoint below it is examined)")
    p.add_argument("--older-than", type=_duration_arg, default=3600.0, metavar="AGE",
                   help="only leftovers older than this: 30s, 10m, 1h, 2d, 1h30m (default: 1h)")
    p.add_argument("--dry-run", action="store_true", help="report what would go; delete nothing")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = command("download", cmd_download, "convert a checkpoint into one torch.save file")
    p.add_argument("uri", help="s3://bucket/prefix/checkpoint")
    p.add_argument("--to-torch-save", required=True, metavar="FILE", help="the file to write")
    p.add_argument("-f", "--force", action="store_true", help="replace FILE if it exists")
    p.add_argument("--allow-pickle", action="store_true",
                   help="unpickle non-tensor items without torch.load's weights_only safety (only for "
                        "checkpoints you trust: unpickling can run code)")
    p.add_argument("--json", action="store_true", help="print JSON")

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

    p = command("mb", cmd_mb, "create a bucket (in the region of --region / AWS_REGION on AWS)")
    p.add_argument("uri", help="s3://bucket")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = command("server", cmd_server,
                "run a local S3 server (SeaweedFS) on 127.0.0.1 that creates s3://demo, until Ctrl-C", s3=False)
    p.epilog = ('In another shell, eval "$(s3dcp server --print-env)" points AWS SDKs and s3dcp at it '
                "(and starts one in the background when none runs); s3dcp server --stop stops it. With several "
                "servers running, --print-env and --stop name the newest (the one before it once it stops); "
                "s3dcp server --list shows them all.")
    action = p.add_mutually_exclusive_group()
    action.add_argument("--print-env", action="store_true",
                        help="print export lines for the running server (start one in the background if none "
                             "runs) and exit: eval \"$(s3dcp server --print-env)\"")
    action.add_argument("--stop", action="store_true", help="stop the server that --print-env names")
    action.add_argument("--list", action="store_true",
                        help="list every running s3dcp server (* marks the one --print-env and --stop name)")
    p.add_argument("--pid", type=int, metavar="PID",
                   help="with --print-env or --stop: that server (from --list), not the newest")
    p.add_argument("--all", action="store_true", help="with --stop: stop every running s3dcp server")
    p.add_argument("--json", action="store_true", help="with --list: print JSON")
    p.add_argument("--bucket", action="append", default=None, metavar="NAME",
                   help=f"create this bucket (repeatable; default: {DEFAULT_BUCKET}); with --print-env also on a "
                        "server that runs already")
    p.add_argument("--no-bucket", action="store_true", help="create no bucket")
    p.add_argument("--dir", metavar="D", help="data directory to use and keep (default: temporary)")
    p.add_argument("--port", type=int, metavar="P", help="S3 port (default: a free one)")
    p.add_argument("--access-key", default="s3dcp-local", help="the one access key (default: s3dcp-local)")
    p.add_argument("--secret-key", help="its secret (default: $S3DCP_SERVER_SECRET_KEY, else a random one; "
                   "the variable keeps it off the command line, which every local user can read)")
    return parser


def parse_duration(text: str) -> float:
    """``"90"``, ``"30s"``, ``"10m"``, ``"1h"``, ``"2d"``, ``"1w"``, ``"1h30m"`` -> seconds."""
    value = text.strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", value):
        return float(value)
    parts = re.findall(r"(\d+(?:\.\d+)?)([smhdw])", value)
    if not parts or "".join(n + u for n, u in parts) != value:
        raise ValueError(f"invalid duration {text!r}: use a number with a unit, like 30s, 10m, 1h, 2d")
    return sum(float(n) * _DURATION_UNITS[u] for n, u in parts)


def _duration_arg(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


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
