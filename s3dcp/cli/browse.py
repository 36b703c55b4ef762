"""``s3dcp ls`` (the checkpoints below a prefix) and ``s3dcp inspect`` (one checkpoint's contents from
its metadata alone): commands that read listings and metadata, never tensor data."""

from __future__ import annotations

import re
import sys
import time
from concurrent.futures import wait
from typing import Any

from ..errors import CheckpointNotFoundError, IncompleteCheckpointError, S3Error
from ..format.context import At, quoted
from ..format.layout import (
    METADATA_HEAD_BYTES,
    METADATA_NAME,
    is_data_object,
    is_s3dcp_metadata_head,
    parse_object_name,
)
from ..uri import parse_s3_uri
from .common import plain_metadata, s3_client
from .copies import copy_metadata
from .nodes import node, ranks_text, runs_on_node, survey
from .output import format_age, format_size, print_json, print_table, shown

__all__ = ["cmd_ls", "cmd_inspect"]


# ---------------------------------------------------------------------- ls
def cmd_ls(args) -> int:
    """Every directory below the prefix that holds what a checkpoint stores, as a row: committed,
    INCOMPLETE (a save that failed or still runs, unfinished multipart uploads included), kept
    only because other checkpoints reference its objects, or committed by another writer (a
    ``.metadata`` that is not s3dcp's). Everything stored there is counted: it is paid for."""
    from ..lifecycle.deletion import held_for_references
    from ..lifecycle.directories import scan_directories

    base = parse_s3_uri(args.uri)
    found = survey(args.local_dir) if args.local_dir else None  # a bad --local-dir: refused before any request
    now = time.time()
    client = s3_client(args)
    by_dir = scan_directories(client, base)
    uploads_future = client.list_uploads(base.bucket, base.dir_prefix)
    held = held_for_references(client, base.bucket, by_dir)  # deleted; objects kept for incremental ones
    foreign = _foreign_metadata(client, base.bucket, by_dir)
    uploads: dict[str, list] = {}
    for upload in _unfinished_uploads(uploads_future, base):
        directory = upload.key.rpartition("/")[0]
        uploads.setdefault(f"{directory}/" if directory else "", []).append(upload)
    parts = {u.upload_id: client.upload_parts(base.bucket, u.key, u.upload_id)  # their stored bytes
             for found in uploads.values() for u in found}
    wait(list(parts.values()))
    rows = []
    for directory in sorted(set(by_dir) | set(uploads)):
        objects = by_dir.get(directory, [])
        names = {o.key.rpartition("/")[2] for o in objects}
        committed = METADATA_NAME in names
        if not committed and not any(is_data_object(n) for n in names) and directory not in uploads:
            continue
        relative = directory[len(base.dir_prefix):].rstrip("/") if directory != base.dir_prefix else ""
        last = (relative or base.prefix).rpartition("/")[2]
        step = re.search(r"(\d+)$", last)
        stamps = [o.last_modified for o in objects if o.last_modified is not None]
        stamps += [u.initiated for u in uploads.get(directory, []) if u.initiated is not None]
        newest = max(stamps) if stamps else None
        run = relative.rpartition("/")[0]  # the checkpoint's parent, relative to the listed prefix
        pending = [{"key": u.key, "upload_id": u.upload_id, "initiated": u.initiated,
                    **_parts_of(parts[u.upload_id])} for u in uploads.get(directory, [])]
        state = ("foreign" if directory in foreign else "committed" if committed
                 else "kept_for_references" if directory in held else "incomplete")
        rows.append({
            "name": relative or ".", "uri": str(base.child(relative)) if relative else str(base),
            "run": str(base.child(run)) if run else str(base),
            "step": int(step.group(1)) if step else None, "committed": committed, "state": state,
            "held_by": [f"s3://{base.bucket}/{d.rstrip('/')}" for d in sorted(held.get(directory, ()))],
            "bytes": sum(o.size for o in objects) + sum(u["bytes"] or 0 for u in pending), "objects": len(objects),
            "uploads": pending,
            "last_modified": newest, "age_s": None if newest is None else max(0.0, now - newest),
        })
    rows.sort(key=lambda r: (r["run"], r["step"] is None, r["step"] or 0, r["name"]))
    local = None if found is None else runs_on_node(
        found, base, client, {r["uri"] for r in rows if r["committed"] and r["state"] != "kept_for_references"})
    if args.json:
        print_json(rows if local is None else {"checkpoints": rows, **_local_json(found, local)})
        return 0
    if not rows and not local:
        print(f"s3dcp: no checkpoints under {base}", file=sys.stderr)
        _unusable(found)
        return 0
    runs: dict[str, list[dict[str, Any]]] = {run: [] for run in local or ()}
    for r in rows:
        runs.setdefault(r["run"], []).append(r)
    runs = dict(sorted(runs.items()))
    header = ["NAME", "STEP", "SIZE", "OBJECTS", "STATE", "AGE"]
    headed = len(runs) > 1 or next(iter(runs)) != str(base)
    for i, (run, group) in enumerate(runs.items()):
        if headed:  # one table per run (the checkpoints' parent prefix)
            committed = [r for r in group if r["state"] == "committed" and r["step"] is not None]
            latest = f", latest in S3: step {max(r['step'] for r in committed)}" if committed else ""
            print(("" if i == 0 else "\n") + shown(
                f"{run}/  (" + (f"{len(group)} checkpoint(s), {format_size(sum(r['bytes'] for r in group))}{latest})"
                                 if group else "no checkpoint in S3)")))
        cut = len(run) - len(str(base)) if run != str(base) else 0  # "a/" of "a/step-1"
        print_table(header, [[r["name"][cut:], "-" if r["step"] is None else r["step"], format_size(r["bytes"]),
                              r["objects"], _ls_state(r, run), format_age(r["age_s"])]
                             for r in group],
                    indent=2 if headed else 0)
        for note in _ls_notes(group, run, cut):
            print(f"{'  ' if headed else ''}# {shown(note)}")
        if local and run in local:
            _print_on_node(found, local[run], indent=2 if headed else 0)
    _unusable(found)
    return 0


