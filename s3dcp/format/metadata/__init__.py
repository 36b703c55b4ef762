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

Readers refuse another ``format``, a newer ``version`` and any missing or ill-typed field with
:class:`~s3dcp.errors.MetadataFormatError`. Unknown extra fields (and, in version 2, unknown
columns) are ignored, so a later writer may add optional ones without bumping the version.
"""

from __future__ import annotations

import contextlib
import gc
import json

from torch.distributed.checkpoint.metadata import Metadata

from ...errors import MetadataFormatError
from .common import (  # noqa: F401  (the private names: v2 and storage reach them through this package, for now)
    _DTYPES, _LAYOUTS, _MEMORY_FORMATS, _READS, FORMAT_NAME, FORMAT_VERSION, _bool, _check_version,
    _decode_storage_meta, _dict, _encode_storage_meta, _from_name, _get, _int, _list, _opt, _reject_constant,
    _short, _size, _str, _to_name, _type_name, dtype_to_str, str_to_dtype,
)
from .tree import _decode_tree, _encode_tree
from .v1 import _V1_PREFIX, _decode, _encode_storage, _encode_storage_data

__all__ = [
    "FORMAT_NAME", "FORMAT_VERSION", "encode_metadata", "decode_metadata", "format_version_of", "dtype_to_str",
    "str_to_dtype",
]


# ---------------------------------------------------------------------------------------------
# Encoding


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
        from . import v2 as metadata_v2  # imported here: it builds on the helpers of this module

        return metadata_v2.encode(md)
    if version != 1:
        raise ValueError(f"version={version!r}: s3dcp writes metadata format versions {_READS}")
    sdm = {}
    for fqn, item in md.state_dict_metadata.items():
        if type(fqn) is not str:  # json.dumps would silently turn an int key into a string
            raise TypeError(f"state_dict_metadata key {fqn!r} is a {_type_name(fqn)}, not a str")
        sdm[fqn] = _encode_storage(item, f"state_dict_metadata[{fqn!r}]")
    doc = {
        "format": FORMAT_NAME,
        "version": 1,
        "dcp_version": md.version,
        "state_dict_metadata": sdm,
        "storage_data": _encode_storage_data(md.storage_data),
        "planner_data": _encode_tree(md.planner_data, "planner_data"),
        "storage_meta": _encode_storage_meta(md.storage_meta),
    }
    # ensure_ascii keeps any str (even a lone surrogate) lossless; allow_nan=False proves the
    # tagged tree left no bare nan/inf behind.
    return json.dumps(doc, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


# ---------------------------------------------------------------------------------------------
# Decoding


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
                from . import v2 as metadata_v2

                if data.startswith(metadata_v2.MAGIC):
                    return metadata_v2.decode(data, lazy=lazy)
                raise MetadataFormatError("not s3dcp metadata: starts with byte 0x89 but not with the s3dcp magic")
            return _decode(data)
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
    from . import v2 as metadata_v2

    if bytes(data[: len(metadata_v2.MAGIC)]) == metadata_v2.MAGIC:
        try:
            version = metadata_v2.header_of(data).get("version")
        except MetadataFormatError:
            return None
        return version if type(version) is int else None
    match = _V1_PREFIX.match(bytes(data[:200]))
    if match:
        return int(match.group(1))
    try:  # JSON in another field order: parse it all
        doc = json.loads(bytes(data))
    except (ValueError, RecursionError):
        return None
    version = doc.get("version") if type(doc) is dict and doc.get("format") == FORMAT_NAME else None
    return version if type(version) is int else None


