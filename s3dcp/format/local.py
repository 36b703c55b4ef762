"""The node-local tier's layout: a checkpoint's objects kept in a directory of the node, and the
marker that says a rank's copy is complete.

    <local_dir>/<step name>/rank-<R>/__R_0.<save id>.distcp ...   rank R's objects, named and laid
                                                                  out as in S3 (same item checksums)
                                     .metadata                    the checkpoint's metadata (every rank)
                                     .local-commit                this marker, written last (rename)

A rank's copy is *complete* once its marker is there: the marker names the run, step, save,
world size, when it was made (``saved_at``: the rank's clock at its commit, which tells two saves
of one step apart after a rollback) and every object with its size, and is written (atomically,
by rename) only after every object and the metadata. Version 1 markers (no ``saved_at``) read
as made at time 0: older than any save of this version. A peer node's replica of rank R is the same directory on that
node. Pure code: encoding and decoding, with the decoded marker checked as untrusted input
(bounded size, types, names that stay inside the directory).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

from ..errors import MetadataFormatError

__all__ = ["LocalMarker", "MARKER_NAME", "LOCAL_METADATA_NAME", "MAX_MARKER_BYTES", "MAX_WORLD_SIZE",
           "rank_dir_name", "parse_rank_dir"]

MARKER_NAME = ".local-commit"
LOCAL_METADATA_NAME = ".metadata"
MAX_MARKER_BYTES = 4 << 20  # a marker names a rank's objects: thousands at most
MAX_WORLD_SIZE = 1 << 24  # ranks of a job: far past any real one, and a set of them still fits in memory
_FORMAT = "s3dcp-local-copy"
_VERSION = 2
_READS = (1, 2)
_RANK_DIR = re.compile(r"rank-(\d{1,7})")
_OBJECT = re.compile(r"[A-Za-z0-9_.\-]{1,255}")  # what layout.object_name makes; never a path


def rank_dir_name(rank: int) -> str:
    return f"rank-{rank}"


def parse_rank_dir(name: str) -> int | None:
    """The rank a ``rank-<R>`` directory name stands for, or None."""
    m = _RANK_DIR.fullmatch(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class LocalMarker:
    """What a complete local copy of one rank's part of a checkpoint holds."""

    base: str  # the run's base URI (a local_dir shared by two runs keeps them apart)
    step: int
    save_id: str
    rank: int  # the saving rank whose objects these are
    world_size: int  # ranks of the save: a step is whole when every rank's copy is found
    objects: dict  # object name -> size in bytes
    in_s3: bool  # the step was also committed to S3
    saved_at: float = 0.0  # seconds since the epoch, the saving rank's clock at its commit

    def encode(self) -> bytes:
        return json.dumps({"format": _FORMAT, "version": _VERSION, "base": self.base, "step": self.step,
                           "save_id": self.save_id, "rank": self.rank, "world_size": self.world_size,
                           "objects": dict(sorted(self.objects.items())), "in_s3": self.in_s3,
                           "saved_at": self.saved_at}, separators=(",", ":")).encode()

    @property
    def nbytes(self) -> int:
        return sum(self.objects.values())

    @classmethod
    def decode(cls, data: bytes, where: str) -> "LocalMarker":
        """The marker in ``data`` (read from ``where``); MetadataFormatError naming the field
        when it is not one this version wrote."""
        if len(data) > MAX_MARKER_BYTES:
            raise MetadataFormatError(f"{where}: a local-copy marker of {len(data)} bytes (at most "
                                      f"{MAX_MARKER_BYTES}): not one s3dcp wrote")
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise MetadataFormatError(f"{where}: the local-copy marker is not JSON ({e})") from None
        if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
            raise MetadataFormatError(f"{where}: not an s3dcp local-copy marker")
        version = doc.get("version")
        if isinstance(version, bool) or version not in _READS:
            raise MetadataFormatError(f"{where}: local-copy marker version {version!r}; this s3dcp "
                                      f"reads versions {', '.join(map(str, _READS))}")

        def field(name, kind, check=lambda v: True):
            value = doc.get(name)
            if not (isinstance(value, kind) and (kind is bool or not isinstance(value, bool)) and check(value)):
                raise MetadataFormatError(f"{where}: local-copy marker field {name!r} is {value!r:.80}")
            return value

        objects = field("objects", dict)
        for name, size in objects.items():
            if not _OBJECT.fullmatch(name) or name in (".", "..") or not isinstance(size, int) \
                    or isinstance(size, bool) or size < 0:
                raise MetadataFormatError(f"{where}: local-copy marker names object {name!r:.80} of size {size!r:.40}")
        return cls(base=field("base", str), step=field("step", int, lambda v: v >= 0),
                   save_id=field("save_id", str, lambda v: 0 < len(v) <= 64),
                   rank=field("rank", int, lambda v: 0 <= v < MAX_WORLD_SIZE),
                   world_size=field("world_size", int, lambda v: 1 <= v <= MAX_WORLD_SIZE),
                   objects=dict(objects), in_s3=field("in_s3", bool),
                   saved_at=float(field("saved_at", (int, float), math.isfinite)) if version >= 2 else 0.0)
