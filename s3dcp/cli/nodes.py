"""A node's copies of checkpoints (a CheckpointManager's ``local_dir``) as the ``s3dcp`` command
shows them beside S3's: ``ls --local-dir``, ``verify --local-dir`` and ``inspect --local-dir``.

    survey(local_dir)          every rank directory with a marker: a Copy (run, step, save,
                               rank, complete here or why not), and what could not be read
    s3_view(client, run, ...)  what S3 holds of a run: its committed steps and their save ids
    judge(copies, view, node)  per step and save: the ranks this node holds, size, S3's say, and
                               why a restore would not use them (stale_copies: choose_save's rules)
    restart(copies, view, node)  the save a restart would take given S3 and this node's copies
                               (lifecycle/holdings.choose_save over this node's report)

``local_dir`` is read as untrusted input: links are never followed below it (s3dcp writes none),
markers are read bounded and decoded by :class:`~s3dcp.format.local.LocalMarker`, a marker's
object names never leave its directory. The step directory's name is the checkpoint's name
under its run in S3 (the manager's ``name_format``), so a run's steps in S3 are told by the
shape of its copies' names. Imports no torch.
"""

from __future__ import annotations

import errno
import os
import re
import socket
import stat
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CheckpointNotFoundError, IncompleteCheckpointError, MetadataFormatError, S3DCPError
from ..format.local import LOCAL_METADATA_NAME, MARKER_NAME, MAX_MARKER_BYTES, LocalMarker, parse_rank_dir
from ..lifecycle.holdings import Choice, S3View, choose_save, stale_copies
from ..uri import S3Uri, parse_s3_uri
from .common import UsageError, plain_metadata

__all__ = ["Copy", "Survey", "SaveRow", "RunOnNode", "survey", "runs_on_node", "s3_view", "judge", "restart",
           "report", "node", "ranks_text", "read_private", "MAX_LOCAL_METADATA_BYTES"]

MAX_LOCAL_METADATA_BYTES = 256 << 20  # a real one is a few MB (4.3 MB for 1,024 ranks x 900 tensors)
_DIGITS = re.compile(r"\d+")


def node() -> str:
    """This node, as the copies' reports name it."""
    return socket.gethostname()


@dataclass(frozen=True)
class Copy:
    """One ``rank-<R>`` directory of ``local_dir`` whose marker decodes. ``problem``: why a
    restore does not take it whatever S3 holds (a file missing, a marker for another place), or
    None when it is complete where it is."""

    path: Path  # local_dir/<name>/rank-<R>
    name: str  # its step directory's name: the checkpoint's name under its run
    marker: LocalMarker
    run: S3Uri  # the marker's base
    problem: str | None = None

    @property
    def uri(self) -> S3Uri:
        return self.run.child(self.name)

    @property
    def step(self) -> int:
        return self.marker.step


@dataclass
class Survey:
    """What ``local_dir`` holds: the copies with a marker, and the rank directories a restore
    cannot use for any run: (path, why)."""

    local_dir: Path
    copies: list = field(default_factory=list)
    unusable: list = field(default_factory=list)

    def runs(self, within: S3Uri | None = None) -> dict[str, list[Copy]]:
        """The copies by run (its URI as text), of the runs at or under ``within``."""
        out: dict[str, list[Copy]] = {}
        for c in self.copies:
            if within is None or _under(c.run, within):
                out.setdefault(str(c.run), []).append(c)
        return out


def survey(local_dir: str | os.PathLike) -> Survey:
    """Every ``<step dir>/rank-<R>`` of ``local_dir`` with its marker (see the module docstring);
    UsageError when ``local_dir`` is not a directory."""
    root = Path(local_dir)
    if not root.is_dir():  # the path given may be a link (the user's own); nothing below it is followed
        raise UsageError(f"--local-dir {str(root)!r} is not a directory (a CheckpointManager's local_dir)")
    found = Survey(root)
    for step_dir in _dirs(root):
        for rank_dir in _dirs(step_dir):
            rank = parse_rank_dir(rank_dir.name)
            if rank is None:
                continue
            try:
                data = read_private(rank_dir / MARKER_NAME, MAX_MARKER_BYTES + 1)
            except FileNotFoundError:
                found.unusable.append((rank_dir, "no marker: a save that is still writing it, or one that died "
                                                 "(the next save's retention removes it)"))
                continue
            except OSError as e:
                found.unusable.append((rank_dir, f"its marker cannot be read: {_oserror(e)}"))
                continue
            try:
                marker = LocalMarker.decode(data, str(rank_dir / MARKER_NAME))
                run = parse_s3_uri(marker.base)
            except (MetadataFormatError, ValueError) as e:
                found.unusable.append((rank_dir, f"its marker is unreadable: {e}"))
                continue
            found.copies.append(Copy(rank_dir, step_dir.name, marker, run, _problem(rank_dir, rank, marker)))
    return found


