"""The commands that delete or rewrite what is stored: ``s3dcp rm`` (one checkpoint, keeping what
others reference), ``s3dcp materialize`` (make an incremental checkpoint stand alone) and
``s3dcp gc`` (leftovers of failed saves, stale multipart uploads)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from ..errors import CheckpointNotFoundError
from ..format.layout import METADATA_NAME, is_data_object
from ..uri import S3Uri, parse_s3_uri
from .common import UsageError, s3_client
from .output import format_age, format_size, print_json, progress_bar, shown

__all__ = ["cmd_rm", "cmd_materialize", "cmd_gc"]


# ---------------------------------------------------------------------- rm
def cmd_rm(args) -> int:
    from ..lifecycle.manager import delete_checkpoint

    uri = parse_s3_uri(args.uri)
    client = s3_client(args)
    objects, _ = client.list(uri.bucket, uri.dir_prefix, delimiter="/").result()
    names = [o.key.rpartition("/")[2] for o in objects]
    committed = METADATA_NAME in names
    ours = [n for n in names if n == METADATA_NAME or is_data_object(n)]
    if not ours:
        raise CheckpointNotFoundError(f"no checkpoint at {uri} (no {METADATA_NAME} and no data objects)")
    if committed and not args.yes:
        raise UsageError(f"{uri} is a committed checkpoint ({len(ours)} object(s)); pass --yes to delete it")
    with progress_bar(len(ours), "obj", args.quiet or len(ours) < 100) as bar:
        result = delete_checkpoint(client, uri, on_deleted=bar.update)
    count, nbytes = result
    others = len(objects) - len(ours)
    if args.json:
        print_json({"uri": str(uri), "deleted_objects": count, "deleted_bytes": nbytes, "was_committed": committed,
                     "other_objects_left": others, "kept_referenced": result.kept,
                     "kept_referenced_bytes": result.kept_bytes, "released": result.released,
                     "kept_recent": result.kept_recent, "kept_recent_reason": _kept_recent() if result.kept_recent else None,
                     "unreadable_metadata": result.unreadable})
    else:
        left = f"; {others} other object(s) left in place" if others else ""
        if result.kept and result.unreadable:  # the reason is not a reference: say the real one
            left += (f"; kept its {len(result.kept)} data object(s) ({format_size(result.kept_bytes)}): "
                     f"{', '.join(f's3://{uri.bucket}/{k}' for k in result.unreadable)} is not s3dcp metadata "
                     "(another writer's, say) or is unreadable, so what it references is unknown")
        elif result.kept:
            left += (f"; kept {len(result.kept)} object(s) ({format_size(result.kept_bytes)}) that other checkpoints "
                     "reference (deleted with the last of them)")
        print(shown(f"deleted {'committed' if committed else 'INCOMPLETE'} checkpoint {uri}: "
                    f"{count} object(s), {format_size(nbytes)}{left}"))
        for key in result.kept_recent:
            print(shown(f"kept: s3://{uri.bucket}/{key}: {_kept_recent()}"))
    return 0


def _kept_recent() -> str:
    """Why ``rm`` kept an object of another directory that only the deleted checkpoint referenced."""
    from ..lifecycle.gc import DEFAULT_OLDER_THAN_S

    return (f"only this checkpoint referenced it, but it belongs to a save without a commit that was active less than "
            f"{format_age(DEFAULT_OLDER_THAN_S)} ago (gc's age rule): it may still be writing it; s3dcp gc removes it "
            "once it is older")


# ---------------------------------------------------------------------- materialize
def cmd_materialize(args) -> int:
    from ..lifecycle.materialize import materialize

    uri = parse_s3_uri(args.uri)
    result = materialize(str(uri), client=s3_client(args))
    if args.json:
        print_json(asdict(result))
    elif result.items:
        print(f"materialized {uri}: {result.items} item(s) now in {result.copied_objects} copied object(s) "
              f"({format_size(result.copied_bytes)}, server-side); {len(result.released)} unreferenced base "
              "object(s) freed")
    else:
        print(f"{uri} references no other checkpoint; nothing to do")
    return 0


# ---------------------------------------------------------------------- gc
def cmd_gc(args) -> int:
    from ..lifecycle.gc import gc

    uri = parse_s3_uri(args.uri)
    client = s3_client(args)
    report = gc(str(uri), older_than_s=args.older_than, client=client, dry_run=args.dry_run)
    skipped = _gc_skipped(uri, report, args.older_than)
    for key, upload_id in report.kept_recent_uploads:
        skipped.append({"prefix": f"s3://{uri.bucket}/{key}", "objects": None, "upload_id": upload_id,
                        "reason": f"its save was active less than --older-than {format_age(args.older_than)} ago (an "
                                  "object, the upload's start or its newest part): it may still be uploading"})
    if args.json:
        print_json({"uri": str(uri), "dry_run": args.dry_run, "older_than_s": args.older_than, **asdict(report),
                     "skipped": skipped})
        return 0
    verb = "would delete" if args.dry_run else "deleted"
    for key in report.deleted:
        print(shown(f"{verb}: s3://{uri.bucket}/{key}"))
    for key in report.stale_markers:
        print(shown(f"{verb}: s3://{uri.bucket}/{key} (pending references of an incremental save that never "
                    "committed)"))
    for key, upload_id in report.aborted_uploads:
        print(shown(f"{'would abort' if args.dry_run else 'aborted'} upload: s3://{uri.bucket}/{key} ({upload_id})"))
    for s in skipped:
        what = f"upload {s['upload_id']}" if "upload_id" in s else f"{s['objects']} object(s)" \
            if s["objects"] is not None else "metadata"
        print(shown(f"skipped: {s['prefix']} ({what}): {s['reason']}"))
    # the summary counts what the lines above list
    recent = f"skipped {len(report.kept_recent)} object(s) and {len(report.kept_recent_uploads)} upload(s) of " \
             f"saves active in the last {format_age(args.older_than)}"
    unreadable = (f"; {len(report.unreadable_metadata)} {METADATA_NAME} not s3dcp's or unreadable: nothing under "
                  "its run deleted") if report.unreadable_metadata else ""
    print(f"gc {uri}: {verb} {len(report.deleted)} object(s) ({format_size(report.deleted_bytes)}), "
          f"{'would abort' if args.dry_run else 'aborted'} {len(report.aborted_uploads)} upload(s); "
          f"{recent}{unreadable}")
    return 0


def _gc_skipped(uri: S3Uri, report, older_than_s: float) -> list[dict[str, Any]]:
    """What gc left alone and why, one entry per checkpoint directory."""
    recent: dict[str, int] = {}
    for key in report.kept_recent:
        directory = key.rpartition("/")[0]
        recent[directory] = recent.get(directory, 0) + 1
    skipped = [{"prefix": f"s3://{uri.bucket}/{d}/", "objects": n, "reason":
                f"unreferenced data newer than --older-than {format_age(older_than_s)}: a save may still be writing "
                "it; rerun gc later (or with a smaller --older-than once no save runs)"}
               for d, n in sorted(recent.items())]
    skipped += [{"prefix": f"s3://{uri.bucket}/{key.rpartition('/')[0]}/", "objects": None, "reason":
                 f"its {METADATA_NAME} is not s3dcp metadata (DCP's own pickle, say) or is corrupt: what it "
                 f"references is unknown, so nothing under s3://{uri.bucket}/{_parent(key)} is deleted; look at it "
                 "with s3dcp inspect"}
                for key in report.unreadable_metadata]
    return skipped


def _parent(key: str) -> str:
    """``"run/step-1/.metadata"`` -> ``"run/"`` (the run whose references that metadata may hold)."""
    parent = key.rpartition("/")[0].rpartition("/")[0]
    return f"{parent}/" if parent else ""
