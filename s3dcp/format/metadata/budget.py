"""How much a metadata object may make a decode build: a budget set by the object's own size.

A version-2 object is small because it is compressed and because it shares: chunk layouts are
stored once for every tensor of one shape, and zlib turns a column of equal numbers into a few
bytes. Both are also what a hostile or damaged object would use to make a small object expand
without end: a 2.7 KB object could declare four billion 0-d chunks (they store no numbers), a
100 KB column could inflate to 10^8 values. So before a decode allocates or inflates anything,
every declared count is charged to a :class:`DecodeBudget` whose size follows the object's:

- ``column_bytes``: bytes of column values held after inflating them, at most
  ``max(64 MiB, 16 x the object's bytes)``. A real checkpoint holds ~25 bytes of columns per
  storage item and pays >= 4 bytes per item (its checksum; ~0.6 bytes without checksums):
  1,024 ranks x 900 tensors with crc32c is 4.3 MB of metadata and ~30 MB of columns.
- ``objects``: Python objects a decode builds, weighted by what they cost: 1 per chunk of
  ``state_dict_metadata`` (a list slot; chunks of one layout share their objects), 16 per
  distinct chunk box or per-row key or shape (a torch.Size / tuple / ChunkStorageMetadata), at
  most ``max(2^22, 2 x the object's bytes)``. 1,024 x 900 needs ~1 M.

With both, an object of at most 10 MB builds at most ~160 MB of columns and ~20 M units of
objects, whatever it declares; real checkpoints stay far below either (a checkpoint saved
without checksums at more than ~4 M chunks would be the first to meet the floor). A count over
budget is refused with :class:`~s3dcp.errors.MetadataFormatError` naming the field, before
anything of that size exists.
"""

from __future__ import annotations

from ...errors import MetadataFormatError

__all__ = ["DecodeBudget", "MIN_COLUMN_BYTES", "COLUMN_BYTES_PER_BYTE", "MIN_OBJECTS", "OBJECTS_PER_BYTE",
           "OBJECT_COST"]

MIN_COLUMN_BYTES = 64 * 2**20
COLUMN_BYTES_PER_BYTE = 16
MIN_OBJECTS = 2**22
OBJECTS_PER_BYTE = 2
OBJECT_COST = 16  # units per built object (a chunk reference costs 1)


class DecodeBudget:
    """What is left to spend on one decode of an object of ``object_bytes`` bytes."""

    def __init__(self, object_bytes: int) -> None:
        self.object_bytes = object_bytes
        self.column_bytes_limit = max(MIN_COLUMN_BYTES, COLUMN_BYTES_PER_BYTE * object_bytes)
        self.objects_limit = max(MIN_OBJECTS, OBJECTS_PER_BYTE * object_bytes)
        self._column_bytes = 0
        self._objects = 0

    def column(self, where: str, count: int, width: int) -> None:
        """Charge ``count`` values of ``width`` bytes for the column at ``where``, before it is read."""
        self._column_bytes += count * width
        if self._column_bytes > self.column_bytes_limit:
            raise MetadataFormatError(
                f"{where}: declares {count} values ({count * width} bytes), more than a metadata object of "
                f"{self.object_bytes} bytes can describe (its columns may hold {self.column_bytes_limit} bytes "
                "in all); the object is damaged or crafted")

    def objects(self, where: str, count: int, what: str, cost: int = OBJECT_COST) -> None:
        """Charge ``count`` built objects (``what``, for the message) of ``cost`` units each."""
        self._objects += count * cost
        if self._objects > self.objects_limit:
            raise MetadataFormatError(
                f"{where}: declares {count} {what}, more than a metadata object of {self.object_bytes} bytes "
                "can describe; the object is damaged or crafted")

