"""Where checkpoint bytes live in S3: the objects of a checkpoint and the byte ranges in them.

Pure data and logic, no I/O: :class:`ItemLocation` is the value type of ``Metadata.storage_data``
(keyed by DCP's :class:`~torch.distributed.checkpoint.metadata.MetadataIndex`), written into the
checkpoint metadata by :mod:`s3dcp.format.metadata` and read back to find each item on load.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import uuid
from dataclasses import dataclass
from typing import Iterable, Sequence

from ..errors import MetadataFormatError

__all__ = [
    "METADATA_NAME", "PENDING_NAME", "DATA_SUFFIX", "ItemLocation", "pack", "new_save_id", "object_name", "ObjectName",
    "parse_object_name", "is_data_object", "METADATA_HEAD_BYTES", "is_s3dcp_metadata_head", "object_sizes",
    "box_byte_range", "is_contiguous_box", "Segment", "coalesce", "Piece", "box_pieces", "MAX_BYTES_ITEM_BYTES",
    "check_location", "check_box", "check_in_object", "MAX_TILING_CELLS", "check_tiling",
]

# The names of a checkpoint directory's objects, defined here and nowhere else:
#   <prefix>/.metadata                      the commit marker: written last, by the coordinator
#   <prefix>/[NN-]__<rank>_<i>.<save id>.distcp   data objects (see object_name)
#   <prefix>/.pending-references            an incremental save's references, from just before its
#                                           commit check until just after its commit (s3dcp.saving.referenced)
METADATA_NAME = ".metadata"
PENDING_NAME = ".pending-references"
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


# Non-tensor items are the planner's BytesIO values (small pickles: ints, strings, optimizer
# hyper-parameters) read whole into memory; larger is a damaged or crafted length.
MAX_BYTES_ITEM_BYTES = 1 << 32


# ---------------------------------------------------------------------------- what a location may say
def check_location(loc: ItemLocation, element_size: int | None, where: str) -> None:
    """Refuse a location whose numbers cannot describe stored bytes, before anything is
    allocated or fetched for it: a negative offset or length, a tensor item whose length is not
    ``element_size`` × the elements of its shape (``element_size``: of ``loc.dtype``; None for a
    non-tensor item), a non-tensor item over :data:`MAX_BYTES_ITEM_BYTES`, per-block checksums
    that do not cover the item block by block. ``where`` names the item in the error."""
    for name in ("offset", "length", "block_size"):
        value = getattr(loc, name)
        if type(value) is not int or value < 0:
            raise MetadataFormatError(
                f"{where}: {name} {value!r} is not a non-negative int (damaged or crafted metadata)")
    if element_size is None:
        if loc.length > MAX_BYTES_ITEM_BYTES:
            raise MetadataFormatError(
                f"{where}: length {loc.length} of a non-tensor item is over the {MAX_BYTES_ITEM_BYTES}-byte bound "
                "(damaged or crafted metadata)")
    else:
        shape = loc.shape
        if shape is None or any(type(n) is not int or n < 0 for n in shape):
            raise MetadataFormatError(f"{where}: tensor item with shape {shape!r} (damaged or crafted metadata)")
        expected = element_size * _prod(shape)
        if loc.length != expected:
            raise MetadataFormatError(
                f"{where}: length {loc.length} is not the {expected} bytes of its {loc.dtype}{list(shape)} chunk "
                f"({element_size}-byte elements; damaged or crafted metadata)")
    if loc.block_size or loc.block_checksums:
        blocks = -(-loc.length // loc.block_size) if loc.block_size else None
        if blocks != len(loc.block_checksums) or loc.checksum is None:
            raise MetadataFormatError(
                f"{where}: {len(loc.block_checksums)} block checksum(s) for block_size {loc.block_size} over "
                f"length {loc.length} (damaged or crafted metadata)")


def check_box(shape: Sequence[int], offsets: Sequence[int], lengths: Sequence[int], where: str) -> None:
    """Refuse a read of the sub-box ``offsets``/``lengths`` that is not inside a stored item of ``shape``."""
    if len(offsets) != len(shape) or len(lengths) != len(shape) or any(
            o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, lengths, shape)):
        raise MetadataFormatError(
            f"{where}: the box at {tuple(offsets)} of {tuple(lengths)} elements is not inside the stored "
            f"chunk of shape {tuple(shape)} (damaged or crafted metadata)")


def check_in_object(loc: ItemLocation, object_bytes: int, where: str) -> None:
    """Refuse an item that ends past the end of its object of ``object_bytes`` bytes."""
    if loc.offset + loc.length > object_bytes:
        raise MetadataFormatError(
            f"{where}: bytes {loc.offset}-{loc.offset + loc.length} are past the end of {loc.object_name} "
            f"({object_bytes} bytes): the object was truncated or replaced, or the metadata is damaged or crafted")


# A tensor's chunk boundaries cut it into a grid of cells; a regular sharding has one cell per
# chunk. More cells than this is not a layout any planner makes.
MAX_TILING_CELLS = 1 << 22


def check_tiling(shape: Sequence[int], chunks: Sequence[tuple[Sequence[int], Sequence[int]]], where: str) -> None:
    """Refuse chunks (``(offsets, sizes)`` boxes) that do not tile a tensor of ``shape`` exactly:
    a chunk outside the tensor, two chunks that overlap, or a hole no chunk covers — which an
    export would otherwise write as whatever its buffer held.

    Work is bounded by the grid the chunk boundaries make (one cell per chunk for a regular
    sharding), never by the elements; a grid over :data:`MAX_TILING_CELLS` cells is refused."""
    shape = tuple(shape)
    for offsets, sizes in chunks:
        check_box(shape, offsets, sizes, where)
    if _prod(shape) == 0:
        return
    chunks = [(tuple(o), tuple(n)) for o, n in chunks if _prod(n)]
    bounds = [sorted({0, d} | {o[i] for o, _ in chunks} | {o[i] + n[i] for o, n in chunks})
              for i, d in enumerate(shape)]
    cells = _prod(len(b) - 1 for b in bounds)
    if cells > MAX_TILING_CELLS:
        raise MetadataFormatError(f"{where}: its {len(chunks)} chunks cut it into {cells} pieces, over the "
                                  f"{MAX_TILING_CELLS} checked (damaged or crafted metadata)")
    at = [{v: k for k, v in enumerate(b)} for b in bounds]
    steps = [_prod(len(b) - 1 for b in bounds[i + 1:]) for i in range(len(shape))]
    covered = bytearray(cells)
    for offsets, sizes in chunks:
        ranges = [range(at[i][o], at[i][o + n]) for i, (o, n) in enumerate(zip(offsets, sizes))]
        for cell in itertools.product(*ranges):
            k = sum(c * s for c, s in zip(cell, steps))
            if covered[k]:
                raise MetadataFormatError(f"{where}: the chunk at {offsets} overlaps another chunk "
                                          "(damaged or crafted metadata)")
            covered[k] = 1
    if 0 in covered:
        k = covered.index(0)
        corner = []
        for b, s in zip(bounds, steps):
            corner.append(b[k // s])
            k %= s
        raise MetadataFormatError(f"{where}: no chunk holds the elements at {tuple(corner)} "
                                  "(a hole; damaged or crafted metadata)")


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


METADATA_HEAD_BYTES = 8  # enough of a .metadata object to tell s3dcp's from another writer's


def is_s3dcp_metadata_head(head: bytes) -> bool:
    """Whether the first :data:`METADATA_HEAD_BYTES` of a ``.metadata`` object are s3dcp's:
    format 2's magic (``0x89 S3DCPMD``, :mod:`s3dcp.format.metadata.v2`) or format 1's JSON
    (``{``). DCP's own writers pickle their metadata (``0x80``...): not s3dcp's, and neither
    is anything else. A True here is a first look only; decoding is what validates."""
    head = bytes(head[:METADATA_HEAD_BYTES])
    return head.startswith(b"\x89S3DCPMD") or head.lstrip()[:1] == b"{"


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


@dataclass(frozen=True)
class Piece:
    """One byte range of a stored item to fetch, and the part of the wanted box it fills.

    The part is a slab of the box: the box's leading dims fixed at ``index`` (relative to the
    box), then ``count`` consecutive positions from ``first`` along the next dim, then the
    box's full extent in every dim after. Its elements sit in the fetched bytes at element
    offset ``src_offset`` with ``sizes``/``strides`` (in elements), so the copy is
    ``dest[index].narrow(0, first, count).copy_(fetched.as_strided(sizes, strides, src_offset))``,
    with ``dest`` viewed as one flat run of elements first when ``flat``.
    """

    start: int  # item-relative bytes [start, end) to fetch
    end: int
    index: tuple[int, ...]
    first: int
    count: int
    src_offset: int
    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    flat: bool = False


def box_pieces(
    shape: Sequence[int], element_size: int, offsets: Sequence[int], lengths: Sequence[int], *,
    item_bytes: int, block_bytes: int = 0, gap_bytes: int = 0, max_bytes: int, flat: bool = True,
) -> list[Piece]:
    """The byte ranges to fetch for the sub-box ``offsets``/``lengths`` of a stored C-contiguous
    item of ``shape``: only the bytes the box needs, a hole of at most ``gap_bytes`` bridged
    rather than split, each range widened to ``block_bytes`` boundaries (the item's checksum
    blocks, so every fetched byte can be verified; pass ``item_bytes`` when only the whole item
    has a checksum, 0 when nothing is verified), each at most ``max_bytes`` (rounded up to at
    least two blocks) so a piece fits a bounce slot.

    The box is cut into slabs along the first dim ``d`` whose one-position slab spans at most
    ``max_bytes`` less a block; consecutive slabs share a piece while the piece stays within
    ``max_bytes`` and the hole before the next slab is small. Pieces of a box that is one
    contiguous run (e.g. rows of a Shard(0) chunk) are cut at block boundaries and never
    overlap; pieces of a strided box (a Shard(1) column range of stored rows) are cut at slab
    boundaries and two neighbours may both fetch the block between them. Pass ``flat=False``
    when the destination cannot be viewed flat (not contiguous): contiguous boxes are then cut
    at slab boundaries too.

    Work is per piece, not per element: a 1-D box of 10^9 elements is a handful of pieces.
    """
    if any(n == 0 for n in lengths):
        return []
    if not shape:  # a 0-d tensor: one element, copied through its flat view
        return [dataclasses.replace(p, flat=True) for p in box_pieces(
            (1,), element_size, (0,), (1,), item_bytes=item_bytes, block_bytes=block_bytes,
            gap_bytes=gap_bytes, max_bytes=max_bytes)]
    shape, offsets, lengths = tuple(shape), tuple(offsets), tuple(lengths)
    if flat and len(shape) > 1 and is_contiguous_box(shape, offsets, lengths):
        # One run of memory: cut it as a flat run of elements, so cuts fall on block boundaries.
        first, _ = box_byte_range(shape, element_size, offsets, lengths)
        run = box_pieces((item_bytes // element_size,), element_size, (first // element_size,),
                          (_prod(lengths),), item_bytes=item_bytes, block_bytes=block_bytes,
                          gap_bytes=gap_bytes, max_bytes=max_bytes)
        return [dataclasses.replace(p, flat=True) for p in run]
    block = block_bytes if block_bytes > 0 else 1
    limit = max(max_bytes, 2 * block, element_size)
    limit = -(-limit // block) * block
    slack = block if block > 1 else 0
    strides = _c_strides(shape)

    def lo(x: int) -> int:
        return x // block * block

    def hi(x: int) -> int:
        return min(item_bytes, -(-x // block) * block)

    def span(d: int) -> int:  # bytes from the first to past the last element of one slab at depth d
        return (sum((lengths[j] - 1) * strides[j] for j in range(d + 1, len(shape))) + 1) * element_size

    def hole(d: int) -> int:  # the largest unwanted run inside one slab at depth d
        return max((strides[j] * element_size - span(j) for j in range(d + 1, len(shape))), default=0)

    # The shallowest slabs that fit a piece and hold no hole worth skipping.
    d = next(d for d in range(len(shape)) if span(d) <= limit - slack and hole(d) <= gap_bytes)
    step, width, n = strides[d] * element_size, span(d), lengths[d]
    tail_sizes, tail_strides = tuple(lengths[d + 1:]), tuple(strides[d + 1:])
    near = step - width <= gap_bytes  # slabs close enough that every next one joins while size allows
    pieces: list[Piece] = []
    for index in itertools.product(*(range(lengths[j]) for j in range(d))):
        base = (sum((offsets[j] + index[j]) * strides[j] for j in range(d))
                + sum(offsets[j] * strides[j] for j in range(d, len(shape)))) * element_size
        k = 0
        while k < n:
            start = lo(base + k * step)
            # slabs [k, k_max) fit one piece: hi(last slab's end) - start <= limit
            k_max = max(k + 1, min(n, (start + limit - base - width) // step + 1))
            k1 = k + 1
            if near:
                k1 = k_max
            else:
                end = hi(base + k * step + width)
                while k1 < k_max and lo(base + k1 * step) - end <= gap_bytes:
                    end = hi(base + k1 * step + width)
                    k1 += 1
            end = hi(base + (k1 - 1) * step + width)
            pieces.append(Piece(start, end, index, k, k1 - k, (base + k * step - start) // element_size,
                                (k1 - k, *tail_sizes), (strides[d], *tail_strides)))
            k = k1
    return pieces


def _prod(values: Iterable[int]) -> int:
    out = 1
    for v in values:
        out *= v
    return out
