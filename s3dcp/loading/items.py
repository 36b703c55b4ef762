"""One load's reads of its items: where each item's bytes are, which of them to fetch and where
they land, the checks before anything is allocated, verification of every fetched byte, and the
hand-over to DCP's planner.

    ReadItem ──location (checked: layout.check_location / check_box)──► Read
        ├─ direct: bytes land in the destination tensor (or a bytes item's buffer)
        └─ bounced: the box's pieces (layout.box_pieces), each copied out of a bounce slot
    fetched bytes ──integrity.ItemCheck──► finish / finish_piece ──► planner.commit_tensor / load_bytes

Used by the plain path (:mod:`s3dcp.loading.reader`) and by cooperative reads
(:mod:`s3dcp.loading.exchange`) alike. It schedules no GET and holds no bounce window: the
callers do.
"""

from __future__ import annotations

import io
import re
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from ..errors import IntegrityError, MetadataFormatError, S3DCPError, UnsafePickleError
from ..format import integrity, layout
from ..format.context import At, quoted
from ..format.layout import ItemLocation, Piece, Segment
from ..format.metadata import str_to_dtype
from ..format.tensors import byte_view, has_lazy_bits
from ..s3.client import S3Client
from ..uri import S3Uri, object_key

__all__ = ["Read", "ItemReads"]

_HEAD_BYTES_ITEM_ABOVE = 1 << 20  # a non-tensor item larger than this is checked against its object first


@dataclass
class Read:
    """One ReadItem's plan: which stored bytes to fetch, where they land, how to check them.

    Direct (``pieces is None``): bytes ``[start, end)`` of the item land in ``sink`` (the
    destination tensor's memory, or ``bounce``, a bytearray for a non-tensor item). Otherwise
    each of ``pieces`` is fetched into a bounce slot and copied into its part of ``dest``;
    the item is committed when the last piece's copy is done."""

    item: ReadItem
    location: ItemLocation
    start: int  # byte range fetched, relative to the item (direct reads)
    end: int
    sink: memoryview | None  # where the fetched bytes land (direct reads)
    dest: torch.Tensor | None = None  # tensor items: the planner's destination
    bounce: Any = None  # non-tensor items: the buffer their bytes land in
    pieces: list[Piece] | None = None  # bounced reads: the byte ranges of the box, in order
    left: int = 0  # pieces not yet copied out
    tokens: list = field(default_factory=list)  # copies of this item still running


