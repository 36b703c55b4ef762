"""The ``s3dcp`` command: look at, check, copy out and clean up checkpoints in S3.

    s3dcp ls s3://bucket/run/                 checkpoints below, committed or INCOMPLETE
    s3dcp inspect s3://bucket/run/step-1000   what the metadata says (no data is read)
    s3dcp verify s3://bucket/run/step-1000    read every item, check its checksum
    s3dcp rm s3://bucket/run/step-1000 --yes  delete (.metadata first; keeps what others reference)
    s3dcp materialize s3://bucket/run/step-2000   copy what an incremental checkpoint references into it
    s3dcp gc s3://bucket/run/ --older-than 1h remove leftovers of failed saves
    s3dcp download URI --to-torch-save out.pt one torch.save file
    s3dcp export URI --to-safetensors DIR     Hugging Face sharded safetensors (local or s3://)
    s3dcp mb s3://bucket                      create a bucket
    s3dcp server                              a local S3 server (creates s3://demo) for trying things out

S3 settings come from the environment as for the library (``AWS_ENDPOINT_URL_S3``,
``AWS_REGION``, credentials, profile), overridden by ``--endpoint-url`` and ``--region``.
Exit status: 0 ok, 1 the operation failed (bad checkpoint, bad items, S3 errors), 2 usage.
With ``--json`` an error is one JSON object on stderr: ``{"error": {"type", "message",
"exit_code", and the S3 request's "bucket", "key", "status", "code", "request_id"}}``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import traceback
from contextlib import suppress
from dataclasses import asdict
from typing import Any, Callable, Sequence
from urllib.parse import urlsplit

from .. import __version__
from ..format import integrity, layout
from ..config import S3Config
from ..errors import (
    AccessDeniedError,
    CheckpointNotFoundError,
    ConfigError,
    NoSuchBucketError,
    S3ConnectionError,
    S3DCPError,
    S3Error,
    UnsafePickleError,
    root_error,
)
from ..format.layout import METADATA_NAME, is_data_object, parse_object_name
from ..localserver import DEFAULT_BUCKET
from ..uri import S3Uri, object_key, parse_s3_uri

__all__ = ["main", "parse_duration"]

_READ_WINDOW = 4  # ranged GETs in flight while verifying, each at most one block
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


class UsageError(Exception):
    """A request the command refuses as asked (exit 2)."""


class _ArgumentError(UsageError):
    """argparse refused the command line; ``parser`` is the (sub)parser whose usage applies."""

    def __init__(self, parser: argparse.ArgumentParser, message: str) -> None:
        super().__init__(message)
        self.parser = parser


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser that raises instead of exiting, so main() can answer in JSON."""

    def error(self, message: str):
        raise _ArgumentError(self, message)


# ---------------------------------------------------------------------- entry point
def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); return the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    json_errors = "--json" in argv
    try:
        code = _main(argv, json_errors)
        sys.stdout.flush()  # here, not at exit: a closed pipe must reach the handler below
        return code
    except BrokenPipeError:
        # `s3dcp ls --json | head`: the reader left. Quietly, like other Unix tools; stdout goes
        # to /dev/null so the interpreter's final flush does not complain either.
        with suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a tool killed by a closed pipe


