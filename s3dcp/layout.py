"""Where checkpoint bytes live in S3: the objects of a checkpoint and the byte ranges in them.

Pure data and logic, no I/O: :class:`ItemLocation` is the value type of ``Metadata.storage_data``
(keyed by DCP's :class:`~torch.distributed.checkpoint.metadata.MetadataIndex`), written into the
checkpoint metadata by :mod:`s3dcp.metadata` and read back to find each item on load.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ItemLocation"]


@dataclass(frozen=True)
class ItemLocation:
    """Where one write item's bytes live: an object of the checkpoint and a byte range in it."""

    object_name: str  # object name relative to the checkpoint prefix, e.g. "__0_0.a1b2c3.data"
    offset: int  # byte offset in the object
    length: int  # byte length
    checksum: str | None  # e.g. "crc32c:1a2b3c4d" (algorithm:hex) or None
    dtype: str | None = None  # tensor items: torch dtype name without "torch.", e.g. "bfloat16"; None for bytes
    shape: tuple[int, ...] | None = None  # tensor items: the stored chunk's shape (C-contiguous raw bytes)
