"""What s3dcp needs to know about Hugging Face safetensors files. Pure: no I/O.

    file:   [8-byte little-endian header length N][N bytes of JSON header][data section]
    header: {"name": {"dtype": "BF16", "shape": [4096, 4096], "data_offsets": [begin, end]}, ...,
             "__metadata__": {"format": "pt"}}          offsets relative to the data section
    index:  model.safetensors.index.json = {"metadata": {"total_size": N}, "weight_map": {"name": "file"}}

Reading needs only the header, so :class:`s3dcp.interop.safetensors_reader.S3SafetensorsReader` fetches it with a
ranged GET and then fetches exactly the tensor bytes each rank needs. Writing goes through the
``safetensors`` package (:mod:`s3dcp.interop.export`); this module only parses what it wrote.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from ..errors import IncompleteCheckpointError, MetadataFormatError
from .context import quoted, shown

__all__ = [
    "HEADER_LENGTH_BYTES", "INDEX_NAME", "SUFFIX", "DTYPES", "MAX_DIMS", "RESERVED_NAME", "TensorEntry", "Header",
    "header_length", "parse_header", "parse_index", "safetensors_dtype", "shard_file_name", "check_shard_set",
    "MAX_INDEX_BYTES",
]

HEADER_LENGTH_BYTES = 8
INDEX_NAME = "model.safetensors.index.json"
RESERVED_NAME = "__metadata__"  # the header's free-text metadata, never a tensor
SUFFIX = ".safetensors"
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library refuses larger headers too
# A shape's dimensions: NumPy's limit (safetensors' NumPy and Flax loaders share it). torch has
# none on CPU (its CUDA kernels take 25); no model tensor comes near either.
MAX_DIMS = 64
MAX_INDEX_BYTES = 64 << 20  # an index names every tensor once: megabytes at most
# A header is parsed into Python objects of ~50-100 bytes per JSON value; a real one has one value
# per 7 bytes or more (a tensor's entry: 7 values in 50+ bytes). More is refused before parsing.
_BYTES_PER_VALUE = 5
_MIN_VALUES = 1 << 16
_SHAPE_KEY = re.compile(rb'"shape"\s*:\s*\[')

# safetensors dtype names -> torch dtypes (those this torch build has)
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, attr)
    for name, attr in (
        ("BOOL", "bool"), ("U8", "uint8"), ("I8", "int8"), ("I16", "int16"), ("U16", "uint16"),
        ("I32", "int32"), ("U32", "uint32"), ("I64", "int64"), ("U64", "uint64"),
        ("F16", "float16"), ("BF16", "bfloat16"), ("F32", "float32"), ("F64", "float64"),
        ("C64", "complex64"), ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"),
    )
    if hasattr(torch, attr)
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: where its bytes are in the file (absolute offsets)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Header:
    """A parsed header: the tensors in data order, the free-text metadata, the data start."""

    tensors: tuple[TensorEntry, ...]
    metadata: Mapping[str, str]
    data_start: int  # 8 + header length


def header_length(first_bytes: bytes | bytearray | memoryview, *, source: str) -> int:
    """The JSON header's length from a file's first 8 bytes (validated)."""
    if len(first_bytes) < HEADER_LENGTH_BYTES:
        raise MetadataFormatError(f"{source}: {len(first_bytes)} bytes is too short for a safetensors file")
    (n,) = struct.unpack("<Q", bytes(first_bytes[:HEADER_LENGTH_BYTES]))
    if n == 0 or n > _MAX_HEADER_BYTES:
        raise MetadataFormatError(f"{source}: header length {n} is not that of a safetensors file")
    return n


def parse_header(raw: bytes | bytearray | memoryview, *, source: str, file_size: int | None = None) -> Header:
    """Parse a safetensors header from the file's first ``8 + N`` bytes (more may follow).

    Checks what a reader relies on: every tensor's byte count matches its dtype and shape, its
    range lies in the data section (and in the file, when ``file_size`` is known)."""
    n = header_length(raw, source=source)
    if len(raw) < HEADER_LENGTH_BYTES + n:
        raise MetadataFormatError(f"{source}: header says {n} bytes, only {len(raw) - HEADER_LENGTH_BYTES} given")
    text = bytes(raw[HEADER_LENGTH_BYTES:HEADER_LENGTH_BYTES + n])
    _check_before_parsing(text, source)
    try:
        doc = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise MetadataFormatError(f"{source}: the safetensors header is not JSON ({shown(str(e))})") from None
    if not isinstance(doc, dict):
        raise MetadataFormatError(f"{source}: the safetensors header is not a JSON object")
    data_start = HEADER_LENGTH_BYTES + n
    metadata = doc.pop(RESERVED_NAME, None) or {}
    entries = []
    for name, spec in doc.items():
        name_text = quoted(name)
        try:
            dtype_name, dims, (begin, end) = spec["dtype"], spec["shape"], spec["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise MetadataFormatError(f"{source}: tensor {name_text} has a malformed header entry {shown(spec)}") from e
        if type(dtype_name) is not str:
            raise MetadataFormatError(f"{source}: tensor {name_text} has dtype {shown(dtype_name)}: its 'dtype' "
                                      'must be a string such as "BF16"')
        if type(dims) is not list or any(type(d) is not int or d < 0 for d in dims):
            raise MetadataFormatError(f"{source}: tensor {name_text} has shape {shown(dims)}: its 'shape' must be "
                                      "a list of non-negative ints")
        if len(dims) > MAX_DIMS:
            raise MetadataFormatError(f"{source}: tensor {name_text} has a 'shape' of {len(dims)} dimensions, "
                                      f"more than {MAX_DIMS}")
        shape = tuple(dims)
        dtype = DTYPES.get(dtype_name)
        if dtype is None:
            raise MetadataFormatError(f"{source}: tensor {name_text} has dtype {shown(dtype_name)}, which this torch "
                                      f"cannot hold (known: {', '.join(sorted(DTYPES))})")
        expected = math.prod(shape) * dtype.itemsize
        if type(begin) is not int or type(end) is not int or begin < 0 or end - begin != expected:
            raise MetadataFormatError(f"{source}: tensor {name_text} ({dtype_name} {list(shape)}) has data_offsets "
                                      f"{[begin, end]}, expected a range of {expected} bytes")
        if file_size is not None and data_start + end > file_size:
            raise MetadataFormatError(f"{source}: tensor {name_text} ends at byte {data_start + end}, past the end of "
                                      f"the {file_size}-byte file (truncated upload?)")
        entries.append(TensorEntry(name, dtype, shape, data_start + begin, data_start + end))
    entries.sort(key=lambda e: e.start)
    previous = None
    for e in entries:  # as the safetensors library: no two tensors share bytes
        if previous is not None and e.start < previous.end and e.nbytes and previous.nbytes:
            raise MetadataFormatError(f"{source}: tensors {quoted(previous.name)} and {quoted(e.name)} overlap "
                                      f"(bytes {e.start}-{previous.end})")
        previous = e if previous is None or e.end > previous.end else previous
    if not isinstance(metadata, dict) or not all(type(v) is str for v in metadata.values()):
        raise MetadataFormatError(f"{source}: __metadata__ is not a JSON object of strings: {shown(metadata)}")
    return Header(tuple(entries), dict(metadata), data_start)


def _check_before_parsing(text: bytes, source: str) -> None:
    """Refuse a header whose parse would cost far more memory than its bytes, without parsing
    it: a shape of more than :data:`MAX_DIMS` dimensions (a 9.7 MiB header holding one shape of
    3.4 million took +285 MiB and 2.4 s to parse), or more JSON values than a header of tensors
    has in as many bytes. (A shape key written with escapes is caught after parsing, within the
    second bound.)"""
    at = 0
    while (m := _SHAPE_KEY.search(text, at)) is not None:  # each byte looked at once
        end = text.find(b"]", m.end())
        if end < 0:
            break  # not JSON: the parser says so
        at = end + 1
        dims = text.count(b",", m.end(), end) + 1
        if dims > MAX_DIMS:
            raise MetadataFormatError(f"{source}: a tensor's 'shape' in the safetensors header has {dims} "
                                      f"dimensions, more than {MAX_DIMS}; the file is damaged or crafted")
    values = text.count(b",") + text.count(b"[") + text.count(b"{")
    if values > max(_MIN_VALUES, len(text) // _BYTES_PER_VALUE):
        raise MetadataFormatError(f"{source}: the safetensors header holds {values} JSON values in {len(text)} bytes, "
                                  "more than a header of tensors has (one per 7 bytes or more); the file is damaged "
                                  "or crafted")


def parse_index(raw: bytes, *, source: str) -> dict[str, str]:
    """``weight_map`` of a ``model.safetensors.index.json``: tensor name -> file name (an index
    of more than :data:`MAX_INDEX_BYTES`, or nested deeper than JSON of names needs, refused)."""
    if len(raw) > MAX_INDEX_BYTES:
        raise MetadataFormatError(f"{source}: a safetensors index of {len(raw)} bytes, more than {MAX_INDEX_BYTES}")
    try:
        doc = json.loads(raw)
        weight_map = doc["weight_map"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, RecursionError) as e:
        raise MetadataFormatError(f"{source}: not a safetensors index (JSON with a 'weight_map')") from e
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise MetadataFormatError(f"{source}: 'weight_map' must map tensor names to file names")
    return dict(weight_map)


def safetensors_dtype(dtype: torch.dtype, *, what: str) -> str:
    """The safetensors name of a torch dtype; an error naming ``what`` when it has none."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise MetadataFormatError(f"{what}: dtype {dtype} has no safetensors equivalent") from None


