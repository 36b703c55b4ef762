"""The ``s3dcp`` command: look at, check, copy out and clean up checkpoints in S3.

    s3dcp ls s3://bucket/run/                 checkpoints below, committed or INCOMPLETE
    s3dcp ls s3://bucket/run/ --local-dir D   ... and this node's copies in D, and the step a restart takes
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

This module owns :func:`main` and how errors are reported (exit status, one line or one JSON
object, the hint for an http/https mismatch). The command line is parsed in :mod:`.parser`;
the commands live one group per module: :mod:`.browse` (ls, inspect), :mod:`.verify` (verify,
download), :mod:`.cleanup` (rm, materialize, gc), :mod:`.export`, :mod:`.server` (server, mb);
:mod:`.nodes` and :mod:`.copies` read a node's copies (``--local-dir``);
:mod:`.output` prints tables, sizes and JSON. Importing any of them imports no torch: the heavy
imports happen inside the commands that need them.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from contextlib import suppress
from typing import Sequence

from ..config import S3Config
from ..errors import ConfigError, NoSuchBucketError, S3ConnectionError, S3DCPError, root_error
from .common import UsageError
from .output import shown
from .parser import CommandLineError, build_parser

__all__ = ["main"]


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
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    except CommandLineError as e:
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
    else:  # escaped: an error's text may hold names read from storage (a key, a server's message)
        print(f"s3dcp: error: {shown(text)}", file=sys.stderr)
    return code


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

