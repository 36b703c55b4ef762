"""What a decoded metadata declares against what it stores, without torch (``s3dcp verify``).

A load checks this through :func:`~s3dcp.format.metadata.validate_metadata` (DCP's classes), and
refuses the first problem. ``s3dcp verify`` reads the plain decode and reports every problem by
name, so that its OK means what a load needs: every declared item stored, read and checked.
:func:`problems` lists, for each entry of ``state_dict_metadata``:

- a tensor whose chunks do not tile it exactly (:func:`s3dcp.format.layout.check_tiling`: a
  chunk outside it, two that overlap, a hole; checked once per chunk layout);
- a chunk (or a bytes item) without a stored location, also when ``storage_data`` is missing;
- a chunk whose location holds another dtype than the tensor's, or another shape than the chunk's.

Work is one pass over the storage items and one over the declared chunks (bounded, like
everything a decode built, by the object's size); names are quoted in messages only when a
problem is found.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from ...errors import MetadataFormatError
from ..layout import check_tiling
from .plain import PlainMetadata, PlainTensor

__all__ = ["Problem", "problems"]


class Problem(NamedTuple):
    """One declared item that a load could not fill: its fqn, its chunk's offsets (None: a bytes
    item, or the whole tensor), and why."""

    fqn: str
    offset: tuple | None
    reason: str


def problems(md: PlainMetadata) -> list[Problem]:
    """Every declared item a load could not fill from ``md``'s storage (see the module docstring)."""
    out: list[Problem] = []
    storage = md.storage
    declared = sum(len(t.chunks) if type(t) is PlainTensor else 1 for t in md.state_dict.values())
    if storage is None:
        if declared:
            out.append(Problem("", None, f"storage_data is missing (null), so none of the {declared} declared "
                                         "chunk(s) and item(s) has a stored location"))
        return out
    stored: dict[tuple, Any] = {(k.fqn, k.offset): loc for k, loc in storage.items()}
    tiled: dict[tuple, str] = {}  # (id(chunk layout), size) -> why it does not tile (v2 tensors share layouts)
    for fqn, item in md.state_dict.items():
        if type(item) is not PlainTensor:
            if (fqn, None) not in stored:
                out.append(Problem(fqn, None, "no stored location for this bytes item"))
            continue
        chunks = item.chunks
        why = tiled.get((id(chunks), item.size))
        if why is None:
            why = tiled[(id(chunks), item.size)] = _tiling(item)
        if why:
            out.append(Problem(fqn, None, why))
        dtype = item.properties.dtype
        for offsets, sizes in zip(chunks.offsets, chunks.sizes):
            loc = stored.get((fqn, offsets))
            if loc is None:
                out.append(Problem(fqn, offsets, "no stored location for this chunk"))
            elif loc.dtype != dtype:
                out.append(Problem(fqn, offsets, f"stored as {loc.dtype}, but the tensor is {dtype}"))
            elif loc.shape is None or tuple(loc.shape) != tuple(sizes):
                out.append(Problem(fqn, offsets, f"stored with shape {loc.shape}, but the chunk's sizes are "
                                                 f"{tuple(sizes)}"))
    return out


def _tiling(item: PlainTensor) -> str:
    try:
        check_tiling(item.size, list(zip(item.chunks.offsets, item.chunks.sizes)), "its chunks")
    except MetadataFormatError as e:
        return str(e)
    return ""