def shard_file_name(index: int, count: int) -> str:
    """Hugging Face's shard name: ``model-00001-of-00003.safetensors`` (1-based)."""
    return f"model-{index:05d}-of-{count:05d}{SUFFIX}"


_SHARD_RE = re.compile(r"^(?P<stem>.+)-(?P<k>\d+)-of-(?P<n>\d+)" + re.escape(SUFFIX) + "$")


def check_shard_set(names: Sequence[str], *, where: str) -> None:
    """Refuse safetensors files (``names``, found under ``where`` with no index beside them)
    that are not one whole model.

    Numbered files (``model-00001-of-00003.safetensors``) must all share one stem and one
    count N, with every shard 1..N present: an export or upload that stopped midway leaves
    some, and loading them would silently miss tensors. Unnumbered files (a single
    ``model.safetensors``) are whole on their own but do not mix with numbered ones.
    Raises :class:`IncompleteCheckpointError` naming the missing shards, or
    :class:`MetadataFormatError` for files that are not one set.
    """
    numbered: dict[tuple[str, str], dict[int, str]] = {}
    plain = []
    for name in names:
        m = _SHARD_RE.match(name)
        if m is None:
            plain.append(name)
        else:
            numbered.setdefault((m["stem"], m["n"]), {})[int(m["k"])] = m["k"]
    if not numbered:
        return
    if plain or len(numbered) > 1:
        sets = [f"{stem}-*-of-{n}{SUFFIX}" for stem, n in sorted(numbered)] + sorted(plain)
        raise MetadataFormatError(
            f"{where} holds safetensors files of more than one model ({', '.join(sets[:4])}) and no {INDEX_NAME} "
            "to say which to load; put each model under a prefix of its own")
    ((stem, n_text), ks), = numbered.items()
    count = int(n_text)
    width = len(next(iter(ks.values())))
    outside = sorted(k for k in ks if not 1 <= k <= count)
    if outside:
        raise MetadataFormatError(f"{where}: {stem}-{ks[outside[0]]}-of-{n_text}{SUFFIX} is not shard 1..{count}")
    # Counted, not listed: N comes from a file name anyone can choose (model-00001-of-99999999999),
    # so the work here is bounded by the files present, never by N.
    n_missing = count - len(ks)
    if n_missing:
        first: list[str] = []
        k = 1
        while len(first) < min(5, n_missing):
            if k not in ks:
                first.append(f"{stem}-{k:0{width}d}-of-{n_text}{SUFFIX}")
            k += 1
        shown = ", ".join(first) + (f" and {n_missing - len(first)} more" if n_missing > len(first) else "")
        raise IncompleteCheckpointError(
            f"{where} is incomplete: no {INDEX_NAME} and {n_missing} of {count} shard file(s) missing "
            f"({shown}). The upload or export that wrote it failed or is still running; upload the whole "
            "model again")


def index_document(weight_map: Mapping[str, str], total_size_bytes: int) -> dict[str, Any]:
    """The ``model.safetensors.index.json`` content Hugging Face writes."""
    return {"metadata": {"total_size": total_size_bytes}, "weight_map": dict(sorted(weight_map.items()))}