def read_private(path: Path, limit: int) -> bytes:
    """At most ``limit`` bytes of the regular file ``path``, never through a link (ELOOP).
    O_NONBLOCK: a FIFO put there opens at once (and is refused) instead of waiting for a writer."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        chunks, left = [], limit
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _dirs(directory: Path) -> list[Path]:
    """The real directories in ``directory`` (links are left out), by name."""
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []  # not there any more (retention deleting it), or unreadable
    out = []
    for name in names:
        try:
            if stat.S_ISDIR(os.lstat(directory / name).st_mode):
                out.append(directory / name)
        except OSError:
            pass
    return out


def _problem(rank_dir: Path, rank: int, marker: LocalMarker) -> str | None:
    """Why the copy in ``rank_dir`` is not complete where it is (as a restore's scan judges it,
    links aside), or None."""
    if marker.rank != rank:
        return f"its marker is of rank {marker.rank}, its directory of rank {rank}: not used"
    if _step_in(rank_dir.parent.name, marker.step) is None:
        return f"its marker is of step {marker.step}, which its directory's name does not hold: not used"
    for name in (LOCAL_METADATA_NAME, *sorted(marker.objects)):
        try:
            st = os.lstat(rank_dir / name)
        except FileNotFoundError:
            return f"{name} is missing: not used"
        except OSError as e:
            return f"{name} cannot be read ({_oserror(e)}): not used"
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISREG(st.st_mode):
            return f"{name} is not a regular file (s3dcp writes no links): not used"
        if name != LOCAL_METADATA_NAME and st.st_size != marker.objects[name]:
            return f"{name} holds {st.st_size} bytes, its marker says {marker.objects[name]}: not used"
    return None


def _oserror(e: OSError) -> str:
    return "a link, not followed" if e.errno == errno.ELOOP else (e.strerror or str(e))


def _under(run: S3Uri, within: S3Uri) -> bool:
    return run.bucket == within.bucket and (run.prefix == within.prefix or run.prefix.startswith(within.dir_prefix))


def _step_in(name: str, step: int) -> tuple[str, str] | None:
    """``name`` around the digits that give ``step`` (the last such run): (before, after), or None."""
    spans = [m.span() for m in _DIGITS.finditer(name) if int(m.group()) == step]
    return (name[:spans[-1][0]], name[spans[-1][1]:]) if spans else None


def step_of(copies: list[Copy], relative: str) -> int | None:
    """The step of the checkpoint named ``relative`` under the run of ``copies``, by the shape of
    its copies' names (``step-00000024`` makes ``step-00000018`` step 18), or None."""
    for before, after in {_step_in(c.name, c.step) for c in copies} - {None}:
        if len(relative) > len(before) + len(after) and relative.startswith(before) and relative.endswith(after):
            middle = relative[len(before):len(relative) - len(after)]
            if middle.isascii() and middle.isdigit():
                return int(middle)
    return None


# ---------------------------------------------------------------------- S3's side
def s3_view(client, run: S3Uri, committed: dict[int, str], wanted: set[int]) -> tuple[S3View, list[str]]:
    """What S3 holds of ``run``: ``committed`` (step -> the checkpoint's name under ``run``, of the
    steps whose ``.metadata`` S3 holds) with the save id of each step in ``wanted`` (and of the
    newest: the one a restore reads) read from its ``.metadata``; and notes on what could not be."""
    save_ids, notes = {}, []
    newest = {max(committed)} if committed else set()
    for step in sorted((wanted & set(committed)) | newest):
        uri = run.child(committed[step])
        try:
            meta = plain_metadata(client, uri).storage_meta
        except (CheckpointNotFoundError, IncompleteCheckpointError):
            continue  # deleted since the listing
        except S3DCPError as e:
            notes.append(f"{uri}: its save is not known ({' '.join(str(e).split())[:300]})")
            continue
        if meta is not None and meta.save_id:
            save_ids[step] = meta.save_id
    return S3View(frozenset(committed), save_ids), notes


# ---------------------------------------------------------------------- judging
@dataclass(frozen=True)
class SaveRow:
    """One save of one step on this node: the ranks whose complete copies it holds (``ranks``,
    of ``world_size``), or one copy that is not complete here (state "not used", ``why``)."""

    step: int
    name: str
    save_id: str
    ranks: tuple
    world_size: int
    nbytes: int
    s3: str  # "committed", "another save", "deleted", "not sent", "step in S3"
    state: str  # "complete", "partial", "stale", "not used"
    why: str | None
    paths: tuple
    saved_at: float

    def as_json(self, run: str) -> dict:
        return {"run": run, "uri": str(parse_s3_uri(run).child(self.name)), "step": self.step, "name": self.name,
                "save_id": self.save_id, "ranks": list(self.ranks), "world_size": self.world_size,
                "bytes": self.nbytes, "s3": self.s3, "state": self.state, "why": self.why,
                "paths": [str(p) for p in self.paths], "saved_at": self.saved_at}


def report(copies: list[Copy]) -> dict:
    """This node's report for choose_save: (step, saving rank) -> marker of the complete copies."""
    return {(c.step, c.marker.rank): c.marker for c in copies if c.problem is None}


