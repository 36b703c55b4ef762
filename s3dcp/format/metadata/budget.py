"""How much a metadata object may make a decode build: a budget set by the object's own size.

A version-2 object is small because it is compressed and because it shares: chunk layouts are
stored once for every tensor of one shape, and zlib turns a column of equal numbers into a few
bytes. Both are also what a hostile or damaged object would use to make a small object expand
without end: a 2.7 KB object could declare four billion 0-d chunks (they store no numbers), a
100 KB column could inflate to 10^8 values. So before a decode allocates or inflates anything,
every declared count is charged to a :class:`DecodeBudget` whose size follows the object's:

- ``column_bytes``: bytes of column values held after inflating them, at most
  ``max(64 MiB, 8 x the object's bytes)``. A real checkpoint holds ~25 bytes of columns per
  storage item and pays ~4.6 bytes per item in the object with crc32c checksums (the checksum is
  incompressible), ~0.6 without: 1,024 ranks x 900 tensors is 4.3 MB of metadata and ~25 MB of
  columns. Before the storage columns are read, their row count is checked against what is
  left (every row takes at least a byte in each of the 15 columns every object has).
- ``objects``: what a decode builds in Python, in units of about 8 bytes (a list slot): 1 per
  chunk of a tensor in ``state_dict_metadata`` (the tensors of one layout share its chunk
  objects), 4 per chunk of a layout, 16 more per distinct chunk box and per storage row with a
  key or shape of its own (a torch.Size, tuple or ChunkStorageMetadata), at most
  ``max(2^22, the object's bytes)``. 1,024 x 900 needs ~1 M. Names (fqns, object names, dtype
  names) are charged by length, a unit per 8 characters, and an object each; the list items a
  load into an empty state dict would build from ``planner_data`` paths past the entries that
  use each list, a unit each (:mod:`s3dcp.format.metadata.paths`).

So an object of at most 10 MB holds at most ~80 MB of columns and builds ~80 MB of objects,
whatever it declares (measured in ``tests/format/test_hostile_metadata.py``). Real checkpoints
stay below both: the first to meet a limit would be one saved without checksums
(``checksum=None``) with more than ~2.7 M storage items, refused by name rather than decoded
slowly; with crc32c or crc64nvme checksums the checksums alone pay for every item's columns.
A count over budget is refused with :class:`~s3dcp.errors.MetadataFormatError` naming the field,
before anything of that size exists.
"""

from __future__ import annotations

from typing import Any

from ...errors import MetadataFormatError

__all__ = ["DecodeBudget", "MIN_COLUMN_BYTES", "COLUMN_BYTES_PER_BYTE", "MIN_OBJECTS", "OBJECTS_PER_BYTE",
           "OBJECT_COST"]

MIN_COLUMN_BYTES = 64 * 2**20
COLUMN_BYTES_PER_BYTE = 8
MIN_OBJECTS = 2**22
OBJECTS_PER_BYTE = 1
OBJECT_COST = 16  # units per built object (a list slot costs 1)


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

    def fits(self, where: str, count: int, width: int, what: str) -> None:
        """Refuse ``count`` rows of at least ``width`` column bytes each if they cannot fit what is left."""
        if self._column_bytes + count * width > self.column_bytes_limit:
            raise MetadataFormatError(
                f"{where}: declares {count} {what}, more than a metadata object of {self.object_bytes} bytes can "
                "describe; the object is damaged or crafted")

    def names(self, where: Any, names: list, what: str) -> None:
        """Charge a table of ``names`` (strings, already checked) by length, and an object each."""
        self.objects(where, len(names), what)
        self.objects(where, sum(map(len, names)) // 8, f"characters of {what}", 1)

    def objects(self, where: Any, count: int, what: str, cost: int = OBJECT_COST) -> None:
        """Charge ``count`` built objects (``what``, for the message) of ``cost`` units each."""
        self._objects += count * cost
        if self._objects > self.objects_limit:
            raise MetadataFormatError(
                f"{where}: declares {count} {what}, more than a metadata object of {self.object_bytes} bytes "
                "can describe; the object is damaged or crafted")

