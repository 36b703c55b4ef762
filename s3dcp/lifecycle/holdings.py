"""What a node's ``local_dir`` holds, for the local tier (:mod:`s3dcp.lifecycle.tiers`): its
complete copies (:func:`scan`), the one save a restore takes (:func:`choose_save`), and whether
a copy's bytes match the items' checksums (:func:`check_copy`).
Everything in ``local_dir`` is read as untrusted input: a copy is complete only when its marker
decodes, names this run, step and rank, and every object it names is there at its size.
"""

from __future__ import annotations

import logging
import mmap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..errors import MetadataFormatError
from ..format import integrity
from ..format.local import LOCAL_METADATA_NAME, MARKER_NAME, MAX_MARKER_BYTES, LocalMarker, parse_rank_dir

__all__ = ["Choice", "S3View", "check_copy", "choose_save", "entries", "held", "scan", "stale_copies"]

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
        if marker_path.exists():  # else it is being deleted (marker first): nothing to say
            log.warning("local copy %s is partial (a file missing or of another size); not used", rank_dir)
        return None
    return marker


@dataclass(frozen=True)
class S3View:
    """What the restore learned of S3: the committed steps, and the save id of those whose
    ``.metadata`` it read (the step a restore would take from S3)."""

    steps: frozenset
    save_ids: dict = field(default_factory=dict)  # step -> save id


@dataclass(frozen=True)
class Choice:
    """The one save a restore reads: its step, its save id, whether S3 committed it, and the
    copies on the nodes it leaves out, each with why: (node, step, saving rank, why)."""

    step: int
    save_id: str
    in_s3: bool
    ignored: tuple = ()


def stale_copies(reports: list[tuple[str, dict]], s3: S3View | None,
                 excluded: frozenset = frozenset()) -> dict[tuple, str]:
    """(node, step, saving rank) -> why, of every copy a restore leaves out whatever step it
    takes (rules 1 and 2 of :func:`choose_save`; ``reports``, ``s3`` and ``excluded`` as there).
    ``s3dcp ls --local-dir`` names them for every step."""
    ignored: dict[tuple, str] = {}
    saves: dict[tuple[int, str], dict] = {}  # (step, save id) -> {"first", "last"}: the saving ranks' clocks
    seen = {(node, step, rank): m for node, report in reports for (step, rank), m in report.items()}
    for (node, step, rank), m in sorted(seen.items()):
        save = saves.setdefault((step, m.save_id), {"first": m.saved_at, "last": m.saved_at})
        save["first"], save["last"] = min(save["first"], m.saved_at), max(save["last"], m.saved_at)
        if (node, step, rank) in excluded:
            continue
        if s3 is not None and step in s3.save_ids and m.save_id != s3.save_ids[step]:
            ignored[(node, step, rank)] = f"another save of step {step} than the one S3 committed"
        elif s3 is not None and m.in_s3 and step not in s3.steps:
            ignored[(node, step, rank)] = f"step {step} went to S3 and was deleted there since"
    for (step, save_id), save in saves.items():
        if any(s <= step and i != save_id and other["first"] > save["last"] for (s, i), other in saves.items()):
            for (node, s, rank), m in seen.items():
                if s == step and m.save_id == save_id and (node, s, rank) not in excluded:
                    ignored.setdefault((node, s, rank), f"step {step} was saved again, or an earlier one, after it")
    return ignored


def choose_save(reports: list[tuple[str, dict]], s3: S3View | None, *, wanted: int | None = None,
                excluded: frozenset = frozenset()) -> Choice | None:
    """The save a restore takes (see docs/restart.md, "How a restore decides"): the newest step
    (or ``wanted``) that the tiers together hold in full, and of that step one save.

    ``reports``: each rank's (node, {(step, saving rank): LocalMarker}) of the complete copies on
    its node; ``s3``: what S3 holds, or None when it could not be consulted; ``excluded``:
    (node, step, saving rank) of the copies found corrupt there. The rules, in order:

    1. S3's save is the truth for a step S3 committed: a node's copy of another save of it is
       stale. A copy whose marker says it went to S3, of a step S3 no longer holds, was deleted
       there on purpose (``s3dcp rm``, retention): not used either (unless S3 is unreachable).
    2. A save is superseded by a save made later (by the saving ranks' clocks) at the same or an
       earlier step: the run went back (a rollback, or a fresh start) after it, so it belongs to
       a line of training that was abandoned; its copies are not used.
    3. A save is held in full when every saving rank's copy (one world size) is on some node;
       S3's saves always are. Of the newest step held in full, S3's save where S3 has it, else
       the one made last.
    """
    ignored = stale_copies(reports, s3, excluded)  # rules 1 and 2
    saves: dict[tuple[int, str], dict] = {}  # (step, save id) -> {"ranks", "world", "last"} of its usable copies
    for node, report in reports:
        for (step, rank), m in report.items():
            if (node, step, rank) not in excluded and (node, step, rank) not in ignored:
                save = saves.setdefault((step, m.save_id), {"ranks": set(), "world": set(), "last": m.saved_at})
                save["ranks"].add(rank)
                save["world"].add(m.world_size)
                save["last"] = max(save["last"], m.saved_at)
    whole = {}  # step -> (save id, made last)
    for (step, save_id), save in saves.items():
        if len(save["world"]) == 1 and save["ranks"] == set(range(next(iter(save["world"])))):
            if step not in whole or save["last"] > whole[step][1]:
                whole[step] = (save_id, save["last"])
    for step in sorted(set(whole) | (s3.steps if s3 is not None else set()), reverse=True):
        if wanted is not None and step != wanted:
            continue
        in_s3 = s3 is not None and step in s3.steps
        save_id = s3.save_ids.get(step, "") if in_s3 else whole[step][0]
        return Choice(step, save_id, in_s3, tuple(sorted((*k, why) for k, why in ignored.items() if k[1] == step)))
    return None


def held(reports: list[tuple[str, dict]], s3: S3View | None) -> str:
    """What the tiers hold, for a message: S3's committed steps and the steps of the copies on
    the nodes."""
    local = sorted({step for _, report in reports for (step, _) in report})
    s3_part = "S3 could not be consulted" if s3 is None else \
        f"S3 holds step(s) {_steps(sorted(s3.steps))}" if s3.steps else "S3 holds none"
    return f"{s3_part}; the nodes hold copies of step(s) {_steps(local)}" if local else \
        f"{s3_part}; the nodes hold no copy"


def _steps(steps: list[int]) -> str:
    return ", ".join(map(str, steps[-10:])) + (f" (and {len(steps) - 10} older)" if len(steps) > 10 else "")


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