def _local_json(found, local: dict) -> dict[str, Any]:
    """What ``ls --json --local-dir`` adds beside the S3 rows (``checkpoints``)."""
    return {"local_dir": str(found.local_dir), "node": node(),
            "local_copies": [row.as_json(run) for run, on in local.items() for row in on.rows],
            "restart": [on.restart_json() for on in local.values()],
            "unusable": [{"path": str(path), "why": why} for path, why in found.unusable],
            "notes": [note for on in local.values() for note in on.notes]}


def _print_on_node(found, on, indent: int) -> None:
    """One run's copies on this node under its S3 table: a row per save, why, and the restart."""
    pad = " " * indent
    print(shown(f"{pad}on this node ({node()}, {found.local_dir}):"))
    print_table(["NAME", "STEP", "SAVE", "RANKS", "SIZE", "S3", "STATE"],
                [[r.name, r.step, r.save_id, ranks_text(r.ranks, r.world_size), format_size(r.nbytes), r.s3, r.state]
                 for r in on.rows], indent=indent)
    for r in on.rows:
        if r.state == "stale":
            print(shown(f"{pad}# {r.name} (save {r.save_id}): {r.why}: a restore does not use it (retention on "
                        "the node removes it)"))
        elif r.state == "not used":
            print(shown(f"{pad}# {r.paths[0]}: {r.why}"))
    for note in on.notes:
        print(shown(f"{pad}# {note}"))
    print(shown(f"{pad}{on.line}"))


def _unusable(found) -> None:
    for path, why in [] if found is None else found.unusable:
        print(shown(f"# {path}: {why}"))


def _ls_state(row: dict[str, Any], run: str) -> str:
    uploads = f", {len(row['uploads'])} unfinished upload(s)" if row["uploads"] else ""
    if row["state"] == "kept_for_references":
        return f"kept for {', '.join(u[len(run) + 1:] for u in row['held_by'])}{uploads}"
    if row["state"] == "foreign":
        return f"not s3dcp's{uploads}"
    return ("committed" if row["state"] == "committed" else "INCOMPLETE") + uploads


