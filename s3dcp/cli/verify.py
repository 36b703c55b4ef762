"""The commands that read a checkpoint's data: ``s3dcp verify`` (every item against its checksum, a
few ranged GETs in flight, memory bounded by a few blocks) and ``s3dcp download`` (the whole
checkpoint into one ``torch.save`` file)."""

from __future__ import annotations

import os
import sys
from typing import Any, Sequence

from .._partial_file import PartialFile
from ..errors import MetadataFormatError, S3DCPError, UnsafePickleError, root_error
from ..format import integrity, layout
from ..format.context import At, quoted
from ..uri import S3Uri, object_key, parse_s3_uri
from .common import UsageError, plain_metadata, s3_client
from .copies import cmd_verify_copies
from .output import format_size, print_json, progress_bar, shown

__all__ = ["cmd_verify", "cmd_download"]

_READ_WINDOW = 4  # ranged GETs in flight while verifying, each at most one block


# ---------------------------------------------------------------------- verify
def cmd_verify(args) -> int:
    """Read every item the metadata declares and check it against its checksum. OK only when
    every declared item was read whole and matched; a declared chunk or item a load could not
    fill (no stored location, another dtype or shape stored, chunks that do not tile their
    tensor), an item with an impossible location, no checksum (nothing to check it against), a
    short or failed read, or a mismatch makes the exit status 1 and is named."""
    from collections import deque

    from ..format.metadata.declared import problems
    from ..format.metadata.locations import check_item

    if args.local_dir:  # this node's copies of it instead of S3's objects
        return cmd_verify_copies(args)
    uri = parse_s3_uri(args.uri)
    client = s3_client(args)
    md = plain_metadata(client, uri)  # decoded without torch
    storage = [] if md.storage is None else list(md.storage.items())
    checks: list[_Verify] = []
    # what the metadata declares but does not store as declared: a load of it fails (or fills wrong)
    bad: list[dict[str, Any]] = [_undeclared(p) for p in problems(md)]
    skipped: list[dict[str, Any]] = []
    declared_bytes = 0
    segments: dict[str, list[layout.Segment]] = {}
    object_sizes: dict[str, int] = {}
    for index, loc in storage:
        declared_bytes += max(0, loc.length) if type(loc.length) is int else 0
        where = At("item ", quoted(index.fqn), _chunk(index.offset))  # text only on error
        try:
            check_item(loc, where)
        except MetadataFormatError as e:
            bad.append(_bad(uri, index, loc, None, reason=f"invalid location: {e}"))
            continue
        if loc.checksum is None:
            skipped.append(_bad(uri, index, loc, None, reason="no checksum recorded: its bytes cannot be checked"))
            continue
        try:  # memory is taken only for bytes its object holds: a crafted length or block size stops here
            if loc.object_name not in object_sizes:
                object_sizes[loc.object_name] = client.head(uri.bucket, object_key(uri, loc.object_name)).result().size
            layout.check_in_object(loc, object_sizes[loc.object_name], where)
        except MetadataFormatError as e:
            bad.append(_bad(uri, index, loc, None, reason=f"invalid location: {e}"))
            continue
        except S3DCPError as e:
            bad.append(_bad(uri, index, loc, None, reason=f"unreadable: {e}"))
            continue
        try:
            check = _Verify(index, integrity.ItemCheck(loc))
        except ValueError as e:
            bad.append(_bad(uri, index, loc, None, reason=str(e)))
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
    with progress_bar(total, "B", args.quiet) as bar:
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
    verified = [c for c in checks if c.error is None and c.item.whole and c.item.ok]
    for c in checks:
        if c.error is None and not c.item.whole:  # never fed in full: not verified, whatever ok says
            c.error = f"only {c.item.fed_bytes} of its {c.item.location.length} bytes were read"
    bad += [_bad(uri, c.index, c.item.location, c.error or c.item.got, c.item.bad_blocks)
            for c in checks if c.error or not c.item.ok]
    nbytes = sum(c.item.location.length for c in verified)
    ok = not bad and not skipped and len(verified) == len(storage)
    if args.json:
        print_json({"uri": str(uri), "ok": ok, "items": len(storage), "checked_items": len(checks),
                     "verified_items": len(verified), "unchecked_items": len(skipped), "bytes": nbytes,
                     "declared_bytes": declared_bytes, "bad": bad, "unchecked": skipped})
    else:
        for b in bad:
            where = f" (bad blocks {b['bad_blocks']})" if b["bad_blocks"] else ""
            if b["object"] is None:  # declared, not stored as declared
                chunk = "" if b["offset"] is None else f" (chunk at {tuple(b['offset'])})"
                print(shown(f"BAD {b['fqn'] or 'metadata'}{chunk}: {b['reason']}"))
            elif b["reason"]:
                print(shown(f"BAD {b['fqn']}{_chunk(b['offset'])} in {b['object']}: {b['reason']}"))
            else:
                print(shown(f"BAD {b['fqn']}{_chunk(b['offset'])} in {b['object']} bytes {b['start']}-{b['end']}: "
                            f"expected {b['expected']}, got {b['got']}{where}"))
        for b in skipped:
            print(shown(f"NOT CHECKED {b['fqn']}{_chunk(b['offset'])} in {b['object']} bytes {b['start']}-{b['end']}: "
                        f"{b['reason']}"))
        if ok:
            print(shown(f"OK: {len(verified)} item(s), {nbytes} bytes ({format_size(nbytes)}) in "
                        f"{len({c.item.location.object_name for c in verified})} object(s) of {uri} verified; "
                        "every chunk and item the metadata declares is among them"))
    if not ok:
        parts = [f"{len(bad)} bad item(s)"] if bad else []
        if skipped:
            parts.append(f"{len(skipped)} item(s) without a checksum, not checked")
        print(shown(f"s3dcp: error: {', '.join(parts) or 'not every item was verified'} in {uri}: "
                    f"{len(verified)} of {len(storage)} item(s), {nbytes} of {declared_bytes} bytes verified"
                    + ("; restore from another checkpoint" if bad else "")), file=sys.stderr)
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


