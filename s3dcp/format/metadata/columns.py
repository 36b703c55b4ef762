"""Typed binary columns for metadata format version 2: how a list of numbers is stored and read back.

A column is a list of integers stored as one little-endian numpy array of the narrowest type that
holds it (``u1``, ``u2``, ``u4``, ``u8``, else ``i8``; anything outside 64 bits is stored as a JSON
list of integers, type ``json``), optionally compressed. Its header entry says how to read it::

    "sd.length": {"type": "u4", "count": 921600, "offset": 1234, "length": 503112, "codec": "shuffle-zlib"}

``offset``/``length`` locate the stored bytes in the body. Codecs: ``none``; ``zlib``; ``shuffle-zlib``
(bytes regrouped by significance before zlib: byte 0 of every value, then byte 1, ... — the high
bytes of offsets and sizes are mostly equal and compress to almost nothing). The writer keeps
the smaller of plain and compressed, so incompressible columns (checksums) cost no inflate time.

:class:`ColumnWriter` builds the body; :class:`ColumnReader` checks every entry against the body
(bounds, type, decompressed size) and raises MetadataFormatError naming the column. It checks
before it reads: a column's declared size is charged to the decode's
:class:`~s3dcp.format.metadata.budget.DecodeBudget` and compared with what its stored bytes can
hold (a plain column is exactly ``count x width`` bytes; zlib inflates at most ~1,032:1; a JSON
integer takes at least two bytes) before anything is inflated or parsed, and the inflating itself
stops at the declared size.
"""

from __future__ import annotations

import json
import zlib
from typing import Any, Sequence

import numpy as np

from ...errors import MetadataFormatError
from .budget import DecodeBudget

__all__ = ["ColumnWriter", "ColumnReader", "TYPES", "MAX_COUNT", "bounded"]

# Little-endian on every machine: the file is the same wherever it is written.
TYPES: dict[str, np.dtype] = {name: np.dtype("<" + name) for name in ("u1", "u2", "u4", "u8", "i8")}
_UNSIGNED = [("u1", 2**8), ("u2", 2**16), ("u4", 2**32), ("u8", 2**64)]
_CODECS = ("none", "zlib", "shuffle-zlib")
_MIN_COMPRESS_BYTES = 64  # below this zlib's header eats the gain
_ZLIB_LEVEL = 6
MAX_COUNT = 2**32  # no ndim, chunk position or per-item count is this large; sums of them cannot wrap
_ZLIB_MAX_RATIO = 1032  # deflate's best: 258 bytes per 2-bit code, ~1,032:1; plus a little for headers
_ZLIB_SLACK_BYTES = 1024


def _narrowest(values: Sequence[int]) -> str:
    if not values:
        return "u1"
    lo, hi = min(values), max(values)
    if lo >= 0:
        for name, bound in _UNSIGNED:
            if hi < bound:
                return name
    elif lo >= -(2**63) and hi < 2**63:
        return "i8"
    return "json"


class ColumnWriter:
    """Collects columns; ``header()`` describes them and ``body()`` holds their bytes, in the order added."""

    def __init__(self) -> None:
        self._entries: dict[str, dict[str, Any]] = {}
        self._chunks: list[bytes] = []
        self._size = 0

    def ints(self, name: str, values: Sequence[int]) -> None:
        """Store ``values`` (Python ints, or an integer numpy array) as column ``name``."""
        if name in self._entries:
            raise ValueError(f"column {name!r} written twice")
        if isinstance(values, np.ndarray):
            values = values.tolist()
        kind = _narrowest(values)
        if kind == "json":
            raw, codec = json.dumps(list(values), separators=(",", ":")).encode("ascii"), "none"
        else:
            raw = np.array(values, dtype=TYPES[kind]).tobytes()
            raw, codec = self._compress(raw, TYPES[kind].itemsize)
        self._entries[name] = {"type": kind, "count": len(values), "offset": self._size, "length": len(raw),
                               "codec": codec}
        self._chunks.append(raw)
        self._size += len(raw)

    @staticmethod
    def _compress(raw: bytes, width: int) -> tuple[bytes, str]:
        if len(raw) < _MIN_COMPRESS_BYTES:
            return raw, "none"
        if width > 1:
            shuffled = np.frombuffer(raw, np.uint8).reshape(-1, width).T.tobytes()
            packed, codec = zlib.compress(shuffled, _ZLIB_LEVEL), "shuffle-zlib"
        else:
            packed, codec = zlib.compress(raw, _ZLIB_LEVEL), "zlib"
        # Keep it only when it pays: inflating costs decode time on every rank.
        return (packed, codec) if len(packed) < 0.9 * len(raw) else (raw, "none")

    def header(self) -> dict[str, dict[str, Any]]:
        return self._entries

    def body(self) -> bytes:
        return b"".join(self._chunks)