def _ls_notes(group: list[dict[str, Any]], run: str, cut: int) -> list[str]:
    """What the STATE column abbreviates: what is kept and why, and what to do about it."""
    notes = []
    for r in group:
        name = r["name"][cut:]
        if r["state"] == "kept_for_references":
            notes.append(f"{name}: deleted; its {r['objects']} object(s) ({format_size(r['bytes'])}) stay while "
                         f"{', '.join(u[len(run) + 1:] for u in r['held_by'])} reference them (they go with the "
                         "last of those; s3dcp materialize copies them into one)")
        elif r["state"] == "foreign":
            notes.append(f"{name}: its {METADATA_NAME} is not s3dcp's (DCP's own pickle, say): s3dcp cannot load it, "
                         f"and rm, gc and retention delete nothing under {run}/ that it might reference")
    pending = [u for r in group for u in r["uploads"]]
    if pending:
        unknown = " and more: ListParts was refused" if any(u["bytes"] is None for u in pending) else ""
        notes.append(f"{len(pending)} unfinished multipart upload(s), counted in SIZE: their parts "
                     f"({format_size(sum(u['bytes'] or 0 for u in pending))}{unknown}) are stored (and billed) until "
                     "aborted; "
                     f"s3dcp gc {run}/ aborts those of saves that are no longer running")
    return notes


def _unfinished_uploads(future, base) -> list:
    """The uploads ListMultipartUploads gave, or none (said on stderr) where it is refused:
    listing checkpoints must not need that permission."""
    try:
        return future.result()
    except S3Error as e:
        print(shown(f"s3dcp: note: unfinished multipart uploads under {base} not listed: {e}"), file=sys.stderr)
        return []


def _parts_of(future) -> dict[str, int | None]:
    """An upload's parts and bytes (None, None where ListParts is refused)."""
    if isinstance(future.exception(), S3Error):
        return {"parts": None, "bytes": None}
    found = future.result()
    return {"parts": found.parts, "bytes": found.bytes}


def _foreign_metadata(client, bucket: str, by_dir: dict[str, list]) -> set[str]:
    """The directories of ``by_dir`` whose ``.metadata`` is not s3dcp's (its first bytes: one
    small ranged GET each, in parallel)."""
    heads = {}
    for directory, objects in by_dir.items():
        for o in objects:
            if o.key.rpartition("/")[2] == METADATA_NAME:
                buf = bytearray(min(o.size, METADATA_HEAD_BYTES))
                heads[directory] = (buf, client.get_range_into(bucket, o.key, 0, buf) if buf else None)
    wait([f for _, f in heads.values() if f is not None])
    foreign = set()
    for directory, (buf, future) in heads.items():
        if future is not None and future.exception() is not None:
            continue  # deleted since the listing (or unreadable): not ours to judge here
        if not is_s3dcp_metadata_head(bytes(buf)):
            foreign.add(directory)
    return foreign


