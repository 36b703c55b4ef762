"""torch's dtypes, layouts and memory formats by canonical name, for the DCP side of the format.

:func:`dtype_to_str` and :func:`str_to_dtype` map ``torch.float32`` <-> ``"float32"``; the tables
are read from torch itself, so a future torch's new dtypes need no code change here. The torch-free
side checks the same names against :mod:`s3dcp.format.metadata.names`.
"""

from __future__ import annotations

from typing import Any

import torch

from ...errors import MetadataFormatError
from .fields import _short

__all__ = ["dtype_to_str", "str_to_dtype"]


def _name_table(kind: type) -> dict[str, Any]:
    # Keyed by str() without "torch.", so aliases (torch.half, torch.long, ...) collapse onto one
    # canonical name and new dtypes of future torch releases are picked up without a code change.
    return {str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, kind)}


_DTYPES: dict[str, torch.dtype] = _name_table(torch.dtype)
_LAYOUTS: dict[str, torch.layout] = _name_table(torch.layout)
_MEMORY_FORMATS: dict[str, torch.memory_format] = _name_table(torch.memory_format)


def _to_name(table: dict[str, Any], value: Any, what: str) -> str:
    name = str(value).removeprefix("torch.")
    if table.get(name) is not value:
        raise TypeError(f"cannot encode {what} {value!r}: not a known torch {what}")
    return name


def _from_name(table: dict[str, Any], name: Any, what: str) -> Any:
    if type(name) is not str or name not in table:
        raise MetadataFormatError(
            f"unknown torch {what} {_short(name)} (torch {torch.__version__} has no such {what})"
        )
    return table[name]


def dtype_to_str(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (the canonical name, so ``torch.half`` gives ``"float16"``)."""
    return _to_name(_DTYPES, dtype, "dtype")


def str_to_dtype(name: str) -> torch.dtype:
    """``"float32"`` -> ``torch.float32``; an unknown name raises MetadataFormatError."""
    return _from_name(_DTYPES, name, "dtype")
