"""Decoding either format version into plain values, without torch: the one decoder.

:func:`decode_plain` tells the versions apart by the first byte (0x89: version 2,
:mod:`~s3dcp.format.metadata.plain_v2`, or 3, :mod:`~s3dcp.format.metadata.v3`, by the header's
version; else version 1's JSON, :mod:`~s3dcp.format.metadata.plain_v1`)
and gives a :class:`~s3dcp.format.metadata.plain.PlainMetadata`, every structural check and bound
done. :func:`s3dcp.format.metadata.decode_metadata` is this plus building DCP's classes from the
result (:mod:`s3dcp.format.metadata.dcp`), inside the same :func:`decoding` guard.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator

from ...errors import MetadataFormatError
from . import planner, plain_v1, plain_v2, v3
from .budget import DecodeBudget
from .fields import _get
from .paths import check_paths
from .plain import PlainMetadata
from .tree import decode_tree

__all__ = ["decode_plain", "format_version_of", "decoding"]


def decode_plain(data: bytes, *, source: str = "<metadata>") -> PlainMetadata:
    """Decode bytes written by :func:`~s3dcp.format.metadata.encode_metadata` (version 1, 2 or 3) into
    plain values; anything else raises MetadataFormatError naming ``source``, exactly as
    :func:`~s3dcp.format.metadata.decode_metadata` does. Nothing in ``data`` can run code."""
    with decoding(source):
        return decode_either(bytes(data))


def decode_either(data: bytes) -> PlainMetadata:
    """The decode itself, without the guard (callers hold :func:`decoding`)."""
    if data[:1] == b"\x89":
        if not data.startswith(plain_v2.MAGIC):
            raise MetadataFormatError("not s3dcp metadata: starts with byte 0x89 but not with the s3dcp magic")
        plain = _decode_binary(data)
    else:
        plain = plain_v1.decode(data)
    # what a load into an empty state dict builds from the paths of the stored items, bounded
    check_paths(plain.planner_data, plain.state_dict, DecodeBudget(len(data)))
    return plain


def _decode_binary(data: bytes) -> PlainMetadata:
    """Version 2, or version 3: its header unpacked, then built by version 2's decoder."""
    outer = plain_v2.header_of(data)
    if outer.get("version") != v3.VERSION:
        return plain_v2.decode(data, header=outer)
    header, body = v3.unpack(data, outer)
    budget = DecodeBudget(len(data))
    pd = _get(header, "planner_data", "metadata")
    return plain_v2.build(header, body, budget, version=v3.VERSION,
                          planner_data=lambda fqns: planner.expand(pd, fqns, budget, decode_tree))


@contextlib.contextmanager
def decoding(source: str) -> Iterator[None]:
    """Around a decode: errors name ``source``, anything that trips on a malformed document
    surfaces as MetadataFormatError, and Python's cyclic GC is paused.

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
    except MetadataFormatError as e:
        raise MetadataFormatError(f"{source}: {e}") from None
    except (KeyError, IndexError, TypeError, ValueError, OverflowError, RecursionError) as e:
        # Safety net: a malformed document must surface as a format error, whatever tripped on it.
        raise MetadataFormatError(f"{source}: corrupt s3dcp metadata ({type(e).__name__}: {e})") from e
    finally:
        if was_enabled:
            gc.enable()


def format_version_of(data: bytes) -> int | None:
    """The format version ``data`` claims (1, 2 or 3, say), or None if it is not s3dcp metadata.

    Reads only the (outer) header (v2, v3) or the first fields (v1 as s3dcp writes it), not the whole object.
    """
    if bytes(data[: len(plain_v2.MAGIC)]) == plain_v2.MAGIC:
        try:
            version = plain_v2.header_of(data).get("version")
        except MetadataFormatError:
            return None
        return version if type(version) is int else None
    return plain_v1.version_of(data)