# ---------------------------------------------------------------------- inspect
def cmd_inspect(args) -> int:
    """One checkpoint's contents from its metadata alone (one GET, decoded without torch)."""
    from ..errors import MetadataFormatError
    from ..format.metadata import FORMAT_NAME
    from ..format.metadata.locations import check_item
    from ..format.metadata.plain import PlainTensor
    from ..format.references import sources

    uri = parse_s3_uri(args.uri)
    client = s3_client(args)
    source = None  # where the metadata came from, when not from S3
    try:
        md = plain_metadata(client, uri)
    except (CheckpointNotFoundError, IncompleteCheckpointError):
        if not args.local_dir:
            raise
        md, source = copy_metadata(survey(args.local_dir), uri)  # a step kept on the nodes
    format_version = md.version
    storage = [] if md.storage is None else list(md.storage.items())
    stored: dict[str, int] = {}
    objects: dict[str, dict[str, Any]] = {}
    invalid: list[dict[str, Any]] = []  # locations that cannot describe stored bytes (damaged or crafted)
    for index, loc in storage:
        try:
            check_item(loc, At("item ", quoted(index.fqn)))  # text only on error: a name may be megabytes
        except MetadataFormatError as e:
            invalid.append({"fqn": index.fqn, "offset": None if index.offset is None else list(index.offset),
                            "reason": str(e)})
        stored[index.fqn] = stored.get(index.fqn, 0) + loc.length
        parsed = parse_object_name(loc.object_name.rpartition("/")[2])
        obj = objects.setdefault(loc.object_name, {
            "object": loc.object_name, "rank": parsed.rank if parsed else None,
            "token": parsed.token if parsed else None, "items": 0, "bytes": 0})
        obj["items"] += 1
        obj["bytes"] = max(obj["bytes"], loc.offset + loc.length)
    tensors, others = [], []
    for fqn, item in md.state_dict.items():
        if isinstance(item, PlainTensor):
            tensors.append({"fqn": fqn, "dtype": item.properties.dtype, "shape": list(item.size),
                            "chunks": len(item.chunks), "bytes": stored.get(fqn, 0)})
        else:
            others.append({"fqn": fqn, "bytes": stored.get(fqn, 0)})
    sm = md.storage_meta
    report = {
        "uri": str(uri), "format": FORMAT_NAME, "format_version": format_version, "dcp_version": md.dcp_version,
        "save_id": sm.save_id if sm else None, "tensors": tensors, "non_tensors": others,
        "objects": sorted(objects.values(), key=lambda o: (o["rank"] is None, o["rank"] or 0, o["object"])),
        "total_bytes": sum(stored.values()),
        **sources(loc for _, loc in storage),  # incremental: bytes written vs inherited per base
        "invalid_items": invalid,
        **({"metadata_from": source} if source else {}),
    }
    if args.json:
        print_json(report)
        return 1 if invalid else 0
    extra = "".join(f", {label} {value}" for label, value in (("DCP", md.dcp_version), ("save", report["save_id"]))
                    if value)
    print(shown(uri))
    print(shown(f"  format {FORMAT_NAME} v{format_version}{extra}"))
    if source:
        print(shown(f"  metadata from this node's copy {source}: S3 holds none of it"))
    print(f"\ntensors: {len(tensors)}, {format_size(sum(t['bytes'] for t in tensors))}")
    print_table(["FQN", "DTYPE", "SHAPE", "CHUNKS", "BYTES"],
                [[t["fqn"], t["dtype"], "x".join(map(str, t["shape"])) or "scalar", t["chunks"], t["bytes"]]
                 for t in tensors], indent=2)
    print(f"\nnon-tensor items: {len(others)}")
    print_table(["FQN", "BYTES"], [[o["fqn"], o["bytes"]] for o in others], indent=2)
    print(f"\ndata objects: {len(objects)}")
    print_table(["OBJECT", "RANK", "ITEMS", "BYTES"],
                [[o["object"], "-" if o["rank"] is None else o["rank"], o["items"], o["bytes"]]
                 for o in report["objects"]], indent=2)
    if report["inherited"]:
        print("\nincremental: items stored here and referenced in bases")
        print_table(["SOURCE", "ITEMS", "BYTES"],
                    [["(written)", report["written"]["items"], report["written"]["bytes"]]]
                    + [[f"../{d}", v["items"], v["bytes"]] for d, v in sorted(report["inherited"].items())],
                    indent=2)
    print(f"\ntotal: {report['total_bytes']} bytes ({format_size(report['total_bytes'])}) "
          f"in {len(storage)} item(s), {len(objects)} object(s)")
    if invalid:
        print(f"\nINVALID items: {len(invalid)}")
        print_table(["FQN", "CHUNK", "REASON"],
                    [[i["fqn"], "-" if i["offset"] is None else tuple(i["offset"]), i["reason"]] for i in invalid],
                    indent=2)
        print(f"s3dcp: error: {len(invalid)} item(s) of {uri} have locations that cannot be right "
              "(damaged or crafted metadata); this checkpoint will not load", file=sys.stderr)
        return 1
    return 0
