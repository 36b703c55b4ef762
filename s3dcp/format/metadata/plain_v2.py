"""Metadata format version 2 without torch: its fixed header and JSON header (see :mod:`s3dcp.format.metadata.v2`)."""

from __future__ import annotations

import json
import struct

from ...errors import MetadataFormatError
from .common import FORMAT_NAME
from .fields import _reject_constant

__all__ = ["MAGIC", "VERSION", "header_of"]

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
    try:
        header = json.loads(bytes(view[_HEAD.size:_HEAD.size + head_len]).decode("utf-8"),
                            parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise MetadataFormatError(f"corrupt s3dcp metadata header: not valid JSON ({e})") from None
    if type(header) is not dict or header.get("format") != FORMAT_NAME:
        raise MetadataFormatError(f"corrupt s3dcp metadata header: format is not {FORMAT_NAME!r}")
    return header