def judge(copies: list[Copy], view: S3View, here: str) -> list[SaveRow]:
    """The rows of one run's ``copies`` on node ``here`` (see :class:`SaveRow`), by step."""
    why = stale_copies([(here, report(copies))], view)
    groups: dict[tuple[str, str], list[Copy]] = {}
    rows = []
    for c in copies:
        if c.problem is None:
            groups.setdefault((c.name, c.marker.save_id), []).append(c)
        else:
            rows.append(_row([c], _s3_say(c.step, c.marker.save_id, [c], view), "not used", c.problem))
    for group in groups.values():
        reasons = sorted({why[(here, c.step, c.marker.rank)] for c in group if (here, c.step, c.marker.rank) in why})
        worlds = {c.marker.world_size for c in group}
        ranks = {c.marker.rank for c in group}
        whole = len(worlds) == 1 and ranks == set(range(next(iter(worlds))))
        state = "stale" if reasons else "complete" if whole else "partial"
        rows.append(_row(group, _s3_say(group[0].step, group[0].marker.save_id, group, view), state,
                         "; ".join(reasons) or (None if whole else "other nodes may hold the other ranks")))
    return sorted(rows, key=lambda r: (r.step, r.saved_at, r.name, r.ranks))


def _row(group: list[Copy], s3: str, state: str, why: str | None) -> SaveRow:
    first = group[0]
    return SaveRow(first.step, first.name, first.marker.save_id, tuple(sorted(c.marker.rank for c in group)),
                   max(c.marker.world_size for c in group), sum(c.marker.nbytes for c in group), s3, state, why,
                   tuple(c.path for c in group), max(c.marker.saved_at for c in group))


def _s3_say(step: int, save_id: str, group: list[Copy], view: S3View) -> str:
    if step in view.steps:
        known = view.save_ids.get(step)
        return "step in S3" if known is None else "committed" if known == save_id else "another save"
    return "deleted" if any(c.marker.in_s3 for c in group) else "not sent"


def ranks_text(ranks, world_size: int) -> str:
    """``(0, 1, 2, 3, 6)``, 8 -> ``"0-3, 6 of 8"``."""
    spans: list[list[int]] = []
    for r in sorted(ranks):
        if spans and spans[-1][1] == r - 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans) + f" of {world_size}"


def restart(copies: list[Copy], view: S3View, here: str, rows: list[SaveRow]) -> tuple[Choice | None, str]:
    """The save a restart takes given S3 and this node's copies (choose_save, as a restore
    decides), and a line that says it."""
    choice = choose_save([(here, report(copies))], view)
    newer = [r for r in rows if r.state == "partial" and (choice is None or r.step > choice.step)]
    hint = ""
    if newer:
        r = max(newer, key=lambda r: (r.step, r.saved_at))
        hint = (f"; this node holds part of step {r.step} (ranks {ranks_text(r.ranks, r.world_size)}): other nodes "
                "may hold the rest, and then a restart takes that step")
    if choice is None:
        return None, f"restart: no step: S3 holds none of this run and this node no save in full{hint}"
    if not choice.in_s3:
        return choice, f"restart: step {choice.step} from the nodes' copies (not in S3){hint}"
    mine = [r for r in rows if r.step == choice.step and r.save_id == choice.save_id
            and r.state in ("complete", "partial")]
    if any(r.state == "complete" for r in mine):
        where = " (read from this node's copies)"
    elif mine:
        r = mine[0]
        where = f" (this node holds ranks {ranks_text(r.ranks, r.world_size)} of it)"
    else:
        where = ""
    return choice, f"restart: step {choice.step} from S3{where}{hint}"


# ---------------------------------------------------------------------- a run, as ls shows it
@dataclass(frozen=True)
class RunOnNode:
    """One run's copies on this node beside S3 (``s3dcp ls --local-dir``): the rows, the save a
    restart takes and the line that says it, and notes on what S3 could not tell."""

    run: str
    rows: list
    choice: Choice | None
    line: str
    notes: list

    def restart_json(self) -> dict:
        c = self.choice
        return {"run": self.run, "step": None if c is None else c.step, "save_id": None if c is None else c.save_id,
                "from": None if c is None else "s3" if c.in_s3 else "nodes", "text": self.line}


def runs_on_node(found: Survey, within: S3Uri, client, committed: set[str]) -> dict[str, RunOnNode]:
    """Each run at or under ``within`` with copies in ``found``, judged against S3 (``committed``:
    the URIs, as text, of the checkpoints S3 holds a ``.metadata`` of, from the listing)."""
    here = node()
    out = {}
    for run, copies in sorted(found.runs(within).items()):
        steps = {}
        for uri in committed:
            if uri.startswith(f"{run}/"):
                step = step_of(copies, uri[len(run) + 1:])
                if step is not None:
                    steps[step] = uri[len(run) + 1:]
        view, notes = s3_view(client, copies[0].run, steps, {c.step for c in copies})
        rows = judge(copies, view, here)
        choice, line = restart(copies, view, here, rows)
        out[run] = RunOnNode(run, rows, choice, line, notes)
    return out
