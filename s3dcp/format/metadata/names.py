"""torch's dtype, layout and memory-format names, and each dtype's element size, without importing torch.

The metadata stores these by name (``"bfloat16"``, ``"strided"``, ``"contiguous_format"``). The
torch-free side of the format (:mod:`s3dcp.format.metadata.plain`, what ``s3dcp inspect`` and
``verify`` read) checks names against these tables; the DCP side turns them into torch objects
(:mod:`s3dcp.format.metadata.dtypes`), which refuses a name the running torch lacks.

The tables are torch 2.13's (``tests/format/test_metadata.py`` compares them with the installed
torch). A dtype a later torch adds is still accepted: a name missing here is looked up in torch
itself, which is imported for that (and only for a name the tables lack).
"""

from __future__ import annotations

import sys

from ...errors import MetadataFormatError
from .fields import _short

__all__ = ["DTYPE_SIZES", "LAYOUTS", "MEMORY_FORMATS", "TABLE_TORCH", "check_name", "element_size"]

TABLE_TORCH = "2.13"  # the torch release these tables were taken from

DTYPE_SIZES: dict[str, int] = {
    "bfloat16": 2, "bits16": 2, "bits1x8": 1, "bits2x4": 1, "bits4x2": 1, "bits8": 1, "bool": 1,
    "complex128": 16, "complex32": 4, "complex64": 8, "float16": 2, "float32": 4, "float4_e2m1fn_x2": 1,
    "float64": 8, "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1, "int1": 1, "int16": 2, "int2": 1, "int3": 1, "int32": 4, "int4": 1, "int5": 1,
    "int6": 1, "int64": 8, "int7": 1, "int8": 1, "qint32": 4, "qint8": 1, "quint2x4": 1, "quint4x2": 1,
    "quint8": 1, "uint1": 1, "uint16": 2, "uint2": 1, "uint3": 1, "uint32": 4, "uint4": 1, "uint5": 1,
    "uint6": 1, "uint64": 8, "uint7": 1, "uint8": 1,
}
LAYOUTS = frozenset({"_mkldnn", "jagged", "sparse_bsc", "sparse_bsr", "sparse_coo", "sparse_csc", "sparse_csr",
                     "strided"})
MEMORY_FORMATS = frozenset({"channels_last", "channels_last_3d", "contiguous_format", "preserve_format"})

_TABLES = {"dtype": DTYPE_SIZES, "layout": LAYOUTS, "memory_format": MEMORY_FORMATS}


def _in_torch(kind: str, name: str) -> bool:
    """Whether the installed torch has ``torch.<name>`` of this kind (a newer torch's addition).
    Imports torch if it is not loaded yet: only a name the tables lack gets here."""
    torch = sys.modules.get("torch")
    if torch is None:
        try:
            import torch
        except ImportError:
            return False
    value = vars(torch).get(name) if not name.startswith("__") else None
    return value is not None and type(value).__name__ == kind and str(value).removeprefix("torch.") == name


def check_name(kind: str, name: object) -> str:
    """``name`` when it is a torch ``kind`` ("dtype", "layout" or "memory_format"); else
    MetadataFormatError naming it."""
    table = _TABLES[kind]
    if type(name) is str and (name in table or _in_torch(kind, name)):
        return name
    raise MetadataFormatError(f"unknown torch {kind} {_short(name)} (not a {kind} of torch {TABLE_TORCH} "
                              "or of the torch installed)")


def element_size(dtype: str | None) -> int | None:
    """Bytes per element of the dtype named ``dtype`` (None for None: a bytes item); an unknown
    name raises MetadataFormatError."""
    if dtype is None:
        return None
    size = DTYPE_SIZES.get(dtype) if type(dtype) is str else None
    if size is None:
        check_name("dtype", dtype)
        size = vars(sys.modules["torch"])[dtype].itemsize
    return size