def _main(argv: list[str], json_errors: bool) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    except _ArgumentError as e:
        if json_errors:
            return _report_error(e, json_errors=True, debug=False)
        e.parser.print_usage(sys.stderr)
        print(f"{e.parser.prog}: error: {e}", file=sys.stderr)
        return 2
    if args.command is None:
        parser.print_usage(sys.stderr)
        print("s3dcp: error: a command is required (see s3dcp --help)", file=sys.stderr)
        return 2
    try:
        return args.run(args)
    except KeyboardInterrupt:
        print("s3dcp: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        raise
    except BaseException as e:  # noqa: BLE001 - one line per error, a traceback only on --debug
        if isinstance(e, SystemExit):
            raise
        return _report_error(e, json_errors=getattr(args, "json", False), debug=args.debug, args=args)


def _report_error(e: BaseException, *, json_errors: bool, debug: bool, args=None) -> int:
    """Print ``e`` as one line (or one JSON object) on stderr; return the exit status."""
    err = root_error(e)
    if debug:
        traceback.print_exception(type(e), e, e.__traceback__)
    if isinstance(err, (UsageError, ConfigError)):
        code, text = 2, str(err)
    elif isinstance(err, (S3DCPError, OSError)):
        code, text = 1, str(err)
        hint = _scheme_hint(err, args)
        if hint:
            text = f"{text}. {hint}"
        elif isinstance(err, NoSuchBucketError) and err.bucket:
            text = f"{text}; to create it: s3dcp mb s3://{err.bucket}"
    else:
        code, text = 1, f"internal error: {type(err).__name__}: {err} (run with --debug for the traceback)"
    text = " ".join(text.split())
    if json_errors:
        fields = {"type": "UsageError" if isinstance(err, UsageError) else type(err).__name__, "message": text, "exit_code": code}
        for name in ("operation", "bucket", "key", "status", "code", "request_id"):
            if getattr(err, name, None) is not None:
                fields[name] = getattr(err, name)
        json.dump({"error": fields}, sys.stderr)
        sys.stderr.write("\n")
    else:
        print(f"s3dcp: error: {text}", file=sys.stderr)
    return code


def _parser() -> argparse.ArgumentParser:
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

    p = command("inspect", cmd_inspect, "show a checkpoint's contents from its metadata alone")
    p.add_argument("uri", help="s3://bucket/prefix/checkpoint")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = command("verify", cmd_verify, "download every item and check its checksum (exit 1 if any is bad)")
    p.add_argument("uri", help="s3://bucket/prefix/checkpoint")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")

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

    from .export import register_cli as register_export  # s3dcp export (its own module)
    register_export(command)

    p = command("mb", cmd_mb, "create a bucket (in the region of --region / AWS_REGION on AWS)")
    p.add_argument("uri", help="s3://bucket")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = command("server", cmd_server,
                "run a local S3 server (SeaweedFS) on 127.0.0.1 that creates s3://demo, until Ctrl-C", s3=False)
    p.epilog = ('In another shell, eval "$(s3dcp server --print-env)" points AWS SDKs and s3dcp at it '
                "(and starts one in the background when none runs); s3dcp server --stop stops it.")
    action = p.add_mutually_exclusive_group()
    action.add_argument("--print-env", action="store_true",
                        help="print export lines for the running server (start one in the background if none "
                             "runs) and exit: eval \"$(s3dcp server --print-env)\"")
    action.add_argument("--stop", action="store_true", help="stop the server that --print-env names")
    p.add_argument("--bucket", action="append", default=None, metavar="NAME",
                   help=f"create this bucket (repeatable; default: {DEFAULT_BUCKET}); with --print-env also on a "
                        "server that runs already")
    p.add_argument("--no-bucket", action="store_true", help="create no bucket")
    p.add_argument("--dir", metavar="D", help="data directory to use and keep (default: temporary)")
    p.add_argument("--port", type=int, metavar="P", help="S3 port (default: a free one)")
    p.add_argument("--access-key", default="s3dcp-local", help="the one access key (default: s3dcp-local)")
    p.add_argument("--secret-key", help="its secret (default: a random one)")
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


def _client(args):
    from ..s3.client import S3Client

    return S3Client(S3Config(endpoint_url=args.endpoint_url, region=args.region))


# ---------------------------------------------------------------------- ls
def cmd_ls(args) -> int:
    from ..lifecycle.deletion import held_for_references
    from ..lifecycle.directories import scan_directories

    base = parse_s3_uri(args.uri)
    now = time.time()
    rows = []
    client = _client(args)
    by_dir = scan_directories(client, base)
    held = held_for_references(client, base.bucket, by_dir)  # deleted; objects kept for incremental ones
    for directory, objects in by_dir.items():
        if directory in held:
            continue
        names = {o.key.rpartition("/")[2] for o in objects}
        committed = METADATA_NAME in names
        if not committed and not any(is_data_object(n) for n in names):
            continue
        relative = directory[len(base.dir_prefix):].rstrip("/") if directory != base.dir_prefix else ""
        last = (relative or base.prefix).rpartition("/")[2]
        step = re.search(r"(\d+)$", last)
        stamps = [o.last_modified for o in objects if o.last_modified is not None]
        newest = max(stamps) if stamps else None
        run = relative.rpartition("/")[0]  # the checkpoint's parent, relative to the listed prefix
        rows.append({
            "name": relative or ".", "uri": str(base.child(relative)) if relative else str(base),
            "run": str(base.child(run)) if run else str(base),
            "step": int(step.group(1)) if step else None, "committed": committed,
            "bytes": sum(o.size for o in objects), "objects": len(objects),
            "last_modified": newest, "age_s": None if newest is None else max(0.0, now - newest),
        })
    rows.sort(key=lambda r: (r["run"], r["step"] is None, r["step"] or 0, r["name"]))
    if args.json:
        _print_json(rows)
        return 0
    if not rows:
        print(f"s3dcp: no checkpoints under {base}", file=sys.stderr)
        return 0
    runs: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        runs.setdefault(r["run"], []).append(r)
    header = ["NAME", "STEP", "SIZE", "OBJECTS", "STATE", "AGE"]
    headed = len(runs) > 1 or next(iter(runs)) != str(base)
    for i, (run, group) in enumerate(runs.items()):
        if headed:  # one table per run (the checkpoints' parent prefix)
            committed = [r for r in group if r["committed"] and r["step"] is not None]
            latest = f", latest committed step {max(r['step'] for r in committed)}" if committed else ""
            print(f"{'' if i == 0 else chr(10)}{run}/  ({len(group)} checkpoint(s), {_size(sum(r['bytes'] for r in group))}"
                  f"{latest})")
        cut = len(run) - len(str(base)) if run != str(base) else 0  # "a/" of "a/step-1"
        _table(header, [[r["name"][cut:], "-" if r["step"] is None else r["step"], _size(r["bytes"]), r["objects"],
                         "committed" if r["committed"] else "INCOMPLETE", _age(r["age_s"])] for r in group],
               indent=2 if headed else 0)
    return 0


# ---------------------------------------------------------------------- inspect
def cmd_inspect(args) -> int:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from ..format.references import sources
    from ..format.metadata import FORMAT_NAME, dtype_to_str, format_version_of
    from ..loading.reader import S3StorageReader

    uri = parse_s3_uri(args.uri)
    client = _client(args)
    md = S3StorageReader(str(uri), client=client).fetch_metadata()
    format_version = format_version_of(client.get(uri.bucket, uri.key(METADATA_NAME)).result())
    stored: dict[str, int] = {}
    objects: dict[str, dict[str, Any]] = {}
    for index, loc in md.storage_data.items():
        stored[index.fqn] = stored.get(index.fqn, 0) + loc.length
        parsed = parse_object_name(loc.object_name.rpartition("/")[2])
        obj = objects.setdefault(loc.object_name, {
            "object": loc.object_name, "rank": parsed.rank if parsed else None,
            "token": parsed.token if parsed else None, "items": 0, "bytes": 0})
        obj["items"] += 1
        obj["bytes"] = max(obj["bytes"], loc.offset + loc.length)
    tensors, others = [], []
    for fqn, item in md.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            tensors.append({"fqn": fqn, "dtype": dtype_to_str(item.properties.dtype), "shape": list(item.size),
                            "chunks": len(item.chunks), "bytes": stored.get(fqn, 0)})
        else:
            others.append({"fqn": fqn, "bytes": stored.get(fqn, 0)})
    sm = md.storage_meta
    report = {
        "uri": str(uri), "format": FORMAT_NAME, "format_version": format_version, "dcp_version": md.version,
        "save_id": sm.save_id if sm else None, "tensors": tensors, "non_tensors": others,
        "objects": sorted(objects.values(), key=lambda o: (o["rank"] is None, o["rank"] or 0, o["object"])),
        "total_bytes": sum(stored.values()),
        **sources(md.storage_data.values()),  # incremental: bytes written vs inherited per base
    }
    if args.json:
        _print_json(report)
        return 0
    extra = "".join(f", {label} {value}" for label, value in (("DCP", md.version), ("save", report["save_id"]))
                    if value)
    print(f"{uri}\n  format {FORMAT_NAME} v{format_version}{extra}")
    print(f"\ntensors: {len(tensors)}, {_size(sum(t['bytes'] for t in tensors))}")
    _table(["FQN", "DTYPE", "SHAPE", "CHUNKS", "BYTES"],
           [[t["fqn"], t["dtype"], "x".join(map(str, t["shape"])) or "scalar", t["chunks"], t["bytes"]]
            for t in tensors], indent=2)
    print(f"\nnon-tensor items: {len(others)}")
    _table(["FQN", "BYTES"], [[o["fqn"], o["bytes"]] for o in others], indent=2)
    print(f"\ndata objects: {len(objects)}")
    _table(["OBJECT", "RANK", "ITEMS", "BYTES"],
           [[o["object"], "-" if o["rank"] is None else o["rank"], o["items"], o["bytes"]]
            for o in report["objects"]], indent=2)
    if report["inherited"]:
        print("\nincremental: items stored here and referenced in bases")
        _table(["SOURCE", "ITEMS", "BYTES"],
               [["(written)", report["written"]["items"], report["written"]["bytes"]]]
               + [[f"../{d}", v["items"], v["bytes"]] for d, v in sorted(report["inherited"].items())], indent=2)
    print(f"\ntotal: {report['total_bytes']} bytes ({_size(report['total_bytes'])}) "
          f"in {len(md.storage_data)} item(s), {len(objects)} object(s)")
    return 0


# ---------------------------------------------------------------------- verify
def cmd_verify(args) -> int:
    from collections import deque

    from ..loading.reader import S3StorageReader

    uri = parse_s3_uri(args.uri)
    client = _client(args)
    md = S3StorageReader(str(uri), client=client).fetch_metadata()
    checks: list[_Verify] = []
    bad: list[dict[str, Any]] = []
    unchecked = 0
    segments: dict[str, list[layout.Segment]] = {}
    for index, loc in md.storage_data.items():
        if loc.checksum is None:
            unchecked += 1
            continue
        try:
            check = _Verify(index, integrity.ItemCheck(loc))
        except ValueError as e:
            bad.append(_bad(uri, index, loc, str(e)))
            continue
        checks.append(check)
        step = check.item.piece_bytes  # pieces line up with the block checksums
        for start in range(0, loc.length, step) if loc.length else [0]:
            segments.setdefault(loc.object_name, []).append(
                layout.Segment(loc.offset + start, min(step, loc.length - start), check))
    runs = [(name, run) for name, segs in sorted(segments.items())
            for run in layout.coalesce(segs, 0, integrity.BLOCK_SIZE_BYTES)]
    total = sum(seg.length for _, run in runs for seg in run)

    # A few ranged GETs in flight, handled in order so each item's pieces arrive in order;
    # memory stays at a few blocks whatever the object sizes.
    with _progress(total, "B", args.quiet) as bar:
        window: deque = deque()

        def finish_oldest() -> None:
            future, buf, start, run = window.popleft()
            _check_run(future, memoryview(buf), start, run)
            bar.update(sum(seg.length for seg in run))

        for name, run in runs:
            start, end = run[0].offset, max(seg.end for seg in run)
            buf = bytearray(end - start)
            window.append((client.get_range_into(uri.bucket, object_key(uri, name), start, buf), buf, start, run))
            if len(window) >= _READ_WINDOW:
                finish_oldest()
        while window:
            finish_oldest()
    bad += [_bad(uri, c.index, c.item.location, c.error or c.item.got, c.item.bad_blocks)
            for c in checks if c.error or not c.item.ok]
    nbytes = sum(c.item.location.length for c in checks)
    if args.json:
        _print_json({"uri": str(uri), "ok": not bad, "items": len(md.storage_data), "checked_items": len(checks),
                     "unchecked_items": unchecked, "bytes": nbytes, "bad": bad})
    else:
        for b in bad:
            where = f" (bad blocks {b['bad_blocks']})" if b["bad_blocks"] else ""
            print(f"BAD {b['fqn']}{_chunk(b['offset'])} in {b['object']} bytes {b['start']}-{b['end']}: "
                  f"expected {b['expected']}, got {b['got']}{where}")
        if not bad:
            note = f", {unchecked} without checksums (not checked)" if unchecked else ""
            print(f"OK: {len(checks)} item(s), {nbytes} bytes ({_size(nbytes)}) in "
                  f"{len({c.item.location.object_name for c in checks})} object(s) of {uri} verified{note}")
    if bad:
        print(f"s3dcp: error: {len(bad)} bad item(s) in {uri}; restore from another checkpoint", file=sys.stderr)
        return 1
    return 0


class _Verify:
    """One item under ``s3dcp verify``: its :class:`integrity.ItemCheck`, fed piece by piece
    in order, or why it could not be read."""

    def __init__(self, index, item: integrity.ItemCheck) -> None:
        self.index, self.item = index, item
        self.error: str | None = None


def _check_run(future, buf: memoryview, start: int, run: list) -> None:
    try:
        future.result()
    except S3DCPError as e:
        for seg in run:
            seg.tag.error = seg.tag.error or f"unreadable: {' '.join(str(e).split())}"
        return
    for seg in run:
        if seg.tag.error is None:
            seg.tag.item.feed(buf[seg.offset - start:seg.end - start])


def _bad(uri: S3Uri, index, loc, got: str, bad_blocks: Sequence[int] = ()) -> dict[str, Any]:
    return {"object": f"s3://{uri.bucket}/{object_key(uri, loc.object_name)}", "fqn": index.fqn,
            "offset": None if index.offset is None else list(index.offset),
            "start": loc.offset, "end": loc.offset + loc.length, "expected": loc.checksum, "got": got,
            "bad_blocks": list(bad_blocks)}


def _chunk(offset) -> str:
    return f" (chunk at {tuple(offset)})" if offset and any(offset) else ""


# ---------------------------------------------------------------------- rm
def cmd_rm(args) -> int:
    from ..lifecycle.manager import delete_checkpoint

    uri = parse_s3_uri(args.uri)
    client = _client(args)
    objects, _ = client.list(uri.bucket, uri.dir_prefix, delimiter="/").result()
    names = [o.key.rpartition("/")[2] for o in objects]
    committed = METADATA_NAME in names
    ours = [n for n in names if n == METADATA_NAME or is_data_object(n)]
    if not ours:
        raise CheckpointNotFoundError(f"no checkpoint at {uri} (no {METADATA_NAME} and no data objects)")
    if committed and not args.yes:
        raise UsageError(f"{uri} is a committed checkpoint ({len(ours)} object(s)); pass --yes to delete it")
    with _progress(len(ours), "obj", args.quiet or len(ours) < 100) as bar:
        result = delete_checkpoint(client, uri, on_deleted=bar.update)
    count, nbytes = result
    others = len(objects) - len(ours)
    if args.json:
        _print_json({"uri": str(uri), "deleted_objects": count, "deleted_bytes": nbytes, "was_committed": committed,
                     "other_objects_left": others, "kept_referenced": result.kept,
                     "kept_referenced_bytes": result.kept_bytes, "released": result.released})
    else:
        left = f"; {others} other object(s) left in place" if others else ""
        if result.kept:
            left += (f"; kept {len(result.kept)} object(s) ({_size(result.kept_bytes)}) that other checkpoints "
                     "reference (deleted with the last of them)")
        print(f"deleted {'committed' if committed else 'INCOMPLETE'} checkpoint {uri}: "
              f"{count} object(s), {_size(nbytes)}{left}")
    return 0


# ---------------------------------------------------------------------- materialize
def cmd_materialize(args) -> int:
    from ..lifecycle.materialize import materialize

    uri = parse_s3_uri(args.uri)
    result = materialize(str(uri), client=_client(args))
    if args.json:
        _print_json(asdict(result))
    elif result.items:
        print(f"materialized {uri}: {result.items} item(s) now in {result.copied_objects} copied object(s) "
              f"({_size(result.copied_bytes)}, server-side); {len(result.released)} unreferenced base object(s) freed")
    else:
        print(f"{uri} references no other checkpoint; nothing to do")
    return 0


# ---------------------------------------------------------------------- gc
def cmd_gc(args) -> int:
    from ..lifecycle.gc import gc

    uri = parse_s3_uri(args.uri)
    client = _client(args)
    report = gc(str(uri), older_than_s=args.older_than, client=client, dry_run=args.dry_run)
    skipped = _gc_skipped(uri, report, args.older_than)
    for key, upload_id in report.kept_recent_uploads:
        skipped.append({"prefix": f"s3://{uri.bucket}/{key}", "objects": None, "upload_id": upload_id,
                        "reason": f"its save was active less than --older-than {_age(args.older_than)} ago (an "
                                  "object, the upload's start or its newest part): it may still be uploading"})
    if args.json:
        _print_json({"uri": str(uri), "dry_run": args.dry_run, "older_than_s": args.older_than, **asdict(report),
                     "skipped": skipped})
        return 0
    verb = "would delete" if args.dry_run else "deleted"
    for key in report.deleted:
        print(f"{verb}: s3://{uri.bucket}/{key}")
    for key in report.stale_markers:
        print(f"{verb}: s3://{uri.bucket}/{key} (pending references of an incremental save that never committed)")
    for key, upload_id in report.aborted_uploads:
        print(f"{'would abort' if args.dry_run else 'aborted'} upload: s3://{uri.bucket}/{key} ({upload_id})")
    for s in skipped:
        what = f"upload {s['upload_id']}" if "upload_id" in s else f"{s['objects']} object(s)" \
            if s["objects"] is not None else "metadata"
        print(f"skipped: {s['prefix']} ({what}): {s['reason']}")
    print(f"gc {uri}: {verb} {len(report.deleted)} object(s) ({_size(report.deleted_bytes)}), "
          f"{'would abort' if args.dry_run else 'aborted'} {len(report.aborted_uploads)} upload(s); "
          f"skipped {len(report.kept_recent)} recent unreferenced object(s)"
          f"{f' and {len(report.unreadable_metadata)} checkpoint(s) with unreadable metadata' if report.unreadable_metadata else ''}")
    return 0


def _gc_skipped(uri: S3Uri, report, older_than_s: float) -> list[dict[str, Any]]:
    """What gc left alone and why, one entry per checkpoint directory."""
    recent: dict[str, int] = {}
    for key in report.kept_recent:
        directory = key.rpartition("/")[0]
        recent[directory] = recent.get(directory, 0) + 1
    skipped = [{"prefix": f"s3://{uri.bucket}/{d}/", "objects": n, "reason":
                f"unreferenced data newer than --older-than {_age(older_than_s)}: a save may still be writing "
                "it; rerun gc later (or with a smaller --older-than once no save runs)"}
               for d, n in sorted(recent.items())]
    skipped += [{"prefix": f"s3://{uri.bucket}/{key.rpartition('/')[0]}/", "objects": None, "reason":
                 f"its {METADATA_NAME} is unreadable (not s3dcp metadata, or corrupt): nothing next to it is "
                 "deleted; look at it with s3dcp inspect"}
                for key in report.unreadable_metadata]
    return skipped


# ---------------------------------------------------------------------- download
def cmd_download(args) -> int:
    import warnings

    import torch
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from ..loading.reader import S3StorageReader

    uri = parse_s3_uri(args.uri)
    out = args.to_torch_save
    if os.path.exists(out) and not args.force:
        raise UsageError(f"{out} exists; pass --force to replace it")
    reader = S3StorageReader(str(uri), client=_client(args), allow_pickle=args.allow_pickle)
    reader.fetch_metadata()  # a missing or incomplete checkpoint fails here, with its own message
    state_dict: dict[str, Any] = {}
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            _load_state_dict(state_dict, storage_reader=reader, no_dist=True, planner=_EmptyStateDictLoadPlanner())
    except BaseException as e:  # noqa: BLE001 - DCP wraps ours in a BaseException
        if isinstance(root_error(e), UnsafePickleError):
            raise UnsafePickleError(f"{root_error(e)} (here: --allow-pickle)") from e
        raise
    partial = f"{out}.partial"
    try:
        torch.save(state_dict, partial)
        os.replace(partial, out)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    nbytes = os.path.getsize(out)
    if args.json:
        _print_json({"uri": str(uri), "file": os.path.abspath(out), "bytes": nbytes,
                     "top_level_keys": sorted(map(str, state_dict))})
    else:
        print(f"wrote {out}: {len(state_dict)} top-level key(s), {_size(nbytes)} from {uri}")
    return 0


# ---------------------------------------------------------------------- server
def cmd_server(args) -> int:
    from .. import localserver

    buckets = [] if args.no_bucket else (args.bucket or [DEFAULT_BUCKET])
    if args.stop:
        return localserver.stop()
    options = dict(buckets=buckets, data_dir=args.dir, port=args.port, access_key=args.access_key,
                   secret_key=args.secret_key)
    if args.print_env:
        return localserver.print_env(**options)
    return localserver.run(**options)


# ---------------------------------------------------------------------- mb
def cmd_mb(args) -> int:
    from botocore.exceptions import BotoCoreError, ClientError

    uri = parse_s3_uri(args.uri)
    if uri.prefix:
        raise UsageError(f"{args.uri}: mb takes a bucket (s3://{uri.bucket}), not a prefix")
    config = S3Config(endpoint_url=args.endpoint_url, region=args.region).resolved()
    request: dict[str, Any] = {"Bucket": uri.bucket}
    if config.region != "us-east-1":  # S3 wants it everywhere but its first region
        request["CreateBucketConfiguration"] = {"LocationConstraint": config.region}
    created = True
    try:
        _boto3(config).create_bucket(**request)
    except ClientError as e:
        error = e.response.get("Error", {})
        code = error.get("Code")
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        request_id = e.response.get("ResponseMetadata", {}).get("RequestId") or None
        fields = dict(operation="CreateBucket", bucket=uri.bucket, status=status, code=code, request_id=request_id)
        if code == "BucketAlreadyOwnedByYou":
            created = False
        elif code == "BucketAlreadyExists":
            raise S3Error(f"bucket {uri.bucket!r} exists and belongs to another account (bucket names are "
                          "global on AWS): pick another name", **fields) from e
        elif status == 403:
            raise AccessDeniedError("CreateBucket was refused: these credentials may not create buckets "
                                    "(s3:CreateBucket)", **fields) from e
        else:
            raise S3Error(f"CreateBucket failed: {error.get('Message') or code}", **fields) from e
    except BotoCoreError as e:
        raise S3ConnectionError(f"CreateBucket failed without an HTTP answer from {config.endpoint_url}: {e}",
                                operation="CreateBucket", bucket=uri.bucket) from e
    if args.json:
        _print_json({"uri": str(uri), "created": created, "region": config.region,
                     "endpoint_url": config.endpoint_url})
    else:
        print(f"{'created' if created else 'exists already (yours)'}: s3://{uri.bucket} "
              f"({config.region}, {config.endpoint_url})")
    return 0


def _boto3(config: S3Config):
    """A boto3 client for the CLI's resolved config (credentials from boto3's usual chain)."""
    import boto3
    from botocore.config import Config

    from ..config import is_loopback_host

    options: dict[str, Any] = {"signature_version": "s3v4", "retries": {"max_attempts": config.max_retries + 1,
                                                                        "mode": "standard"}}
    if config.use_path_style:
        options["s3"] = {"addressing_style": "path"}
    if is_loopback_host(urlsplit(config.endpoint_url).hostname or ""):
        options["proxies"] = {}  # loopback traffic never goes through a proxy from the environment
    session = boto3.session.Session(profile_name=config.profile) if config.profile else boto3.session.Session()
    return session.client("s3", endpoint_url=config.endpoint_url, region_name=config.region,
                          verify=config.ca_bundle or config.verify_tls, config=Config(**options))


# ---------------------------------------------------------------------- TLS / plain HTTP mismatch
def _scheme_hint(err: BaseException, args) -> str | None:
    """For a request that got no HTTP answer: does the endpoint speak the other protocol?"""
    if not isinstance(err, S3ConnectionError) or args is None:
        return None
    from ..s3.probe import scheme_mismatch

    try:
        endpoint = S3Config(endpoint_url=getattr(args, "endpoint_url", None),
                            region=getattr(args, "region", None)).resolved().endpoint_url
    except ConfigError:
        return None
    hint = scheme_mismatch(endpoint)
    return f"{hint} (--endpoint-url or AWS_ENDPOINT_URL_S3)" if hint else None


# ---------------------------------------------------------------------- output helpers
def _print_json(value: Any) -> None:
    json.dump(value, sys.stdout, indent=2)
    sys.stdout.write("\n")
    sys.stdout.flush()


def _table(header: list[str], rows: list[list[Any]], indent: int = 0) -> None:
    if not rows:
        print(" " * indent + "(none)")
        return
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    for row in cells:
        print(" " * indent + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"  # pragma: no cover


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"


class _NoBar:
    def __enter__(self) -> "_NoBar":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def update(self, n: int = 1) -> None:
        pass


def _progress(total: int, unit: str, quiet: bool):
    """A tqdm bar on stderr when it is a terminal (and tqdm is installed), else nothing."""
    if quiet or not sys.stderr.isatty():
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, unit=unit, unit_scale=unit == "B", unit_divisor=1024 if unit == "B" else 1000,
                file=sys.stderr, leave=False)


if __name__ == "__main__":
    raise SystemExit(main())
