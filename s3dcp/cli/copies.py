"""One checkpoint's copies on this node: ``s3dcp verify URI --local-dir D`` (every copy's items
against their checksums) and the metadata ``s3dcp inspect URI --local-dir D`` shows when S3
holds none.

    verify: survey D (cli/nodes.py) -> the copies of URI (its run's step directory, every save)
            -> each checked with lifecycle/holdings.check_copy against the metadata a restore
               would trust for it: S3's where S3 committed that save, else the copy's own
               .metadata (decoded without torch, and of the save its marker names)
            -> a table: OK, corrupt (why), incomplete (why) or unchecked (items without a
               checksum); stale copies say why a restore leaves them out; exit 1 unless every
               copy is OK
"""

from __future__ import annotations

import sys
from typing import Any

from ..errors import CheckpointNotFoundError, IncompleteCheckpointError, MetadataFormatError
from ..format.context import At, quoted
from ..format.local import LOCAL_METADATA_NAME
from ..format.metadata import decode_plain
from ..format.metadata.locations import check_item
from ..lifecycle.holdings import S3View, check_copy, stale_copies
from ..uri import parse_s3_uri
from .common import plain_metadata, s3_client
from .nodes import MAX_LOCAL_METADATA_BYTES, Copy, Survey, node, read_private, report, survey
from .output import format_size, print_json, print_table, shown

__all__ = ["cmd_verify_copies", "copy_metadata"]


def cmd_verify_copies(args) -> int:
    """``s3dcp verify URI --local-dir D`` (see the module docstring)."""
    uri = parse_s3_uri(args.uri)
    found = survey(args.local_dir)
    mine = [c for c in found.copies if c.uri == uri]
    if not mine:
        held = sorted({str(c.uri) for c in found.copies})
        raise CheckpointNotFoundError(f"{found.local_dir} holds no copy of {uri} on this node ({node()})"
                                      + (f"; it holds copies of {', '.join(held[:8])}" if held else ""))
    try:
        s3_md = plain_metadata(s3_client(args), uri)
    except (CheckpointNotFoundError, IncompleteCheckpointError):
        s3_md = None  # not committed in S3 (a step kept on the nodes, or deleted there)
    s3_save = (s3_md.storage_meta.save_id if s3_md is not None and s3_md.storage_meta else None) or None
    step = next((c.step for c in mine if c.problem is None), mine[0].step)  # a misplaced marker may say another
    view = S3View(frozenset({step} if s3_md is not None else ()), {step: s3_save} if s3_save else {})
    here = node()
    run = [c for c in found.copies if c.run == mine[0].run]
    stale = stale_copies([(here, report(run))], view)
    results = [_check(c, s3_md if s3_save and c.marker.save_id == s3_save else None,
                      stale.get((here, c.step, c.marker.rank))) for c in mine]
    ok = all(r["result"] == "ok" for r in results)
    if args.json:
        print_json({"uri": str(uri), "local_dir": str(found.local_dir), "node": here, "s3_save_id": s3_save,
                    "ok": ok, "copies": results})
    else:
        in_s3 = f"committed in S3 (save {s3_save or '?'})" if s3_md is not None else "not committed in S3"
        print(shown(f"copies of {uri} in {found.local_dir} on {here}: {in_s3}"))
        print_table(["RANK", "SAVE", "SIZE", "ITEMS", "CHECKED AGAINST", "RESULT"],
                    [[f"{r['rank']} of {r['world_size']}", r["save_id"], format_size(r["bytes"]), r["items"],
                      {"s3": "S3's .metadata", "copy": "its own .metadata", None: "-"}[r["against"]],
                      "OK" if r["result"] == "ok" else f"{r['result']}: {r['why']}"] for r in results], indent=2)
        for r in results:
            if r["stale"]:
                print(shown(f"  # rank {r['rank']} (save {r['save_id']}): {r['stale']}: a restore does not use it"))
        if ok:
            print(shown(f"OK: {len(results)} copie(s) of {uri} on this node verified"))
    if not ok:
        bad = ", ".join(f"rank {r['rank']}: {r['result']}" for r in results if r["result"] != "ok")
        print(shown(f"s3dcp: error: not every copy of {uri} in {found.local_dir} is intact ({bad}); a restore does "
                    "not use those (it reads those objects from another node's copy or from S3); delete them, or let "
                    "the next save's retention remove them"), file=sys.stderr)
        return 1
    return 0


def _check(c: Copy, s3_md, stale: str | None) -> dict[str, Any]:
    """One copy against ``s3_md`` (S3's metadata of its save) or, with None, its own."""
    out = {"path": str(c.path), "rank": c.marker.rank, "save_id": c.marker.save_id,
           "world_size": c.marker.world_size, "bytes": c.marker.nbytes, "items": 0, "against": None,
           "result": "incomplete", "why": c.problem, "stale": stale}
    if c.problem is not None:
        return out
    out["against"] = "s3" if s3_md is not None else "copy"
    mine: list = []  # the items stored in this copy's objects
    try:
        md = s3_md if s3_md is not None else _own_metadata(c)
        locations = [] if md.storage is None else list(md.storage.items())
        for index, loc in locations:
            if loc.object_name in c.marker.objects:
                check_item(loc, At("item ", quoted(index.fqn)))  # before any offset is used
                mine.append(loc)
        out["items"] = len(mine)
        problem = check_copy(c.path, c.marker, mine)
        if problem is None and c.marker.objects and not mine:
            problem = "none of its objects holds an item of the checkpoint's metadata"
    except (MetadataFormatError, ValueError) as e:  # ValueError: a checksum of no known algorithm
        problem = str(e)
    except OSError as e:
        problem = f"unreadable: {e.strerror or e}"
    unchecked = sum(1 for loc in mine if not loc.checksum) if problem is None else 0
    out["result"], out["why"] = (
        ("corrupt", " ".join(problem.split())) if problem is not None
        else ("unchecked", f"{unchecked} item(s) without a checksum: their bytes cannot be checked") if unchecked
        else ("ok", None))
    return out


def _own_metadata(c: Copy):
    """The copy's own ``.metadata``, decoded without torch; MetadataFormatError where it is not
    one of the save its marker names."""
    path = c.path / LOCAL_METADATA_NAME
    data = read_private(path, MAX_LOCAL_METADATA_BYTES + 1)
    if len(data) > MAX_LOCAL_METADATA_BYTES:
        raise MetadataFormatError(f"{path}: over {MAX_LOCAL_METADATA_BYTES} bytes: not a metadata s3dcp wrote")
    md = decode_plain(data, source=str(path))
    save = (md.storage_meta.save_id if md.storage_meta else None) or ""
    if save != c.marker.save_id:
        raise MetadataFormatError(f"{path} is of save {save!r}, its marker of save {c.marker.save_id!r}")
    return md


def copy_metadata(found: Survey, uri) -> tuple[Any, str]:
    """The metadata of ``uri`` from a complete copy in ``found`` (its newest save first) and
    the path it came from; CheckpointNotFoundError when no copy has one that reads."""
    copies = sorted((c for c in found.copies if c.uri == uri and c.problem is None),
                    key=lambda c: (-c.marker.saved_at, c.marker.rank))
    problems = []
    for c in copies:
        try:
            return _own_metadata(c), str(c.path / LOCAL_METADATA_NAME)
        except (MetadataFormatError, OSError) as e:
            problems.append(f"{c.path}: {e}")
    raise CheckpointNotFoundError(f"no checkpoint at {uri}: S3 holds no {LOCAL_METADATA_NAME} of it and "
                                  f"{found.local_dir} no readable copy" + (f" ({problems[0]})" if problems else ""))