def _bad(uri: S3Uri, index, loc, got: str | None, bad_blocks: Sequence[int] = (), *,
         reason: str | None = None) -> dict[str, Any]:
    """One item verify could not pass: its checksum ``got``, or the ``reason`` it was not checked."""
    return {"object": f"s3://{uri.bucket}/{object_key(uri, loc.object_name)}", "fqn": index.fqn,
            "offset": None if index.offset is None else list(index.offset),
            "start": loc.offset, "end": loc.offset + loc.length, "expected": loc.checksum, "got": got,
            "bad_blocks": list(bad_blocks), "reason": reason}


def _undeclared(problem) -> dict[str, Any]:
    """A declared chunk or item that is not stored as declared (``declared.Problem``), as ``_bad`` gives."""
    return {"object": None, "fqn": problem.fqn, "offset": None if problem.offset is None else list(problem.offset),
            "start": None, "end": None, "expected": None, "got": None, "bad_blocks": [], "reason": problem.reason}


def _chunk(offset) -> str:
    return f" (chunk at {tuple(offset)})" if offset and any(offset) else ""


# ---------------------------------------------------------------------- download
def cmd_download(args) -> int:
    import warnings

    import torch
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from ..loading.reader import S3StorageReader
    from ..loading.sizes import check_declared_sizes

    uri = parse_s3_uri(args.uri)
    out = args.to_torch_save
    if os.path.exists(out) and not args.force:
        raise UsageError(f"{out} exists; pass --force to replace it")
    client = s3_client(args)
    reader = S3StorageReader(str(uri), client=client, allow_pickle=args.allow_pickle)
    md = reader.fetch_metadata()  # a missing or incomplete checkpoint fails here, with its own message
    check_declared_sizes(client, uri, md)  # before the planner allocates every tensor at its declared size
    state_dict: dict[str, Any] = {}
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            _load_state_dict(state_dict, storage_reader=reader, no_dist=True, planner=_EmptyStateDictLoadPlanner())
    except BaseException as e:  # noqa: BLE001 - DCP wraps ours in a BaseException
        if isinstance(root_error(e), UnsafePickleError):
            raise UnsafePickleError(f"{root_error(e)} (here: --allow-pickle)") from e
        raise
    with PartialFile(out) as partial:  # a fresh name of its own, never a fixed one someone could prepare
        with open(partial.fd, "wb", closefd=False) as f:
            torch.save(state_dict, f)
        partial.finish()
    nbytes = os.path.getsize(out)
    if args.json:
        print_json({"uri": str(uri), "file": os.path.abspath(out), "bytes": nbytes,
                     "top_level_keys": sorted(map(str, state_dict))})
    else:
        print(f"wrote {out}: {len(state_dict)} top-level key(s), {format_size(nbytes)} from {uri}")
    return 0
