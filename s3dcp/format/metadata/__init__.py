"""DCP checkpoint metadata in a versioned, self-describing format (never pickle).

torch's own storage plugins pickle :class:`~torch.distributed.checkpoint.metadata.Metadata`, so
loading a checkpoint can run arbitrary code and ties the file to the Python classes of the
writer. s3dcp writes its own format instead, and decoding builds only the known DCP classes and
plain values. Two versions exist; :func:`decode_metadata` reads both, telling them apart by the
first byte, and :func:`encode_metadata` writes version 2 unless asked for 1:

- version 2 (:mod:`s3dcp.format.metadata.v2`): a JSON header plus typed, compressed binary columns for the
  per-chunk numbers; ~1/40 of DCP's pickle at a million chunks, and decoded lazily: storage
  locations are built only for the items a rank reads. It starts with the byte 0x89.
- version 1 (:mod:`s3dcp.format.metadata.v1`): one JSON document, starting with ``{``. Simple to
  read with any tool, but at 1,000+ ranks it is hundreds of MB that every rank parses in full.

Both store ``planner_data`` as a tagged tree (:mod:`s3dcp.format.metadata.tree`) and share names,
the version check and checked access (:mod:`s3dcp.format.metadata.common`).

A decode checks structure and is bounded by the object's size (:mod:`s3dcp.format.metadata.budget`);
:func:`validate_metadata` (:mod:`s3dcp.format.metadata.validate`) checks what a load relies on: every
chunk has a location whose dtype, shape and length match it.

Readers refuse another ``format``, a newer ``version`` and any missing or ill-typed field with
:class:`~s3dcp.errors.MetadataFormatError`. Unknown extra fields (and, in version 2, unknown
columns) are ignored, so a later writer may add optional ones without bumping the version.
"""

from __future__ import annotations

import contextlib
import gc

from torch.distributed.checkpoint.metadata import Metadata

from ...errors import MetadataFormatError
from . import plain_v1, v1, v2
from .common import _READS, FORMAT_NAME, FORMAT_VERSION, dtype_to_str, str_to_dtype  # noqa: F401 (public)
from .fields import _type_name
from .validate import validate_metadata

__all__ = [
    "FORMAT_NAME", "FORMAT_VERSION", "encode_metadata", "decode_metadata", "format_version_of", "dtype_to_str",
    "str_to_dtype", "validate_metadata",
]


def encode_metadata(md: Metadata, *, version: int = FORMAT_VERSION) -> bytes:
    """Encode ``md`` in format ``version`` (2: columnar, the default; 1: JSON text, pure ASCII).

    The same object always gives the same bytes. Anything that cannot be stored exactly raises
    TypeError naming it; nothing is ever pickled.
    """
    if not isinstance(md, Metadata):
        raise TypeError(f"expected torch.distributed.checkpoint.metadata.Metadata, got {_type_name(md)}")
    if md.version is not None and type(md.version) is not str:
        raise TypeError(f"Metadata.version must be a str or None, got {_type_name(md.version)}")
    if version == 2:
        return v2.encode(md)
    if version == 1:
        return v1.encode(md)
    raise ValueError(f"version={version!r}: s3dcp writes metadata format versions {_READS}")


def decode_metadata(data: bytes, *, source: str = "<metadata>", lazy: bool = True) -> Metadata:
    """Decode bytes written by :func:`encode_metadata`, format version 1 or 2.

    Anything else (garbage, a pickle, another format, a newer version, a truncated or damaged
    object, a missing or ill-typed field) raises MetadataFormatError naming ``source``. Nothing
    in ``data`` can run code: only the DCP metadata classes and plain values are ever built.

    ``state_dict_metadata`` is always decoded in full. With ``lazy`` (the default) a version-2
    ``storage_data`` is a read-only :class:`~s3dcp.format.metadata.v2.LazyStorageData` mapping that
    builds each ItemLocation when it is looked up; ``lazy=False`` (and version 1) gives a dict.
    """
    try:
        data = bytes(data)
        with _gc_paused():
            if data[:1] == b"\x89":
                if data.startswith(v2.MAGIC):
                    return v2.decode(data, lazy=lazy)
                raise MetadataFormatError("not s3dcp metadata: starts with byte 0x89 but not with the s3dcp magic")
            return plain_v1.decode(data)
    except MetadataFormatError as e:
        raise MetadataFormatError(f"{source}: {e}") from None
    except (KeyError, IndexError, TypeError, ValueError, OverflowError, RecursionError) as e:
        # Safety net: a malformed document must surface as a format error, whatever tripped on it.
        raise MetadataFormatError(f"{source}: corrupt s3dcp metadata ({type(e).__name__}: {e})") from e


@contextlib.contextmanager
def _gc_paused():
    """Pause Python's cyclic garbage collector while a decode runs.

    A decode allocates up to millions of objects (chunk boxes, keys, locations), and the collector
    runs every few hundred allocations, walking ever more of them: at 115k chunks that is over 80%
    of a full decode (and of unpickling DCP's metadata too). What a decode builds holds no reference
    cycles, so there is nothing for the collector to find; it is switched back on afterwards, on
    every path, unless it was off before.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def format_version_of(data: bytes) -> int | None:
    """The format version ``data`` claims (1 or 2, say), or None if it is not s3dcp metadata.

    Reads only the header (v2) or the first fields (v1 as s3dcp writes it), not the whole object.
    """
    if bytes(data[: len(v2.MAGIC)]) == v2.MAGIC:
        try:
            version = v2.header_of(data).get("version")
        except MetadataFormatError:
            return None
        return version if type(version) is int else None
    return plain_v1.version_of(data)
