"""Names of an incremental checkpoint's references, and of its pending-references marker (pure: no
client; no torch unless a metadata object must be decoded in full).

References are plain object names relative to the checkpoint directory, so the metadata format
does not change: ``"__0_0.tok.distcp"`` is the checkpoint's own object, ``"../<sibling>/<name>"``
one of a sibling under the same parent prefix (:func:`s3dcp.uri.object_key` resolves and
polices them). Loading an incremental checkpoint reads exactly the bytes a full one would,
only from other keys, and verifies them against the same checksums. Hence a base must be a
sibling (:func:`check_base`).
"""

from __future__ import annotations

import json
import struct
import zlib
from typing import Iterable

from ..errors import ConfigError, MetadataFormatError
from ..uri import S3Uri, parent_prefix
from .layout import ItemLocation
from .metadata.fields import check_containers

__all__ = [
    "REFERENCE_CHECKSUM", "is_reference", "split_reference", "reference_name", "check_base", "sources", "object_names",
    "encode_pending", "pending_names",
]


REFERENCE_CHECKSUM = "crc64nvme"  # the per-item checksum incremental saves record and compare


def is_reference(object_name: str) -> bool:
    """Whether ``object_name`` (relative to a checkpoint) names an object of a sibling."""
    return object_name.startswith("../")


def split_reference(object_name: str) -> tuple[str | None, str]:
    """``("step-1000", "__0_0.tok.distcp")`` for a reference, ``(None, name)`` for an own object."""
    if is_reference(object_name):
        _, directory, name = object_name.split("/", 2)
        return directory, name
    return None, object_name


def reference_name(directory: str, name: str) -> str:
    """The object name, relative to a checkpoint, of object ``name`` of sibling ``directory``."""
    return f"../{directory}/{name}"


def check_base(target: S3Uri, base: S3Uri) -> None:
    """Refuse a base that is not a sibling of ``target`` (same bucket, same parent prefix,
    another directory): references are ``../<sibling>/<name>`` and deletion counts them per
    parent prefix, so a base anywhere else could be deleted under the checkpoint."""
    if base.bucket != target.bucket or parent_prefix(base) != parent_prefix(target) or not target.prefix \
            or base.prefix == target.prefix or not base.prefix:
        raise ConfigError(
            f"incremental_from={str(base)!r} cannot be the base of {target}: a base must be another "
            f"checkpoint in the same directory (s3://{target.bucket}/{parent_prefix(target)}<name>), so that "
            "its objects are counted as referenced before anything there is deleted")


def sources(locations: Iterable[ItemLocation]) -> dict:
    """Where a checkpoint's item bytes are: ``{"written": {"items", "bytes"}, "inherited":
    {"<sibling>": {"items", "bytes"}}}`` (what ``s3dcp inspect`` shows)."""
    out: dict = {"written": {"items": 0, "bytes": 0}, "inherited": {}}
    for loc in locations:
        directory = split_reference(loc.object_name)[0]
        entry = (out["written"] if directory is None
                 else out["inherited"].setdefault(directory, {"items": 0, "bytes": 0}))
        entry["items"] += 1
        entry["bytes"] += loc.length
    return out




_V2_MAGIC = b"\x89S3DCPMD"  # s3dcp.format.metadata.plain_v2.MAGIC, repeated: `ls` and `rm` stay off the decoder's imports
_V2_HEAD = struct.Struct("<8sQ")


def object_names(raw: bytes, source: str) -> set[str]:
    """The object names a ``.metadata`` object uses. Versions 1 (one JSON document) and 2 (its
    header's interned ``object_names``, after checking the trailer CRC) are read directly, so
    ``s3dcp ls`` and ``rm`` stay light; anything else (version 3, whose header is packed, or a
    damaged object) is decoded by :func:`s3dcp.format.metadata.decode_plain`, which also says
    what is wrong with it. None of this imports torch."""
    names = _v2_names(raw) if raw[:len(_V2_MAGIC)] == _V2_MAGIC else _v1_names(raw)
    if names is not None:
        return names
    from .metadata import decode_plain

    storage = decode_plain(raw, source=source).storage
    return set() if storage is None else {loc.object_name for loc in storage.locations()}


def _v1_names(raw: bytes) -> set[str] | None:
    try:
        check_containers(raw, "metadata")  # the decoder's bound, before parsing
        doc = json.loads(raw)
        if doc.get("format") != "s3dcp-metadata" or doc.get("version") != 1:
            return None
        names = {entry["location"]["object_name"] for entry in doc.get("storage_data") or []}
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError, MetadataFormatError):
        return None  # the decoder says what is wrong
    return names if all(isinstance(n, str) for n in names) else None


def _v2_names(raw: bytes) -> set[str] | None:
    view = memoryview(raw)
    try:
        _, head_len = _V2_HEAD.unpack_from(view)
        if _V2_HEAD.size + head_len + 4 > len(view) or \
                zlib.crc32(view[:-4]) != struct.unpack_from("<I", view, len(view) - 4)[0]:
            return None
        text = bytes(view[_V2_HEAD.size:_V2_HEAD.size + head_len])
        check_containers(text, "metadata header")  # the decoder's bound, before parsing
        header = json.loads(text)
        if header.get("format") != "s3dcp-metadata" or header.get("version") != 2:
            return None
        storage = header.get("storage_data")
        names = set(_list_of_names(storage["object_names"])) if storage is not None else set()
    except (struct.error, ValueError, KeyError, TypeError, AttributeError, RecursionError, MetadataFormatError):
        return None  # the decoder says what is wrong
    return names


def _list_of_names(value) -> list:
    """``value`` if it is a JSON list of strings; else ValueError (a string or an object would
    turn into a set of its characters or keys, names nobody wrote)."""
    if type(value) is not list or not all(type(n) is str for n in value):
        raise ValueError(f"object_names is {type(value).__name__}, not a list of names")
    return value


_PENDING_FORMAT = "s3dcp-pending-references"


def encode_pending(save_id: str, base: str, names: Iterable[str]) -> bytes:
    """The body of a save's ``.pending-references`` marker: the object names (relative to the
    checkpoint, as in its metadata) that the save is about to commit references to."""
    return json.dumps({"format": _PENDING_FORMAT, "version": 1, "save_id": save_id, "base": base,
                       "object_names": sorted(names)}).encode()


def pending_names(raw: bytes, source: str) -> set[str]:
    """The object names a ``.pending-references`` marker lists; :class:`MetadataFormatError`
    naming ``source`` when it is not one."""
    try:
        check_containers(raw, source)
        doc = json.loads(raw)
        if doc.get("format") != _PENDING_FORMAT or doc.get("version") != 1:
            raise ValueError(f"format {doc.get('format')!r} version {doc.get('version')!r}")
        names = set(_list_of_names(doc["object_names"]))
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise MetadataFormatError(f"{source} is not a pending-references marker of s3dcp ({e})") from e
    return names
