"""The commit's check of what it commits: every object the metadata names is in the bucket, at
its size, before the metadata object is written (:meth:`S3StorageWriter.finish
<s3dcp.saving.writer.S3StorageWriter.finish>`).

Owns that check; it must not commit or delete anything.
"""

from __future__ import annotations

from ..errors import IncompleteCheckpointError
from ..format import layout
from ..format.references import is_reference
from ..s3.client import S3Client
from ..uri import S3Uri, object_key
from .base import BaseIndex

__all__ = ["check_objects"]


def check_objects(client: S3Client, uri: S3Uri, locations, base: BaseIndex | None) -> None:
    """Refuse to commit unless every object the metadata names is there with its size:
    this save's own objects exactly the size their items add up to; a referenced object of
    the base exactly the size the base's metadata gives it, one the base itself references
    at least as large as the base's items in it reach (:meth:`BaseIndex.object_sizes`).
    One LIST per directory. Catches objects deleted or replaced by someone else (a
    misjudged cleanup, a deleted base) between upload and commit."""
    expected = layout.object_sizes(locations)
    base_sizes = base.object_sizes() if base is not None and \
        any(is_reference(name) for name in expected) else {}
    by_dir: dict[str, dict[str, tuple[str, int, bool]]] = {}  # listing prefix -> key -> (name, size, exact)
    for name, size in expected.items():
        key = object_key(uri, name)
        directory = key.rpartition("/")[0]
        exact = not is_reference(name)
        if not exact and name in base_sizes:
            recorded, exact = base_sizes[name]
            size = max(size, recorded)
        by_dir.setdefault(f"{directory}/" if directory else "", {})[key] = (name, size, exact)
    listings = {d: client.list(uri.bucket, d, delimiter="/") for d in by_dir}
    missing, wrong = [], []
    for directory, wanted in sorted(by_dir.items()):
        found = {o.key: o.size for o in listings[directory].result()[0]}
        for key, (name, size, exact) in sorted(wanted.items()):
            where = f"s3://{uri.bucket}/{key}"
            if key not in found:
                missing.append(where)
            elif (found[key] != size) if exact else (found[key] < size):
                wrong.append(f"{where} ({found[key]} bytes, expected {'' if exact else 'at least '}{size})")
    if missing or wrong:
        problems = []
        if missing:
            problems.append(f"{len(missing)} missing: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
        if wrong:
            problems.append(f"{len(wrong)} of the wrong size: {', '.join(wrong[:5])}")
        raise IncompleteCheckpointError(
            f"refusing to commit {uri}: objects the metadata references are not all there "
            f"({'; '.join(problems)}). Something deleted or replaced them during the save (a "
            "cleanup run with a short --older-than, or a deleted incremental base?); nothing was "
            "committed — save again")