class ColumnReader:
    """Reads the columns a header describes out of ``body``; every access is checked."""

    def __init__(self, entries: Any, body: memoryview, budget: DecodeBudget) -> None:
        if type(entries) is not dict:
            raise MetadataFormatError("metadata.columns: expected a JSON object")
        self._entries = entries
        self._body = body
        self._budget = budget

    def has(self, name: str) -> bool:
        return name in self._entries

    def count(self, name: str) -> int:
        """How many values column ``name`` declares, checked to be a non-negative integer; nothing is read."""
        return self._entry(name)[1]["count"]

    def _entry(self, name: str) -> tuple[dict, dict]:
        where = f"metadata.columns[{name!r}]"
        entry = self._entries.get(name)
        if entry is None:
            raise MetadataFormatError(f"{where}: missing column")
        if type(entry) is not dict:
            raise MetadataFormatError(f"{where}: expected a JSON object")
        fields = {}
        for key in ("count", "offset", "length"):
            value = entry.get(key)
            if type(value) is not int or value < 0:
                raise MetadataFormatError(f"{where}.{key}: expected a non-negative integer, got {value!r}")
            fields[key] = value
        return entry, fields

    def ints(self, name: str, count: int | None = None) -> np.ndarray:
        """Column ``name`` as a read-only 1-D numpy array (int64 for ``json`` columns).

        ``count``, when given, is the length the rest of the file implies; a column of another
        length is an error. Unknown columns are never asked for, so a later writer may add some.
        """
        where = f"metadata.columns[{name!r}]"
        entry, fields = self._entry(name)
        kind, codec = entry.get("type"), entry.get("codec")
        if type(kind) is not str or type(codec) is not str:
            raise MetadataFormatError(f"{where}: type and codec must be JSON strings, got {kind!r}, {codec!r}"[:300])
        if kind not in TYPES and kind != "json":
            raise MetadataFormatError(f"{where}.type: unknown column type {kind!r}")
        if codec not in _CODECS:
            raise MetadataFormatError(f"{where}.codec: unknown codec {codec!r}")
        n, start, length = fields["count"], fields["offset"], fields["length"]
        if count is not None and n != count:
            raise MetadataFormatError(f"{where}: {n} values, expected {count}")
        if start + length > len(self._body):
            raise MetadataFormatError(
                f"{where}: bytes {start}..{start + length} lie past the end of the body ({len(self._body)} bytes); "
                "the object is truncated")
        raw: bytes | memoryview = self._body[start:start + length]
        if kind == "json":
            if codec != "none":
                raise MetadataFormatError(f"{where}: a json column is never compressed")
            if n > (length + 1) // 2:  # "[1,2]": every value takes a digit and a separator
                raise MetadataFormatError(f"{where}: {n} values cannot fit in {length} bytes of JSON")
            self._budget.column(where, n, 8)
            try:
                values = json.loads(bytes(raw))
            except (ValueError, RecursionError) as e:
                raise MetadataFormatError(f"{where}: not a JSON array ({e})") from None
            if type(values) is not list or len(values) != n or any(type(v) is not int for v in values):
                raise MetadataFormatError(f"{where}: expected a JSON array of {n} integers")
            if any(not -(2**63) <= v < 2**63 for v in values):
                # Kept exact as Python ints in an object array; still indexable like the others.
                return np.array(values, dtype=object)
            return np.array(values, dtype=np.int64)
        dtype = TYPES[kind]
        expected = n * dtype.itemsize
        if codec == "none" and length != expected:
            raise MetadataFormatError(f"{where}: {length} bytes, expected {expected} for {n} x {kind}")
        if codec != "none" and expected > _ZLIB_MAX_RATIO * length + _ZLIB_SLACK_BYTES:
            raise MetadataFormatError(
                f"{where}: declares {n} x {kind} = {expected} bytes compressed into {length}: "
                "more than zlib can inflate to")
        self._budget.column(where, n, dtype.itemsize)
        if codec != "none":
            try:
                d = zlib.decompressobj()
                raw = d.decompress(raw, expected + 1)  # never more than declared, whatever the stream says
                if not d.eof or d.unused_data:
                    raise MetadataFormatError(f"{where}: compressed stream is incomplete or has trailing bytes")
            except zlib.error as e:
                raise MetadataFormatError(f"{where}: corrupt compressed data ({e})") from None
        if len(raw) != expected:
            raise MetadataFormatError(f"{where}: {len(raw)} bytes, expected {expected} for {n} x {kind}")
        if codec == "shuffle-zlib" and n:
            return np.frombuffer(raw, np.uint8).reshape(dtype.itemsize, n).T.copy().view(dtype).reshape(n)
        return np.frombuffer(raw, dtype)

    def ragged(self, name: str, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(lengths, start of each and the end, flat values) of the column pair ``name.len`` / ``name``."""
        lengths = bounded(self.ints(name + ".len", n), MAX_COUNT, f"metadata.columns[{name + '.len'!r}]")
        starts = np.zeros(n + 1, np.int64)
        np.cumsum(lengths, out=starts[1:])
        return lengths, starts, self.ints(name, int(starts[-1]))


def bounded(arr: np.ndarray, limit: int, where: str) -> np.ndarray:
    """``arr`` after checking every value is in ``0..limit-1`` (``limit`` <= 2**62).

    Narrow unsigned columns stay as they are (widening a u1 column to int64 costs 8x its memory);
    ``u8``, ``i8`` and ``json`` columns become int64, so no arithmetic with them turns to float.
    """
    if arr.size and (arr.dtype == object or int(arr.max()) >= limit or int(arr.min()) < 0):
        raise MetadataFormatError(f"{where}: a value is outside 0..{limit - 1}")
    if arr.dtype in (np.uint8, np.uint16, np.uint32):
        return arr
    return arr.astype(np.int64, copy=False)
