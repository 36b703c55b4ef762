"""``s3dcp ls`` (the checkpoints below a prefix) and ``s3dcp inspect`` (one checkpoint's contents from
its metadata alone): commands that read listings and metadata, never tensor data."""

from __future__ import annotations

import re
import sys
import time
from typing import Any

from ..format.layout import METADATA_NAME, is_data_object, parse_object_name
from ..uri import parse_s3_uri
from .common import s3_client
from .output import format_age, format_size, print_json, print_table

__all__ = ["cmd_ls", "cmd_inspect"]


# ---------------------------------------------------------------------- ls
def cmd_ls(args) -> int:
    from ..lifecycle.deletion import held_for_references
    from ..lifecycle.directories import scan_directories

    base = parse_s3_uri(args.uri)
    now = time.time()
    rows = []
    client = s3_client(args)
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
        print_json(rows)
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
            print(f"{'' if i == 0 else chr(10)}{run}/  ({len(group)} checkpoint(s), "
                  f"{format_size(sum(r['bytes'] for r in group))}{latest})")
        cut = len(run) - len(str(base)) if run != str(base) else 0  # "a/" of "a/step-1"
        print_table(header, [[r["name"][cut:], "-" if r["step"] is None else r["step"], format_size(r["bytes"]),
                              r["objects"], "committed" if r["committed"] else "INCOMPLETE", format_age(r["age_s"])]
                             for r in group],
                    indent=2 if headed else 0)
    return 0


# ---------------------------------------------------------------------- inspect
def cmd_inspect(args) -> int:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from ..format.references import sources
    from ..errors import MetadataFormatError
    from ..format.layout import check_location
    from ..format.metadata import FORMAT_NAME, dtype_to_str, format_version_of, str_to_dtype
    from ..loading.reader import S3StorageReader

    uri = parse_s3_uri(args.uri)
    client = s3_client(args)
    md = S3StorageReader(str(uri), client=client).fetch_metadata()
    format_version = format_version_of(client.get(uri.bucket, uri.key(METADATA_NAME)).result())
    stored: dict[str, int] = {}
    objects: dict[str, dict[str, Any]] = {}
    invalid: list[dict[str, Any]] = []  # locations that cannot describe stored bytes (damaged or crafted)
    for index, loc in md.storage_data.items():
        try:
            check_location(loc, None if loc.dtype is None else str_to_dtype(loc.dtype).itemsize, f"item {index.fqn!r}")
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
        "invalid_items": invalid,
    }
    if args.json:
        print_json(report)
        return 1 if invalid else 0
    extra = "".join(f", {label} {value}" for label, value in (("DCP", md.version), ("save", report["save_id"]))
                    if value)
    print(f"{uri}\n  format {FORMAT_NAME} v{format_version}{extra}")
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
          f"in {len(md.storage_data)} item(s), {len(objects)} object(s)")
    if invalid:
        print(f"\nINVALID items: {len(invalid)}")
        print_table(["FQN", "CHUNK", "REASON"],
                    [[i["fqn"], "-" if i["offset"] is None else tuple(i["offset"]), i["reason"]] for i in invalid],
                    indent=2)
        print(f"s3dcp: error: {len(invalid)} item(s) of {uri} have locations that cannot be right "
              "(damaged or crafted metadata); this checkpoint will not load", file=sys.stderr)
        return 1
    return 0
