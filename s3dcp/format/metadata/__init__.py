"""DCP checkpoint metadata in a versioned, self-describing format (never pickle).

torch's own storage plugins pickle :class:`~torch.distributed.checkpoint.metadata.Metadata`, so
loading a checkpoint can run arbitrary code and ties the file to the Python classes of the
writer. s3dcp writes its own format instead, and decoding builds only the known DCP classes and
plain values. Three versions exist; :func:`decode_metadata` reads all of them, telling them apart by
the first byte and the header, and :func:`encode_metadata` writes version 2, or 3 where that pays:

- version 3 (:mod:`s3dcp.format.metadata.v3`): version 2's columns under a zlib-packed header, with
  ``planner_data`` stored as references into the fqn table (:mod:`s3dcp.format.metadata.planner`);
  written only when it saves >= 64 KiB and 1/8 of the object (one rank of many uniquely named
  tensors: 1/50 of DCP's pickle), so other checkpoints stay readable by releases that read only 2.

- version 2 (:mod:`s3dcp.format.metadata.v2`): a JSON header plus typed, compressed binary columns for the
  per-chunk numbers; ~1/40 of DCP's pickle at a million chunks, and decoded lazily: storage
  locations are built only for the items a rank reads. It starts with the byte 0x89.
- version 1 (:mod:`s3dcp.format.metadata.v1`): one JSON document, starting with ``{``. Simple to
  read with any tool, but at 1,000+ ranks it is hundreds of MB that every rank parses in full.

Versions 1 and 2 store ``planner_data`` as a tagged tree (:mod:`s3dcp.format.metadata.tree`, also
version 3's fallback); all share names, the version check (:mod:`s3dcp.format.metadata.common`) and checked access (:mod:`~s3dcp.format.metadata.fields`).

There is one decoder, and it needs no torch: :func:`decode_plain` (:mod:`~s3dcp.format.metadata.decoding`)
gives a :class:`~s3dcp.format.metadata.plain.PlainMetadata` of names, tuples and locations, with
every structural check and bound done (``s3dcp inspect`` and ``verify`` read that, so they never
import torch). :func:`decode_metadata` (:mod:`~s3dcp.format.metadata.dcp`) builds DCP's classes
from it. A decode checks structure and is bounded by the object's size
(:mod:`s3dcp.format.metadata.budget`); :func:`validate_metadata` (:mod:`s3dcp.format.metadata.validate`)
checks what a load relies on: every chunk has a location whose dtype, shape and length match it.

Readers refuse another ``format``, a newer ``version`` and any missing or ill-typed field with
:class:`~s3dcp.errors.MetadataFormatError`. Unknown extra fields (and, in version 2, unknown
columns) are ignored, so a later writer may add optional ones without bumping the version.

Importing this package does not import torch: the names that need it (:func:`encode_metadata`,
:func:`decode_metadata`, :func:`validate_metadata`, :func:`dtype_to_str`, :func:`str_to_dtype`)
are loaded on first use.
"""

from __future__ import annotations

from typing import Any

from .common import FORMAT_NAME, FORMAT_VERSION
from .decoding import decode_plain, format_version_of
from .plain import PlainMetadata

__all__ = [
    "FORMAT_NAME", "FORMAT_VERSION", "encode_metadata", "decode_metadata", "decode_plain", "PlainMetadata",
    "format_version_of", "dtype_to_str", "str_to_dtype", "validate_metadata",
]


def __getattr__(name: str) -> Any:
    """The names that need torch, imported on first use."""
    if name in ("encode_metadata", "decode_metadata"):
        from . import dcp as module
    elif name == "validate_metadata":
        from . import validate as module
    elif name in ("dtype_to_str", "str_to_dtype"):
        from . import dtypes as module
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = globals()[name] = vars(module)[name]
    return value
