"""Checked access to decoded JSON, for every metadata format version: exact type checks whose errors
name the field (``metadata.storage_data.rows: expected a JSON integer, got a JSON string``), so
untrusted metadata is refused with a :class:`~s3dcp.errors.MetadataFormatError` that says where.
A ``where`` is text or an :class:`~s3dcp.format.context.At`, made into text only by an error.
"""

from __future__ import annotations

from typing import Any, Callable

from ...errors import MetadataFormatError
from ..context import At, shown

# ---------------------------------------------------------------------------------------------
# Checked access. Type checks are exact, so a JSON true is never taken for the integer 1.


def _get(obj: Any, key: str, where: str, check: Callable[[Any, str], Any] | None = None) -> Any:
    """``obj[key]`` of a JSON object, passed through ``check(value, path)`` when given."""
    if type(obj) is not dict:
        raise MetadataFormatError(f"{where}: expected a JSON object, got a JSON {_json_type(obj)}")
    if key not in obj:
        raise MetadataFormatError(f"{where}: missing field {key!r}")
    return obj[key] if check is None else check(obj[key], At(where, ".", key))


def _exact(t: type, name: str) -> Callable[[Any, str], Any]:
    def check(value: Any, where: str) -> Any:
        if type(value) is not t:
            raise MetadataFormatError(f"{where}: expected a JSON {name}, got a JSON {_json_type(value)}")
        return value

    return check


_str, _int, _bool = _exact(str, "string"), _exact(int, "integer"), _exact(bool, "boolean")
_list, _dict = _exact(list, "array"), _exact(dict, "object")


def _opt(check: Callable[[Any, str], Any]) -> Callable[[Any, str], Any]:
    return lambda value, where: None if value is None else check(value, where)


def _ints(value: Any, where: str) -> tuple[int, ...]:
    if type(value) is not list or any(type(v) is not int for v in value):
        raise MetadataFormatError(f"{where}: expected an array of integers, got {_short(value)}")
    return tuple(value)


# Parsing JSON is bounded by its size, except that an array or object costs ~60 bytes of memory
# for its 2 or 3 bytes of text ("[],"), and decoding copies the tree once more. What s3dcp writes
# has one per >= 30 bytes (a format-1 document, a format-2 header); more is refused before parsing.
MIN_CONTAINERS = 2**18
BYTES_PER_CONTAINER = 12


def check_containers(text: bytes | memoryview, where: str) -> None:
    """Refuse JSON ``text`` holding more arrays and objects than s3dcp writes in as many bytes,
    before it is parsed (a 9.9 MB format-2 header of ``[],`` took +469 MiB and 5 s to parse)."""
    raw = bytes(text) if type(text) is not bytes else text
    containers = raw.count(b"[") + raw.count(b"{")
    if containers > max(MIN_CONTAINERS, len(raw) // BYTES_PER_CONTAINER):
        raise MetadataFormatError(
            f"{where}: {containers} JSON arrays and objects in {len(raw)} bytes, more than s3dcp writes "
            "(one per 30 bytes or more); the object is damaged or crafted")


def _reject_constant(name: str) -> Any:
    raise MetadataFormatError(f"non-standard JSON constant {name}")


def _json_type(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", int: "integer", float: "number", bool: "boolean"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _type_name(value: Any) -> str:
    t = type(value)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


_short = shown  # the name this package's modules import
