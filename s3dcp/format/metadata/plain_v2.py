"""Metadata format version 2 read back without torch: the fixed header, the JSON header, the columns.

The layout of the object is described in :mod:`s3dcp.format.metadata.v2` (which writes it).
:func:`decode` checks the version, the trailer CRC, and every column through a budget set by the
object's size, and gives a :class:`~s3dcp.format.metadata.plain.PlainMetadata` whose storage is
the validated :class:`~s3dcp.format.metadata.rows.Rows` (keys and locations built on request).
"""

from __future__ import annotations

import json
import struct
import zlib
from typing import Any, Callable

from ...errors import MetadataFormatError
from .budget import DecodeBudget
from .chunks import Chunks
from .columns import ColumnReader
from .common import FORMAT_NAME, _check_version, _decode_storage_meta
from .fields import check_containers, _get, _int, _list, _opt, _reject_constant, _str
from .plain import PlainMetadata
from .rows import Rows
from .tree import decode_tree

__all__ = ["MAGIC", "VERSION", "header_of", "after_header", "decode", "build"]

MAGIC = b"\x89S3DCPMD"
VERSION = 2
_HEAD = struct.Struct("<8sQ")
_TRAILER = struct.Struct("<I")


def header_of(data: bytes | memoryview) -> dict:
    """The JSON header of a version-2 object (not checked beyond being a JSON object with our format)."""
    view = memoryview(data)
    if len(view) < _HEAD.size + _TRAILER.size:
        raise MetadataFormatError(f"truncated s3dcp metadata: {len(view)} bytes, shorter than the fixed header")
    _, head_len = _HEAD.unpack_from(view)
    if _HEAD.size + head_len + _TRAILER.size > len(view):
        raise MetadataFormatError(
            f"truncated s3dcp metadata: the header says {head_len} header bytes, the object has {len(view)} in all")
    text = bytes(view[_HEAD.size:_HEAD.size + head_len])
    check_containers(text, "corrupt s3dcp metadata header")  # the bound of a format-1 document
    try:
        header = json.loads(text.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise MetadataFormatError(f"corrupt s3dcp metadata header: not valid JSON ({e})") from None
    if type(header) is not dict or header.get("format") != FORMAT_NAME:
        raise MetadataFormatError(f"corrupt s3dcp metadata header: format is not {FORMAT_NAME!r}")
    return header


def decode(data: bytes | memoryview, *, header: dict | None = None) -> PlainMetadata:
    """Decode a version-2 object (``data`` starts with :data:`MAGIC`); see the module docstring.

    ``header``: what :func:`header_of` gave for ``data``, when the caller has already read it.
    """
    view = memoryview(data)
    header = header_of(view) if header is None else header
    # The version is checked before anything else is read: a newer layout may differ anywhere.
    _check_version(_get(header, "version", "metadata", _int), VERSION)
    return build(header, after_header(view), DecodeBudget(len(view)), version=VERSION,
                 planner_data=lambda fqns: decode_tree(_get(header, "planner_data", "metadata"), "planner_data"))


def after_header(data: bytes | memoryview) -> memoryview:
    """The bytes between the (outer) JSON header and the trailer of a version-2 or -3 object,
    once the object's length and its trailer CRC are checked."""
    view = memoryview(data)
    if len(view) < _HEAD.size + _TRAILER.size:
        raise MetadataFormatError(f"truncated s3dcp metadata: {len(view)} bytes, shorter than the fixed header")
    head_end = _HEAD.size + _HEAD.unpack_from(view)[1]
    if head_end + _TRAILER.size > len(view):
        raise MetadataFormatError(
            f"truncated s3dcp metadata: the header says {head_end - _HEAD.size} header bytes, the object has "
            f"{len(view)} in all")
    (crc,) = _TRAILER.unpack_from(view, len(view) - _TRAILER.size)
    if zlib.crc32(view[:-_TRAILER.size]) != crc:
        raise MetadataFormatError("corrupt s3dcp metadata: the CRC32 of its bytes does not match its trailer "
                                  "(truncated or damaged object)")
    return view[head_end:-_TRAILER.size]


def build(header: dict, body: memoryview, budget: DecodeBudget, *, version: int,
          planner_data: Callable[[list[str]], Any]) -> PlainMetadata:
    """The plain metadata of a version-2 ``header`` and column ``body`` (also version 3's, once
    unpacked). ``planner_data(fqns)`` decodes the planner data, given the header's checked fqn table."""
    cols = ColumnReader(_get(header, "columns", "metadata"), body, budget)
    fqns = _get(header, "fqns", "metadata", _list)
    for i, f in enumerate(fqns):
        _str(f, f"metadata.fqns[{i}]")
    budget.names("metadata.fqns", fqns, "fqns")
    if len(set(fqns)) != len(fqns):
        raise MetadataFormatError("metadata.fqns: duplicate names")
    n_sdm = _get(header, "state_dict_entries", "metadata", _int)
    if not 0 <= n_sdm <= len(fqns):
        raise MetadataFormatError(f"metadata.state_dict_entries: {n_sdm} is not in 0..{len(fqns)}")
    chunks = Chunks(header, cols, fqns[:n_sdm], budget)
    storage = _get(header, "storage_data", "metadata")
    storage_meta = _get(header, "storage_meta", "metadata")
    rows = None if storage is None else Rows(storage, cols, fqns, chunks, budget)
    return PlainMetadata(
        version=version,
        dcp_version=_get(header, "dcp_version", "metadata", _opt(_str)),
        state_dict=chunks.state_dict,
        storage=rows,
        planner_data=planner_data(fqns),
        storage_meta=None if storage_meta is None else _decode_storage_meta(storage_meta),
    )