class ItemReads:
    """The reads of one load's items against ``storage_data`` (the checkpoint's locations) of
    the checkpoint at ``uri``. ``verify``: check every fetched byte against the item's
    checksums; ``allow_pickle``: let non-tensor items hold more than plain data."""

    def __init__(self, uri: S3Uri, storage_data: Any, client: S3Client, *, verify: bool, allow_pickle: bool,
                 coalesce_gap_bytes: int) -> None:
        self.uri = uri
        self.storage_data = storage_data
        self.client = client
        self.checks = verify
        self.allow_pickle = allow_pickle
        self.coalesce_gap_bytes = coalesce_gap_bytes
        self.verify_s = 0.0  # wall seconds spent checking fetched bytes (on the thread that finishes reads)

    def location(self, item: ReadItem) -> ItemLocation:
        try:
            return self.storage_data[item.storage_index]
        except KeyError:
            raise MetadataFormatError(
                f"{self.uri}: the metadata has no stored location for {item.storage_index.fqn!r} "
                f"(chunk at {tuple(item.storage_index.offset or ())})") from None

    def where(self, item: ReadItem) -> At:
        """The item, for an error (text only when one is raised: a name may be megabytes)."""
        return At(self.uri, ": item ", quoted(item.storage_index.fqn), " (chunk at ",
                  tuple(item.storage_index.offset or ()), ")")

    def read_error(self, run: list[Segment], error: BaseException) -> BaseException:
        """A GET that found its object shorter than the metadata says (a short body, or 416):
        an IntegrityError naming the first item past the object's end; else ``error``."""
        if not isinstance(error, IntegrityError) and getattr(error, "status", None) != 416:
            return error
        reads = [seg.tag if isinstance(seg.tag, Read) else seg.tag[0] for seg in run]
        key = object_key(self.uri, reads[0].location.object_name)
        try:
            size = self.client.head(self.uri.bucket, key).result().size
            for read in reads:
                layout.check_in_object(read.location, size, self.where(read.item))
        except MetadataFormatError as e:  # which of the object and the metadata is wrong, no one can tell
            named = IntegrityError(str(e))
            named.__cause__ = error
            return named
        except S3DCPError:
            pass
        return error

    def plan(self, item: ReadItem, planner: LoadPlanner, slot_bytes: int) -> Read:
        loc = self.location(item)
        where = self.where(item)
        if item.type == LoadItemType.BYTE_IO:
            layout.check_location(loc, None, where)
            if loc.length > _HEAD_BYTES_ITEM_ABOVE:  # memory is filled only for bytes the object holds
                size = self.client.head(self.uri.bucket, object_key(self.uri, loc.object_name)).result().size
                layout.check_in_object(loc, size, where)
            buf = bytearray(loc.length)
            return Read(item, loc, 0, loc.length, memoryview(buf), bounce=buf)

        dest = planner.resolve_tensor(item).detach()
        dtype = str_to_dtype(loc.dtype)
        layout.check_location(loc, dtype.itemsize, where)
        shape = tuple(loc.shape)
        offsets, lengths = tuple(item.storage_offsets), tuple(item.lengths)
        layout.check_box(shape, offsets, lengths, where)
        if tuple(dest.shape) != lengths:
            raise MetadataFormatError(
                f"{self.uri}: {item.dest_index.fqn!r}: destination shape {tuple(dest.shape)} does not match "
                f"the {lengths} elements planned from the checkpoint")
        in_place = (dest.device.type == "cpu" and dest.is_contiguous() and dest.dtype == dtype
                    and not has_lazy_bits(dest))  # a conj view takes its values through copy_
        whole = all(o == 0 for o in offsets) and lengths == shape
        if whole and in_place:
            return Read(item, loc, 0, loc.length, byte_view(dest), dest=dest)
        checked = self.checks and loc.checksum is not None
        if in_place and not checked and layout.is_contiguous_box(shape, offsets, lengths):
            # One run of the item's bytes (rows of a Shard(0) load) with nothing to verify: no
            # block widening needed, so the run lands in the destination too.
            lo, hi = layout.box_byte_range(shape, dtype.itemsize, offsets, lengths)
            if hi > lo:
                return Read(item, loc, lo, hi, byte_view(dest), dest=dest)

        # Only the box's bytes, in pieces that fit a bounce slot, widened to checksum blocks
        # (the whole item when it has one checksum) so every fetched byte can be verified.
        pieces = layout.box_pieces(
            shape, dtype.itemsize, offsets, lengths, item_bytes=loc.length,
            block_bytes=(loc.block_size or loc.length) if checked else 0,
            gap_bytes=self.coalesce_gap_bytes, max_bytes=slot_bytes, flat=dest.is_contiguous())
        return Read(item, loc, 0, 0, None, dest=dest, pieces=pieces, left=len(pieces))

    def finish(self, read: Read, planner: LoadPlanner, verify: bool = True) -> None:
        """A direct read's bytes are all there: verify, hand to the planner."""
        if self.checks and verify:
            self.verify_bytes(read, read.start, read.sink)
        item = read.item
        if item.type == LoadItemType.BYTE_IO:
            if not self.allow_pickle:
                self.check_plain_data(read)
            planner.load_bytes(item, io.BytesIO(read.bounce))
            return
        planner.commit_tensor(item, read.dest)

    def finish_piece(self, read: Read, piece: Piece, fetched: torch.Tensor, copier, tokens: list,
                      planner: LoadPlanner, verify: bool = True) -> None:
        """One piece of a bounced read is in ``fetched`` (a slot's uint8 view): verify its
        blocks, start the copy into its part of the destination, and commit the item once its
        last piece is copied. The copy's token goes into ``tokens`` (the slot's)."""
        if self.checks and verify:
            self.verify_bytes(read, piece.start, byte_view(fetched))
        dtype = str_to_dtype(read.location.dtype)
        size = dtype.itemsize
        if fetched.storage_offset() % size:  # the item starts unaligned in its object
            fetched = fetched.clone()
        elems = fetched[:fetched.numel() // size * size].view(dtype)
        src = elems.as_strided(piece.sizes, piece.strides, elems.storage_offset() + piece.src_offset)
        target = read.dest.view(-1) if piece.flat else read.dest
        for i in piece.index:
            target = target[i]
        token = copier.copy(target.narrow(0, piece.first, piece.count), src)
        tokens.append(token)
        read.tokens.append(token)
        read.left -= 1
        if read.left == 0:
            for t in read.tokens:
                copier.wait(t)
            read.tokens = []
            planner.commit_tensor(read.item, read.dest)

    def check_plain_data(self, read: Read) -> None:
        """Refuse a non-tensor item that is more than plain data before the planner unpickles it."""
        try:
            torch.load(io.BytesIO(read.bounce), weights_only=True)
        except Exception as e:  # noqa: BLE001 - whatever the unpickler refused
            text = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).strip()  # torch colours its message
            reason = text.splitlines()[0] if text else type(e).__name__
            raise UnsafePickleError(
                f"{self.uri}: item {read.item.storage_index.fqn!r} holds pickled Python objects beyond plain "
                f"data ({reason[:200]}); unpickling it could run code. If you trust this checkpoint, pass "
                "allow_pickle=True to S3StorageReader") from e

    def verify_bytes(self, read: Read, start: int, view: memoryview) -> None:
        """Check bytes ``start..`` of the item (``start`` 0 or on a block boundary)."""
        loc = read.location
        if loc.checksum is None:
            return
        t0 = time.perf_counter()
        check = integrity.ItemCheck(loc, start).feed_all(view)
        self.verify_s += time.perf_counter() - t0
        if check.ok:
            return
        if check.bad_blocks:
            b = check.bad_blocks[0]
            lo, hi = b * loc.block_size, min(loc.length, (b + 1) * loc.block_size)
            where, expected, got = f"bytes {lo}-{hi} of ", loc.block_checksums[b], check.block_got[b]
        else:
            where, expected, got = "", loc.checksum, check.got
        raise IntegrityError(
            f"checksum mismatch in s3://{self.uri.bucket}/{object_key(self.uri, loc.object_name)} for item "
            f"{read.item.storage_index.fqn!r} (chunk at {tuple(read.item.storage_index.offset or ())}, "
            f"{where}object bytes {loc.offset}-{loc.offset + loc.length}): expected {expected}, "
            f"got {got}. The object was corrupted or overwritten; restore from another checkpoint")
