"""Where checkpoint bytes live in S3: the objects of a checkpoint and the byte ranges in them.

Pure data and logic, no I/O: :class:`ItemLocation` is the value type of ``Metadata.storage_data``
(keyed by DCP's :class:`~torch.distributed.checkpoint.metadata.MetadataIndex`), written into the
checkpoint metadata by :mod:`s3dcp.metadata` and read back to find each item on load.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Iterable, Sequence

__all__ = [
    "METADATA_NAME", "DATA_SUFFIX", "ItemLocation", "pack", "new_save_id", "object_name", "ObjectName",
    "parse_object_name", "is_data_object", "object_sizes", "box_byte_range", "is_contiguous_box", "Segment",
    "coalesce",
]

# The names of a checkpoint directory's objects, defined here and nowhere else:
#   <prefix>/.metadata                      the commit marker: written last, by the coordinator
#   <prefix>/[NN-]__<rank>_<i>.<save id>.distcp   data objects (see object_name)
METADATA_NAME = ".metadata"
DATA_SUFFIX = ".distcp"


@dataclass(frozen=True)
class ItemLocation:
    """Where one write item's bytes live: an object of the checkpoint and a byte range in it."""

    object_name: str  # object name relative to the checkpoint prefix, e.g. "__0_0.a1b2c3.data"
    offset: int  # byte offset in the object
    length: int  # byte length
    checksum: str | None  # e.g. "crc32c:1a2b3c4d" (algorithm:hex) or None
    dtype: str | None = None  # tensor items: torch dtype name without "torch.", e.g. "bfloat16"; None for bytes
    shape: tuple[int, ...] | None = None  # tensor items: the stored chunk's shape (C-contiguous raw bytes)
    block_size: int = 0  # > 0 when the item also has per-block checksums (large items)
    block_checksums: tuple[str, ...] = ()  # checksum of each block_size slice, the last one shorter


# ---------------------------------------------------------------------------- save side
def pack(sizes: Sequence[int], target_bytes: int) -> list[list[int]]:
    """Group item indices, in order, into objects of about ``target_bytes``.

    Consecutive items share an object until adding the next would pass the target; an item
    larger than the target gets an object of its own. Several objects per rank let uploads
    run in parallel across objects as well as across the parts of one object.
    """
    groups: list[list[int]] = []
    current: list[int] = []
    current_bytes = 0
    for i, size in enumerate(sizes):
        if current and current_bytes + size > target_bytes:
            groups.append(current)
            current, current_bytes = [], 0
        current.append(i)
        current_bytes += size
    if current:
        groups.append(current)
    return groups


def new_save_id() -> str:
    """A fresh save identity: 12 hex digits (48 random bits), chosen once per save by the
    coordinator and carried to every rank in its plan."""
    return uuid.uuid4().hex[:12]


def object_name(rank: int, index: int, token: str, spread: int = 1) -> str:
    """Name of a rank's ``index``-th data object. ``token`` is the save's identity, the same
    on every rank and new for every save, so the objects of two saves (a retry, an overwrite, a
    concurrent job) never collide, and ``gc`` can tell which objects belong to one save.

    With ``spread > 1`` the name starts with one of ``spread`` two-hex-digit prefixes
    (``"03-__5_1.<token>.distcp"``), round-robin over ranks and objects: S3 scales request
    rates per key prefix (~3,500 PUT/s each), and thousands of ranks uploading at once need
    several. The objects stay in the checkpoint's directory.
    """
    name = f"__{rank}_{index}.{token}.distcp"
    return f"{(rank + index) % spread:02x}-{name}" if spread > 1 else name


@dataclass(frozen=True)
class ObjectName:
    """What a data object's name says: which rank wrote it, its number, the save's token."""

    rank: int
    index: int
    token: str


_OBJECT_RE = re.compile(r"^(?:[0-9a-f]{2}-)?__(\d+)_(\d+)\.([0-9a-f]+)\.distcp$")


def parse_object_name(name: str) -> ObjectName | None:
    """The parts of a name made by :func:`object_name`; None for any other name."""
    match = _OBJECT_RE.match(name)
    return ObjectName(int(match.group(1)), int(match.group(2)), match.group(3)) if match else None


def is_data_object(name: str) -> bool:
    """Whether ``name`` (relative to the checkpoint directory) is a data object s3dcp wrote."""
    return parse_object_name(name) is not None


def object_sizes(locations: Iterable[ItemLocation]) -> dict[str, int]:
    """The size each data object must have: its items are packed back to back from offset 0,
    so an object ends where its last item ends."""
    sizes: dict[str, int] = {}
    for loc in locations:
        sizes[loc.object_name] = max(sizes.get(loc.object_name, 0), loc.offset + loc.length)
    return sizes


# ---------------------------------------------------------------------------- load side
def is_contiguous_box(shape: Sequence[int], offsets: Sequence[int], lengths: Sequence[int]) -> bool:
    """Whether the sub-box ``offsets``/``lengths`` of a C-contiguous array of ``shape`` is one
    contiguous run of memory: leading dims of length 1, then one partial dim, then full dims."""
    dims = len(shape)
    k = 0
    while k < dims and lengths[k] == 1:
        k += 1
    # Every dim after the first one longer than 1 must be whole.
    return all(lengths[i] == shape[i] for i in range(k + 1, dims))


def box_byte_range(
    shape: Sequence[int], element_size: int, offsets: Sequence[int], lengths: Sequence[int]
) -> tuple[int, int]:
    """Smallest byte range ``[start, end)`` of a C-contiguous array of ``shape`` that holds
    the sub-box ``offsets``/``lengths`` (exactly the box when :func:`is_contiguous_box`)."""
    if any(n == 0 for n in lengths):
        return (0, 0)
    strides = _c_strides(shape)
    first = sum(o * s for o, s in zip(offsets, strides))
    last = sum((o + n - 1) * s for o, n, s in zip(offsets, lengths, strides))
    return first * element_size, (last + 1) * element_size


def _c_strides(shape: Sequence[int]) -> list[int]:
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    return strides


@dataclass(frozen=True)
class Segment:
    """A byte range of one object to fetch, and an opaque tag for where it goes."""

    offset: int
    length: int
    tag: object = None

    @property
    def end(self) -> int:
        return self.offset + self.length


def coalesce(segments: Iterable[Segment], gap_bytes: int, max_bytes: int) -> list[list[Segment]]:
    """Group segments of one object into runs fetched by one ranged GET each.

    Segments are sorted by offset; a segment joins the current run when the hole before it is
    at most ``gap_bytes`` and the run stays within ``max_bytes`` (a single segment may exceed
    it). Overlapping segments (two reads of the same bytes) stay in one run.
    """
    runs: list[list[Segment]] = []
    run_start = run_end = 0
    for seg in sorted(segments, key=lambda s: (s.offset, s.length)):
        if runs and seg.offset - run_end <= gap_bytes and max(run_end, seg.end) - run_start <= max_bytes:
            runs[-1].append(seg)
            run_end = max(run_end, seg.end)
        else:
            runs.append([seg])
            run_start, run_end = seg.offset, seg.end
    return runs
