"""Checked access to decoded JSON, for every metadata format version: exact type checks whose errors
name the field (``metadata.storage_data.rows: expected a JSON integer, got a JSON string``), so
untrusted metadata is refused with a :class:`~s3dcp.errors.MetadataFormatError` that says where.
"""

from __future__ import annotations

from typing import Any, Callable

from ...errors import MetadataFormatError

# ---------------------------------------------------------------------------------------------
# Checked access. Type checks are exact, so a JSON true is never taken for the integer 1.


def _get(obj: Any, key: str, where: str, check: Callable[[Any, str], Any] | None = None) -> Any:
    """``obj[key]`` of a JSON object, passed through ``check(value, path)`` when given."""
    if type(obj) is not dict:
        raise MetadataFormatError(f"{where}: expected a JSON object, got a JSON {_json_type(obj)}")
    if key not in obj:
        raise MetadataFormatError(f"{where}: missing field {key!r}")
    return obj[key] if check is None else check(obj[key], f"{where}.{key}")


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


def _reject_constant(name: str) -> Any:
    raise MetadataFormatError(f"non-standard JSON constant {name}")


def _json_type(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", int: "integer", float: "number", bool: "boolean"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _type_name(value: Any) -> str:
    t = type(value)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
