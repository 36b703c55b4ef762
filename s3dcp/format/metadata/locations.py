"""What one stored item's location may say, checked without torch.

:func:`check_item` is :func:`s3dcp.format.layout.check_location` (non-negative numbers, a tensor
item's length exactly its elements' bytes, a bytes item bounded, block checksums covering the
item) with the element size taken from the location's own dtype name
(:mod:`s3dcp.format.metadata.names`), so ``s3dcp inspect`` and ``verify`` check every item as a
load would, without importing torch.
"""

from __future__ import annotations

from typing import Any

from ..layout import check_location
from .names import element_size

__all__ = ["check_item"]


def check_item(loc: Any, where: str, size: int | None = -1) -> None:
    """Refuse ``loc`` (an ItemLocation) with MetadataFormatError naming ``where`` when it cannot
    describe stored bytes; ``size``: bytes per element, or -1 for those of ``loc.dtype`` (an unknown
    dtype name is refused too)."""
    check_location(loc, element_size(loc.dtype) if size == -1 else size, where)
