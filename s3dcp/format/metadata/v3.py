"""Metadata format version 3: version 2's columns under a compressed header, planner data by reference.

Why: version 2 is ~1/40 of DCP's pickle when a checkpoint is many ranks of few tensors, but one
rank of 20,000 uniquely named small tensors (an MoE with unstacked experts) has little for its
columns to share: its header (fqns and ``planner_data``, ~100 bytes per tensor each) is most of
the object, 0.60x the pickle. Version 3 stores ``planner_data`` as references into the fqn table
(:mod:`s3dcp.format.metadata.planner`: the common DCP paths cost nothing per entry) and the
header zlib-compressed (:mod:`s3dcp.format.metadata.packing`). The columns are version 2's, byte
for byte. Layout (integers little-endian)::

    magic     8 bytes  b"\\x89S3DCPMD"  (version 2's)
    length    8 bytes  u64, length of the outer header
    outer     JSON: {"format": "s3dcp-metadata", "version": 3, "header": {"codec", "length", "size"}}
    header    "length" bytes: version 2's header (less format and version), packed; its
              "planner_data" in planner.py's form
    body      the columns, as in version 2 (their offsets count from here)
    crc32     4 bytes  zlib.crc32 of everything before it

The outer header is plain JSON in version 2's place, so a reader that knows only version 2 reads
``"version": 3`` and refuses the object by name ("written by a newer s3dcp"), rather than reading
a ``planner_data`` it does not know. For the same reason a writer uses version 3 only when it
pays (:func:`worth_it`): the default stays version 2, readable by every s3dcp since it.

This module is plain data (no torch): :func:`encode` turns version-2 bytes into version-3 bytes,
:func:`unpack` turns version-3 bytes back into version 2's header (its ``planner_data`` still in
planner.py's form) and body, which version 2's decoder builds a Metadata from.
"""

from __future__ import annotations

import json
import struct
import zlib
from typing import Any

from ...errors import MetadataFormatError
from . import packing, planner
from .common import FORMAT_NAME
from .fields import _short
from .plain_v2 import _HEAD, _TRAILER, MAGIC, after_header  # the outer header is version 2's header, read the same way

__all__ = ["MAGIC", "VERSION", "encode", "unpack", "worth_it", "MIN_SAVING_BYTES", "MIN_SAVING_FRACTION"]

VERSION = 3
MIN_SAVING_BYTES = 64 * 1024
MIN_SAVING_FRACTION = 1 / 8
_OUTER_FIELDS = ("format", "version")


def worth_it(v2_bytes: int, v3_bytes: int) -> bool:
    """Whether a writer that was not asked for a version uses 3: it saves >= 64 KiB and >= 1/8 of
    the version-2 object. Below that, readability by older s3dcp (version 2) is worth more."""
    saving = v2_bytes - v3_bytes
    return saving >= MIN_SAVING_BYTES and saving >= MIN_SAVING_FRACTION * v2_bytes


def encode(v2_object: bytes) -> bytes:
    """The version-3 object holding what the version-2 object ``v2_object`` (just encoded) holds."""
    view = memoryview(v2_object)
    (head_len,) = struct.unpack_from("<Q", view, 8)
    header = json.loads(bytes(view[_HEAD.size:_HEAD.size + head_len]))
    body = view[_HEAD.size + head_len:-_TRAILER.size]
    inner = {k: v for k, v in header.items() if k not in _OUTER_FIELDS}
    inner["planner_data"] = planner.compact(header["planner_data"], header["fqns"])
    entry, packed = packing.pack_json(inner)
    outer = json.dumps({"format": FORMAT_NAME, "version": VERSION, "header": entry},
                       ensure_ascii=True, separators=(",", ":")).encode("ascii")
    out = b"".join([_HEAD.pack(MAGIC, len(outer)), outer, packed, body])
    return out + _TRAILER.pack(zlib.crc32(out))


def unpack(data: bytes | memoryview, outer: Any) -> tuple[dict, memoryview]:
    """(header, body) of a version-3 object whose outer header ``outer`` claims version 3.

    The header is version 2's, its ``planner_data`` in :mod:`~s3dcp.format.metadata.planner`'s
    form; ``body`` holds the columns. The CRC is checked first, then the packed header's entry
    (bounded by the object's size before anything is inflated).
    """
    if type(outer) is not dict or outer.get("version") != VERSION or bytes(memoryview(data)[:len(MAGIC)]) != MAGIC:
        raise MetadataFormatError("not an s3dcp metadata object of format version 3")
    rest = after_header(data)
    entry = outer.get("header")
    length = entry.get("length") if type(entry) is dict else None
    if type(length) is not int or not 0 <= length <= len(rest):
        raise MetadataFormatError(
            f"metadata.header.length: {_short(length, 40)} is not a byte count within the object's {len(rest)} "
            "bytes after the outer header")
    header = packing.unpack_json(entry, rest[:length], len(data), "metadata.header")
    if type(header) is not dict:
        raise MetadataFormatError("metadata.header: expected a JSON object")
    return header, rest[length:]
