"""One rank's copy of one checkpoint in the node's local directory (the local tier).

    LocalCopy(local_dir, name, base, step)
      begin(rank)            write_data: the rank's directory made empty (a copy without its
                             marker is never selected, so an earlier partial one just goes)
      write(object, bytes)   each object as it is uploaded (or instead of uploading: a local-only
                             step), the same bytes under the same name as in S3
      commit(...)            after the save returned on this rank: .metadata, then the marker
                             (format/local.py), renamed into place last
      discard()              a failed save: the directory goes

Owns writing the files; it must not decide which step is kept locally or sent to S3 (the
manager's tiers, :mod:`s3dcp.lifecycle.tiers`) nor read copies back (:mod:`s3dcp.loading.tiered`).
Picklable (paths only): DCP's process executor writes through it in the child process, and the
commit, in the parent, lists what the child wrote. Imports no torch (the manager, which
``s3dcp ls`` and ``rm`` import, holds one).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Iterable

from ..format.local import LOCAL_METADATA_NAME, MARKER_NAME, LocalMarker, rank_dir_name

__all__ = ["LocalCopy"]

_WRITE_SLICE = 64 << 20


class LocalCopy:
    """Rank ``rank``'s objects of checkpoint ``step`` (directory ``name``) of run ``base`` under
    ``local_dir`` (see the module docstring for the order of calls)."""

    def __init__(self, local_dir: str | os.PathLike, name: str, base: str, step: int) -> None:
        self.root = Path(local_dir) / name
        self.base = base
        self.step = step
        self.rank: int | None = None
        self.refusal: BaseException | None = None  # why the tier cannot take this copy: raised by begin

    @property
    def dir(self) -> Path:
        if self.rank is None:
            raise RuntimeError("LocalCopy.begin(rank) was not called")
        return self.root / rank_dir_name(self.rank)

    def begin(self, rank: int) -> None:
        if self.refusal is not None:
            raise self.refusal
        self.rank = rank
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True)

    def write(self, name: str, buffers: Iterable) -> int:
        """Write ``buffers`` (byte views, back to back) as object ``name``; its size."""
        written = 0
        fd = os.open(self.dir / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for buffer in buffers:
                view = memoryview(buffer).cast("B")
                for at in range(0, view.nbytes, _WRITE_SLICE):
                    piece = view[at:at + _WRITE_SLICE]
                    while piece.nbytes:
                        n = os.write(fd, piece)
                        piece = piece[n:]
                written += view.nbytes
        finally:
            os.close(fd)
        return written

    def commit(self, metadata: bytes, *, save_id: str, world_size: int, in_s3: bool) -> LocalMarker:
        """Make the copy complete: the metadata, then the marker naming every object written."""
        objects = {p.name: p.stat().st_size for p in self.dir.iterdir() if not p.name.startswith(".")}
        (self.dir / LOCAL_METADATA_NAME).write_bytes(metadata)
        marker = LocalMarker(base=self.base, step=self.step, save_id=save_id, rank=self.rank,
                             world_size=world_size, objects=objects, in_s3=in_s3)
        tmp = self.dir / f"{MARKER_NAME}.tmp"
        tmp.write_bytes(marker.encode())
        os.replace(tmp, self.dir / MARKER_NAME)
        return marker

    def discard(self) -> None:
        if self.rank is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            try:
                self.root.rmdir()  # the step's directory, once no rank's copy is in it
            except OSError:
                pass
