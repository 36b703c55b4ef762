"""What a node's ``local_dir`` holds, for the local tier (:mod:`s3dcp.lifecycle.tiers`): its
complete copies (:func:`scan`), the newest step the tiers hold in full between them
(:func:`choose_step`), and whether a copy's bytes match the items' checksums (:func:`check_copy`).
Everything in ``local_dir`` is read as untrusted input: a copy is complete only when its marker
decodes, names this run, step and rank, and every object it names is there at its size.
"""

from __future__ import annotations

import logging
import mmap
from pathlib import Path
from typing import Callable

from ..errors import MetadataFormatError
from ..format import integrity
from ..format.local import LOCAL_METADATA_NAME, MARKER_NAME, MAX_MARKER_BYTES, LocalMarker, parse_rank_dir

__all__ = ["check_copy", "choose_step", "entries", "scan"]

log = logging.getLogger("s3dcp")


def scan(local_dir: Path, base: str, step_of: Callable[[str], int | None]) -> dict[tuple[int, int], tuple]:
    """The complete copies in ``local_dir`` of run ``base``: (step, saving rank) -> (marker,
    directory). Complete: the marker reads, names this run and step, and every object it names
    is there at its size. Anything else is left out (a save that died mid-write)."""
    found = {}
    for step_dir in entries(local_dir):
        step = step_of(step_dir.name)
        if step is None:
            continue
        for rank_dir in entries(step_dir):
            rank = parse_rank_dir(rank_dir.name)
            if rank is None:
                continue
            copy = _complete_copy(rank_dir, base, step, rank)
            if copy is not None:
                found[(step, rank)] = (copy, rank_dir)
    return found


def entries(directory: Path) -> list[Path]:
    """A directory's entries; none where it is not there (any more: another rank's retention,
    or this rank's own after an async commit, may be deleting it now)."""
    try:
        return list(directory.iterdir())
    except OSError:
        return []


def _complete_copy(rank_dir: Path, base: str, step: int, rank: int) -> LocalMarker | None:
    """The marker of the copy in ``rank_dir`` if it is complete (see :func:`scan`), else None."""
    marker_path = rank_dir / MARKER_NAME
    try:
        with open(marker_path, "rb") as f:
            data = f.read(MAX_MARKER_BYTES + 1)  # bounded: decode refuses more
        marker = LocalMarker.decode(data, str(marker_path))
    except (FileNotFoundError, NotADirectoryError):
        return None  # not written yet (a save in progress), or being deleted
    except (MetadataFormatError, OSError) as e:
        log.warning("local copy %s is unreadable (%s); not used", rank_dir, e)
        return None
    if marker.base != base or marker.step != step or marker.rank != rank:
        return None
    try:
        sizes = {name: (rank_dir / name).stat().st_size for name in marker.objects}
        intact = (rank_dir / LOCAL_METADATA_NAME).is_file() and sizes == marker.objects
    except OSError:
        intact = False
    if not intact:
        log.warning("local copy %s is partial (a file missing or of another size); not used", rank_dir)
        return None
    return marker


def choose_step(reports: list[tuple[str, dict]], in_s3: set[int], *, wanted: int | None = None,
                excluded: frozenset = frozenset()) -> int | None:
    """The newest step (or ``wanted``) that the tiers together hold in full: in S3, or every
    saving rank's copy (one save, one world size) held by some node. ``reports``: each rank's
    (node, {(step, saving rank): (save id, world size, objects)}); ``excluded``: (node, step,
    saving rank) of the copies found corrupt there."""
    held: dict[int, dict[int, tuple]] = {}
    for node, report in reports:
        for (step, rank), (save_id, world_size, *_) in report.items():
            if (node, step, rank) not in excluded:
                held.setdefault(step, {}).setdefault(rank, (save_id, world_size))
    candidates = sorted(set(held) | in_s3, reverse=True)
    if wanted is not None:
        candidates = [s for s in candidates if s == wanted]
    for step in candidates:
        if step in in_s3:
            return step
        idents = set(held[step].values())
        if len(idents) == 1 and set(held[step]) == set(range(next(iter(idents))[1])):
            return step
    return None


def check_copy(rank_dir: Path, marker: LocalMarker, locations) -> str | None:
    """What is wrong with a copy's bytes, or None: every item stored in one of its objects
    checked against its checksum (items without one: against their object's size)."""
    by_object: dict[str, list] = {}
    for loc in locations:
        if loc.object_name in marker.objects:
            by_object.setdefault(loc.object_name, []).append(loc)
    for name, locs in by_object.items():
        path = rank_dir / name
        size = path.stat().st_size
        if not size:
            continue
        with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as m:
            view = memoryview(m)
            try:
                for loc in locs:
                    if loc.offset + loc.length > size:
                        return f"{name}: item at {loc.offset}+{loc.length} past the file's {size} bytes"
                    if loc.checksum:
                        algorithm = integrity.algorithm_of(loc.checksum)
                        if integrity.checksum(algorithm, view[loc.offset:loc.offset + loc.length]) != loc.checksum:
                            return f"{name}: the item at offset {loc.offset} does not match its checksum"
            finally:
                view.release()
    return None
