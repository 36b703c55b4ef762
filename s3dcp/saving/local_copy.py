"""One rank's copy of one checkpoint in the node's local directory (the local tier).

    LocalCopy(local_dir, name, base, step, required=...)
      begin(rank)            write_data: the rank's directory made empty (a copy without its
                             marker is never selected, so an earlier partial one just goes)
      write(object, bytes)   each object as it is uploaded (or instead of uploading: a local-only
                             step), the same bytes under the same name as in S3
      prepare(metadata)      after the save returned on this rank: .metadata written, every object
                             this rank's items name checked there at its size; the marker to seal
      seal(marker)           once every rank agreed (lifecycle/tiers.py): the marker, renamed into
                             place last
      discard()              a failed save: the marker first, then the directory

A copy that is not ``required`` (the step also goes to S3) never fails the save: the first
local error (a full disk, a directory gone) is kept in :attr:`LocalCopy.failure`, the rest of the
copy is skipped, and the S3 upload goes on. A required one (a step kept only on the nodes)
raises :class:`~s3dcp.errors.LocalCopyError`.

Everything is private to the job: directories 0700, files 0600, created without following a
link planted at their name. Owns writing the files; it must not decide which step is kept
locally or sent to S3 (the manager's tiers, :mod:`s3dcp.lifecycle.tiers`) nor read copies back
(:mod:`s3dcp.loading.tiered`). Picklable (paths only): DCP's process executor writes through it
in the child process, and :meth:`prepare`, in the parent, checks what the child wrote. Imports
no torch (the manager, which ``s3dcp ls`` and ``rm`` import, holds one).
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Iterable

from ..errors import UNREACHABLE, IncompleteCheckpointError, LocalCopyError
from ..format.layout import object_sizes, parse_object_name
from ..format.local import LOCAL_METADATA_NAME, MARKER_NAME, LocalMarker, rank_dir_name

__all__ = ["LocalCopy", "kept_on_nodes", "make_private_dirs", "not_committed", "remove_copy", "write_private"]

log = logging.getLogger("s3dcp")

_WRITE_SLICE = 64 << 20
_NOT_COMMITTED = "s3dcp_not_committed"  # set on DCP's Metadata by the writer's finish: why S3 holds no commit
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def make_private_dirs(directory: Path) -> None:
    """``directory`` and every missing parent, each 0700 (a umask only takes bits away)."""
    missing = []
    while not directory.is_dir():
        missing.append(directory)
        directory = directory.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=0o700)
        except FileExistsError:  # another rank of the node made it just now
            if not d.is_dir():
                raise


def write_private(path: Path, data: bytes) -> None:
    """``data`` as the file ``path``, 0600, never through a link planted at that name."""
    fd = os.open(path, _CREATE, 0o600)
    try:
        view = memoryview(data)
        while view.nbytes:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def remove_copy(directory: Path) -> None:
    """Delete a rank's copy: its marker first, so that a scan on another rank of the node sees a
    copy being deleted as one without a marker (skipped quietly), never as a partial one."""
    try:
        (directory / MARKER_NAME).unlink()
    except OSError:
        pass
    shutil.rmtree(directory, ignore_errors=True)


class LocalCopy:
    """Rank ``rank``'s objects of checkpoint ``step`` (directory ``name``) of run ``base`` under
    ``local_dir`` (see the module docstring for the order of calls). ``required``: the step is
    kept only on the nodes, so a local failure fails the save."""

    def __init__(self, local_dir: str | os.PathLike, name: str, base: str, step: int, *,
                 required: bool = True) -> None:
        self.root = Path(local_dir) / name
        self.base = base
        self.step = step
        self.required = required
        self.rank: int | None = None
        self.refusal: BaseException | None = None  # why the tier cannot take this copy (begin raises or skips)
        self.failure: LocalCopyError | None = None  # the first local error of a copy that is not required
        self._prepared: LocalMarker | None = None  # the marker prepare() wrote beside its place

    @property
    def dir(self) -> Path:
        if self.rank is None:
            raise RuntimeError("LocalCopy.begin(rank) was not called")
        return self.root / rank_dir_name(self.rank)

    def begin(self, rank: int) -> None:
        self.rank = rank
        if self.refusal is not None:  # no room: a ConfigError naming the budget or the disk
            if self.required:
                raise self.refusal
            return self._fail(self.refusal)
        try:
            remove_copy(self.dir)
            make_private_dirs(self.dir)
        except OSError as e:
            self._fail(e)

    def write(self, name: str, buffers: Iterable) -> int:
        """Write ``buffers`` (byte views, back to back) as object ``name``; its size (0 once the
        copy failed)."""
        if self.failure is not None:
            return 0
        written = 0
        try:
            fd = os.open(self.dir / name, _CREATE, 0o600)
            try:
                for buffer in buffers:
                    view = memoryview(buffer).cast("B")
                    for at in range(0, view.nbytes, _WRITE_SLICE):
                        piece = view[at:at + _WRITE_SLICE]
                        while piece.nbytes:
                            piece = piece[os.write(fd, piece):]
                    written += view.nbytes
            finally:
                os.close(fd)
        except OSError as e:
            self._fail(e, f"writing {name}")
            return 0
        return written

    def prepare(self, metadata: bytes, locations, *, save_id: str, world_size: int, in_s3: bool,
                saved_at: float) -> LocalMarker | None:
        """Write the checkpoint's ``metadata`` into the copy, check that every object the save's
        item ``locations`` name for this rank is there at its size (DCP's process executor wrote
        them in another process), and write the marker beside its place; the marker :meth:`seal`
        puts in place, or None when the copy failed (:attr:`failure` says why; a required copy
        raises)."""
        if self.failure is not None:
            return None
        marker = None
        try:
            expected = {name: size for name, size in object_sizes(locations).items()
                        if (parsed := parse_object_name(name)) is not None and parsed.rank == self.rank}
            objects = {name: (self.dir / name).stat().st_size for name in expected}
            if objects != expected:
                short = sorted(n for n in expected if objects[n] != expected[n])
                raise OSError(f"objects of another size than the save's: {short[:3]}")
            write_private(self.dir / LOCAL_METADATA_NAME, metadata)
            marker = LocalMarker(base=self.base, step=self.step, save_id=save_id, rank=self.rank,
                                 world_size=world_size, objects=objects, in_s3=in_s3, saved_at=saved_at)
            write_private(self.dir / f"{MARKER_NAME}.tmp", marker.encode())
            self._prepared = marker
        except OSError as e:
            self._fail(e, "committing it")
            return None
        return marker

    def seal(self, marker: LocalMarker) -> None:
        """Make the copy complete: the marker :meth:`prepare` wrote (or ``marker``, where it says
        otherwise), renamed into place last. Never raises (every rank decided to seal): a copy
        that cannot be sealed is left without its marker (never selected), and said so."""
        tmp = self.dir / f"{MARKER_NAME}.tmp"
        try:
            if marker != self._prepared:
                write_private(tmp, marker.encode())
            os.replace(tmp, self.dir / MARKER_NAME)
        except OSError as e:
            self.failure = self.failure or LocalCopyError(f"local copy {self.dir} of checkpoint step {self.step}: "
                                                          f"its marker could not be written: {e}")
            log.warning("%s; the copy is not used", self.failure)

    def discard(self) -> None:
        if self.rank is not None:
            remove_copy(self.dir)
            try:
                self.root.rmdir()  # the step's directory, once no rank's copy is in it
            except OSError:
                pass

    def _fail(self, error: BaseException, doing: str = "") -> None:
        """Record (or, for a required copy, raise) the first local failure, as LocalCopyError."""
        if isinstance(error, LocalCopyError):
            failure = error
        else:
            failure = LocalCopyError(
                f"local copy {self.root / rank_dir_name(self.rank if self.rank is not None else 0)} of checkpoint "
                f"step {self.step}{f' ({doing})' if doing else ''}: {type(error).__name__}: {error}")
            failure.__cause__ = error
        if self.required:
            raise failure
        if self.failure is None:
            self.failure = failure
            log.warning("%s; the step still goes to S3", failure)


def kept_on_nodes(copy: LocalCopy | None, metadata, error: BaseException, uri) -> bool:
    """Whether a commit to ``uri`` that failed with ``error`` leaves the checkpoint to the nodes'
    copies: there are some, and S3 could not be reached (or a rank's upload could not, so its
    objects are missing). Then it is marked on DCP's ``metadata`` (:func:`not_committed`), not
    raised: the manager's tier seals the copies as a step not in S3, and says so."""
    if copy is None or not isinstance(error, (*UNREACHABLE, IncompleteCheckpointError)):
        return False
    if isinstance(error, IncompleteCheckpointError):  # another rank's upload failed, as its own log says
        why = "IncompleteCheckpointError: a rank's objects did not all reach S3 (that rank's log says why)"
    else:
        why = f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"
    setattr(metadata, _NOT_COMMITTED, why)
    log.debug("checkpoint %s was not committed to S3 (%s); the nodes' local copies keep it", uri, why)
    return True


def not_committed(metadata) -> str | None:
    """Why a save with local copies returned without committing to S3, or None. DCP hands every
    rank the coordinator's metadata, this included (the process executor's parent too)."""
    return getattr(metadata, _NOT_COMMITTED, None)
