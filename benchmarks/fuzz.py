"""Structure-aware fuzzing of every consumer of stored bytes: real metadata objects (and safetensors
files), mutated as a hostile user would, must decode (and validate, and answer every lookup, and
plan a load, a cooperative load and an export, and pass verify's and rm's checks) or be refused
with an S3DCPError, each within ``--slow-s`` and ``--memory-mib``.

    python benchmarks/fuzz.py --minutes 10            # long run; prints counts, writes JSON
    python benchmarks/fuzz.py --examples 2000 --seed 7

Seeds are real objects: DCP's own save planner on small state dicts, the items placed as the
writer places them, encoded in format versions 1, 2 and 3, in four shapes: one rank (tensors of
several dtypes, a 0-d tensor, bytes items), several ranks of FSDP2 DTensor shards (the
``metadata_scale`` benchmark's checkpoint, scaled down), an incremental checkpoint whose items
partly point into its base (``../step-1/...``), and one rank of many uniquely named tensors.

Mutations (:func:`mutate`) know the format: in version 2 they change a column's declared count,
offset, length, type or codec, replace a column's values (any width, compressed or not), change
the row and entry counts, rename, drop or duplicate fqns, change properties, dtype and object
name tables, add odd chunks (up to 300,000 boxes), make a name long (up to 3 million characters)
or the header big (a value of up to 3 MB), and cut or flip bytes, each time with the trailer CRC recomputed so
only s3dcp's own checks stand in the way (and once without, which the CRC must catch). In
version 3 the same edits reach the packed header (inflated, edited, packed again with or without
zlib), as do edits of its planner_data references (keys, template ids, templates, odd values)
and lies in the outer header about the packed header's codec, length and size. In
version 1 they replace any JSON value with an interesting one (huge, negative, another type, a
string of millions of characters, a list of a million values), delete keys, and cut or flip
bytes. Values a mutation generates are at most ``MAX_GENERATED`` (a declared count may say 2^40:
the decoder must refuse it before allocating; the fuzzer never allocates it). safetensors files
(the package's own output) get their header's values edited, a long name, a shape of millions
of dimensions, a dtype of another JSON type, a lying length field, cuts and flips.

The oracle (:func:`check`): ``decode_plain`` (the torch-free decode that ``s3dcp inspect`` and
``verify`` use) and ``decode_metadata`` (DCP's classes, built on it) refuse with the same
MetadataFormatError or both return, and then say the same thing (:func:`plain_matches`);
``decode_metadata`` either raises MetadataFormatError or returns;
then ``validate_metadata`` either raises MetadataFormatError or returns; then every key of the
storage data is looked up, every location built, and the object extents computed, none of which
may raise; then the other consumers run (:mod:`fuzz_consumers`: verify's and rm's checks on any
decoded object, the reader's, cooperative reads' and export's planning on a validated one), and
safetensors files are parsed and turned into a load's metadata. Anything else (an internal error,
a MemoryError, an example slower than ``--slow-s`` or whose allocations, seen by tracemalloc, or
peak RSS grow more than ``--memory-mib``) is a finding, printed with the mutation that caused it. Refusals through decode's last-resort
safety net ("corrupt s3dcp metadata (KeyError: ...)") are counted apart: they are S3DCPErrors,
but a check that names the field would be better.

The same mutations run in CI as a hypothesis test with a bounded number of examples
(``tests/format/test_fuzz.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import struct
import sys
import threading
import time
import tracemalloc
import zlib
from collections import Counter
from typing import Any, Callable

import numpy as np
import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import WriteItemType

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from s3dcp.errors import MetadataFormatError  # noqa: E402
from s3dcp.format.layout import ItemLocation  # noqa: E402
from s3dcp.format.metadata import (  # noqa: E402
    decode_metadata,
    decode_plain,
    dtype_to_str,
    encode_metadata,
    validate_metadata,
)
from s3dcp.format.metadata.columns import TYPES  # noqa: E402
from s3dcp.format.metadata.storage import LazyStorageData  # noqa: E402

import fuzz_consumers  # noqa: E402  (benchmarks/fuzz_consumers.py)

SAFETY_NET = "corrupt s3dcp metadata ("  # decode_metadata's last-resort message
MAX_GENERATED = 1 << 20  # values one mutation generates at most (a declared count may say anything)
LONG = (10_000, 300_000, 3_000_000)  # characters of a long name, a long string (Source.size)


# ---------------------------------------------------------------------------------------------
# Seeds: real metadata objects


def _planned(state_dict: dict, *, objects: Callable[[int], str] = lambda i: "__0_0.seed.distcp") -> Metadata:
    """What dcp.save with the S3 writer records for ``state_dict`` on one rank."""
    planner = DefaultSavePlanner()
    planner.set_up_planner(state_dict, storage_meta=None, is_coordinator=True)
    plans, md = planner.create_global_plan([planner.create_local_plan()])
    storage, offset = {}, 0
    for i, item in enumerate(plans[0].items):
        if item.type == WriteItemType.BYTE_IO:
            loc = ItemLocation(objects(i), offset, 16, f"crc32c:{i:08x}")
        else:
            chunk = item.tensor_data.chunk
            dtype = item.tensor_data.properties.dtype
            length = dtype.itemsize * int(np.prod(chunk.sizes, dtype=np.int64))
            loc = ItemLocation(objects(i), offset, length, f"crc32c:{i:08x}", dtype_to_str(dtype), tuple(chunk.sizes))
        storage[MetadataIndex(item.index.fqn, item.index.offset, item.index.index)] = loc
        offset += loc.length
    return dataclasses.replace(md, storage_data=storage)


def _one_rank() -> Metadata:
    return _planned({
        "model": {"embed": torch.zeros(16, 8, dtype=torch.bfloat16), "w": torch.zeros(8, 8),
                  "b": torch.zeros(8, dtype=torch.float16), "mask": torch.ones(4, dtype=torch.bool),
                  "scale": torch.zeros((), dtype=torch.float64)},
        "optim": {"state": {0: {"step": torch.tensor(7), "exp_avg": torch.zeros(8, 8)}},
                  "param_groups": [{"lr": 0.1, "params": [0]}]},
        "epoch": 3,
    })


def _incremental() -> Metadata:
    return _planned({"layers": [{"w": torch.zeros(4, 4), "b": torch.zeros(4)} for _ in range(4)], "step": 9},
                    objects=lambda i: "../step-1/__0_0.base.distcp" if i % 2 else "__0_0.new.distcp")


def _wide() -> Metadata:
    return _planned({f"blocks.{i}.{name}": torch.zeros(i % 5 + 1, 3) for i in range(60) for name in ("w", "b")})


def _multi_rank() -> Metadata:
    import metadata_scale  # benchmarks/metadata_scale.py: the FSDP2 DTensor checkpoint

    return metadata_scale.build_metadata(4, 12)


SHAPES: dict[str, Callable[[], Metadata]] = {
    "one-rank": _one_rank, "dtensor-4-ranks": _multi_rank, "incremental": _incremental, "wide": _wide,
}


def seeds() -> list[tuple[str, bytes, Metadata]]:
    """(name, encoded object, the Metadata it holds) for every shape in versions 3, 2 and 1."""
    out = []
    for name, build in SHAPES.items():
        md = build()
        validate_metadata(md)  # a seed is a checkpoint a load trusts
        out.append((f"{name}/v3", encode_metadata(md, version=3), md))
        out.append((f"{name}/v2", encode_metadata(md, version=2), md))
        out.append((f"{name}/v1", encode_metadata(md, version=1), md))
    return out


# ---------------------------------------------------------------------------------------------
# Mutations, driven by a Source (random.Random here, hypothesis's data.draw in the test)


class Source:
    """The choices a mutation makes; :class:`RandomSource` and the test's hypothesis source implement it."""

    def integer(self, lo: int, hi: int) -> int:
        raise NotImplementedError

    def choice(self, options: list) -> Any:
        return options[self.integer(0, len(options) - 1)]

    def size(self, sizes) -> int:
        """The first of ``sizes`` mostly, a larger one about once in 30 draws: big values (a name
        of millions of characters, a header of megabytes) are slow to build and to refuse."""
        return sizes[0] if self.integer(0, 29) else self.choice(list(sizes[1:]))

    def interesting(self, original: int | None = None) -> int:
        """An integer a hostile edit would try: edges of every width, huge, negative, or near ``original``."""
        k = self.choice([0, 1, 7, 8, 15, 16, 31, 32, 40, 62, 63, 64])
        edges = [0, 1, -1, 2**k - 1, 2**k, 2**k + 1, -(2**k), 10**6, 3 * 10**6, 10**8, 2**32 - 1]
        if original is not None:
            edges += [original + self.integer(-3, 3), original * 2, original * 1000, original // 2]
        return self.choice(edges) if self.integer(0, 3) else self.integer(-(2**16), 2**16)


class RandomSource(Source):
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def integer(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)


_HEAD = struct.Struct("<8sQ")


def _parts(data: bytes) -> tuple[dict, bytes]:
    (head_len,) = struct.unpack_from("<Q", data, 8)
    return json.loads(data[16:16 + head_len]), data[16 + head_len:-4]


def _pack(header: dict, body: bytes, magic: bytes) -> bytes:
    head = json.dumps(header).encode()
    out = _HEAD.pack(magic, len(head)) + head + body
    return out + struct.pack("<I", zlib.crc32(out))


def _with_crc(data: bytes) -> bytes:
    return data[:-4] + struct.pack("<I", zlib.crc32(data[:-4]))


def _column_bytes(values: np.ndarray, kind: str, codec: str) -> bytes:
    raw = values.astype(TYPES[kind]).tobytes()
    if codec == "zlib":
        return zlib.compress(raw)
    if codec == "shuffle-zlib":
        width = TYPES[kind].itemsize
        return zlib.compress(np.frombuffer(raw, np.uint8).reshape(-1, width).T.tobytes())
    return raw


def _v2_header_edit(src: Source, header: dict, body: bytes) -> tuple[dict, bytes, str]:
    cols = header["columns"]
    name = src.choice(sorted(cols))
    what = src.integer(0, 12)
    if what <= 2:
        field = ("count", "offset", "length")[what]
        cols[name][field] = src.interesting(cols[name][field])
        return header, body, f"columns[{name}].{field}={cols[name][field]}"
    if what == 3:
        cols[name]["type"] = src.choice(["u1", "u2", "u4", "u8", "i8", "json", "f8", None])
        cols[name]["codec"] = src.choice(["none", "zlib", "shuffle-zlib", "lz4"])
        return header, body, f"columns[{name}] type/codec={cols[name]['type']}/{cols[name]['codec']}"
    if what == 4:  # new values for the column: any count, any width, compressed or not
        # generated values are bounded (an earlier edit may have set the count to 2^40: the decoder
        # must refuse that, the fuzzer must not allocate it); the declared count may lie below
        declared = cols[name]["count"] if type(cols[name]["count"]) is int else 0
        count = src.choice([min(max(declared, 0), MAX_GENERATED), src.interesting(declared) % 5000, 0, 1])
        kind = src.choice(["u1", "u2", "u4", "u8"])
        top = src.choice([1, 2, 3, 8, 255, 2**16, 2**32 - 1, 2**63])
        seed = src.integer(0, 2**31)
        values = np.random.default_rng(seed).integers(0, min(top, np.iinfo(TYPES[kind]).max), count, dtype=np.uint64,
                                                      endpoint=True)
        codec = src.choice(["none", "zlib", "shuffle-zlib"])
        raw = _column_bytes(values, kind, codec)
        if src.integer(0, 3) == 0:
            count = src.interesting(count)  # and lie about how many
        cols[name] = {"type": kind, "count": count, "offset": len(body), "length": len(raw), "codec": codec}
        return header, body + raw, f"columns[{name}] = {count} x {kind} ({codec}, values < {top}, seed {seed})"
    if what == 5:
        del cols[name]
        return header, body, f"columns[{name}] removed"
    if what == 6 and header.get("storage_data"):
        header["storage_data"]["rows"] = src.interesting(header["storage_data"]["rows"])
        return header, body, f"storage_data.rows={header['storage_data']['rows']}"
    if what == 7:
        header["state_dict_entries"] = src.interesting(header["state_dict_entries"])
        return header, body, f"state_dict_entries={header['state_dict_entries']}"
    if what == 8 and header["fqns"]:
        fqns, i = header["fqns"], src.integer(0, len(header["fqns"]) - 1)
        op = src.choice(["dup", "empty", "drop", "append", "long"])
        if op == "dup":
            fqns[i] = fqns[src.integer(0, len(fqns) - 1)]
        elif op == "empty":
            fqns[i] = ""
        elif op == "drop":
            del fqns[i]
        elif op == "append":
            fqns.append(f"extra.{i}")
        else:
            fqns[i] = "x" * src.size(LONG)
        return header, body, f"fqns {op} at {i}"
    if what == 9 and header["properties"]:
        p = header["properties"][src.integer(0, len(header["properties"]) - 1)]
        j = src.integer(0, 4)
        p[j] = src.choice(["float32", "int8", "complex128", "bool", "nope", None, 0, True, "strided", "sparse_coo"])
        return header, body, f"properties field {j} = {p[j]!r}"
    if what == 10 and header.get("storage_data"):
        sd = header["storage_data"]
        table = src.choice(["object_names", "dtypes"])
        op = src.choice(["pop", "append", "bad"])
        if op == "pop" and sd[table]:
            sd[table].pop()
        elif op == "append":
            sd[table].append(src.choice(["float32", "../x", "", "uint64"]))
        elif sd[table]:
            sd[table][0] = src.choice([None, 1, "nope", ["a"]])
        return header, body, f"storage_data.{table} {op}"
    if what == 12:  # a big header: what it holds is parsed before anything is checked
        size = src.size((10_000, 300_000, 3_000_000))
        field, shape = src.choice(["planner_data", "padding", "storage_meta"]), src.integer(0, 3)
        header[field] = ("x" * size if shape == 0 else [0] * (size // 2) if shape == 1 else [[]] * (size // 3)
                         if shape == 2 else {"__dict__": [[f"k{i}", [i]] for i in range(size // 12)]})
        return header, body, f"big header value of ~{size} bytes"
    shape = src.integer(0, 4)
    boxes = ([[[0], [1]]] if shape == 0 else [] if shape == 1 else [[[], []]] * src.size((3, 10_000, 300_000))
             if shape == 2 else "x" if shape == 3 else [[[i], [1]] for i in range(src.size((2, 5000, 100_000)))])
    header["odd_chunks"][str(src.interesting(0) % 50)] = boxes
    return header, body, f"odd_chunks added ({len(boxes)} boxes)"


def _planner_edit(src: Source, pd: Any) -> str:
    """One edit of version 3's planner_data references (planner.py's form)."""
    if type(pd) is not dict or "tree" in pd or type(pd.get("entries")) is not int:
        return _json_edit(src, pd) if type(pd) in (dict, list) else "nothing to edit"
    n, what = pd["entries"], src.integer(0, 5)
    if what == 0:
        pd["entries"] = src.interesting(n)
    elif what == 1:
        pd["keys"] = [src.choice([0, 0, 1, -1, -2, src.interesting()]) for _ in range(max(n, 0) % 5000)]
    elif what == 2:
        pd["ids"] = [src.choice([0, 1, 1, 2, 3, src.interesting()]) for _ in range(max(n, 0) % 5000)]
    elif what == 3:
        pd["templates"].append(src.choice([[["s", 0], ["s", 0]], [["i", 1]], [["s", 0], ["i", 1]], [["s", 2]], [],
                                           [["i", 0]], [["s", -1]], "x"]))
    elif what == 4:
        pd["odd"].append(src.choice([{"__tuple__": ["a"]}, {"__size__": [1]}, {"x": 1}, None, [0] * 3])
                         if src.integer(0, 29) else [0] * 100_000)
    else:
        pd["extra_keys"].append(src.choice(["", "model.w", "long", 7]))
        if pd["extra_keys"][-1] == "long":
            pd["extra_keys"][-1] = "x" * src.size(LONG)
    return f"planner_data edit {what}"


def _v3_edit(src: Source, outer: dict, rest: bytes, magic: bytes) -> tuple[bytes, str]:
    """Version 3: inflate the packed header, edit it (columns, planner_data, any field), pack it
    again (zlib or plain), maybe lie in the outer header, and recompute the CRC."""
    n = outer["header"]["length"]
    packed, body = rest[:n], rest[n:]
    inner = json.loads(zlib.decompress(packed) if outer["header"]["codec"] == "zlib" else packed)
    whats = []
    for _ in range(src.integer(1, 3)):
        what = src.integer(0, 3)
        if what <= 1 and type(inner.get("columns")) is dict and inner["columns"]:
            inner, body, done = _v2_header_edit(src, inner, body)
        elif what == 2:
            done = _planner_edit(src, inner.get("planner_data"))
        else:
            done = _json_edit(src, inner)
        whats.append(done)
    raw = json.dumps(inner).encode()
    codec = src.choice(["zlib", "none"])
    packed = zlib.compress(raw) if codec == "zlib" else raw
    outer["header"] = {"codec": codec, "length": len(packed), "size": len(raw)}
    if src.integer(0, 3) == 0:
        whats.append("outer " + _json_edit(src, outer))
    return _pack(outer, packed + body, magic), "; ".join(whats)


def _json_edit(src: Source, doc: Any) -> str:
    """Replace one value somewhere in ``doc`` (in place); say where."""
    path = []
    node = doc
    for _ in range(src.integer(1, 8)):
        if type(node) is dict and node:
            key = src.choice(sorted(node, key=str))
        elif type(node) is list and node:
            key = src.integer(0, len(node) - 1)
        else:
            break
        if type(node[key]) not in (dict, list) or src.integer(0, 4) == 0:
            break
        path.append(key)
        node = node[key]
    if type(node) is dict and node:
        key = src.choice(sorted(node, key=str))
    elif type(node) is list and node:
        key = src.integer(0, len(node) - 1)
    else:
        return "nothing to edit"
    if type(node) is dict and src.integer(0, 5) == 0:
        del node[key]
        return f"{path + [key]} deleted"
    old = node[key]
    pick = src.integer(0, 12)
    if pick < 10:
        node[key] = [src.interesting(old if type(old) is int else None), None, "x", [], {}, True, 1.5,
                     [src.interesting()] * 3, "float32", "../../etc/passwd"][pick]
    else:  # long or big: built only when drawn
        node[key] = "y" * src.size(LONG) if pick == 10 else [[]] * src.size((10, 100_000)) if pick == 11 \
            else [0] * src.size((10, 1_000_000))
    return f"{path + [key]} = {node[key]!r:.200}"


def mutate(src: Source, data: bytes) -> tuple[bytes, str]:
    """One hostile edit of the encoded object ``data``; the result and a line saying what was done."""
    if len(data) < 2:
        return data, "nothing left to mutate"
    kind = src.integer(0, 9)
    if kind == 0:  # truncation (CRC recomputed over what is left, where there is one)
        cut = src.integer(0, len(data) - 1)
        out = data[:cut]
        if data[:1] == b"\x89" and cut > 4:
            out = out + struct.pack("<I", zlib.crc32(out))
        return out, f"truncated to {cut} bytes"
    if kind in (1, 2):  # bit flips, CRC recomputed (v2) so only s3dcp's checks can catch them
        out = bytearray(data)
        for _ in range(src.integer(1, 4)):
            out[src.integer(0, len(out) - 1)] ^= 1 << src.integer(0, 7)
        out = bytes(out)
        if data[:1] == b"\x89" and kind == 1:
            out = _with_crc(out)
        return out, "bit flips" + (" (CRC recomputed)" if kind == 1 and data[:1] == b"\x89" else "")
    try:
        if data[:1] == b"\x89":
            header, body = _parts(data)
            if header.get("version") == 3 and type(header.get("header")) is dict:
                return _v3_edit(src, header, body, data[:8])
            whats = []
            for _ in range(src.integer(1, 3)):
                if src.integer(0, 2) and type(header.get("columns")) is dict and header["columns"]:
                    header, body, what = _v2_header_edit(src, header, body)
                else:
                    what = _json_edit(src, header)
                whats.append(what)
            return _pack(header, body, data[:8]), "; ".join(whats)
        doc = json.loads(data)
        return json.dumps(doc).encode(), "; ".join(_json_edit(src, doc) for _ in range(src.integer(1, 3)))
    except (ValueError, struct.error, KeyError, TypeError, AttributeError, IndexError, RecursionError, zlib.error):
        return mutate(src, data)  # not parseable any more: cut or flip it


# ---------------------------------------------------------------------------------------------
# The oracle


_last_error = [""]  # the message of the last refusal, for the report


class Finding(AssertionError):
    """A decode or lookup that ended in anything but a result or an S3DCPError."""


def plain_matches(plain: Any, md: Metadata) -> None:
    """Raise :class:`Finding` where the plain decode and DCP's Metadata of one object differ."""
    def differ(what: str, a: Any, b: Any) -> None:
        if a != b:
            raise Finding(f"plain and DCP decodes differ in {what}: {a!r:.200} != {b!r:.200}")

    differ("dcp_version", plain.dcp_version, md.version)
    differ("fqns", list(plain.state_dict), list(md.state_dict_metadata))
    for fqn, item in md.state_dict_metadata.items():
        p = plain.state_dict[fqn]
        if not hasattr(item, "chunks"):
            differ(f"{fqn!r} kind", type(p).__name__, "PlainBytes")
            continue
        props = item.properties
        differ(f"{fqn!r} properties", tuple(p.properties), (
            dtype_to_str(props.dtype), str(props.layout).removeprefix("torch."), props.requires_grad,
            str(props.memory_format).removeprefix("torch."), props.pin_memory))
        differ(f"{fqn!r} size", p.size, tuple(item.size))
        differ(f"{fqn!r} chunks", (p.chunks.offsets, p.chunks.sizes),
               ([tuple(c.offsets) for c in item.chunks], [tuple(c.sizes) for c in item.chunks]))
    sd = md.storage_data
    differ("storage_data is None", plain.storage is None, sd is None)
    if sd is not None:
        differ("storage keys", [tuple(k) for k in plain.storage.keys()],
               [(k.fqn, None if k.offset is None else tuple(k.offset), k.index) for k in sd])
        differ("storage locations", plain.storage.locations(), list(sd.values()))
    sm = md.storage_meta
    differ("storage_meta", None if plain.storage_meta is None else tuple(plain.storage_meta),
           None if sm is None else (sm.checkpoint_id, sm.save_id, sm.load_id, sm.modules))


def check(data: bytes, reached: set | None = None) -> str:
    """Decode (both ways: :func:`plain_matches`), validate and look up everything in ``data``,
    and hand what decodes to every other consumer of stored bytes (:mod:`fuzz_consumers`):
    'refused-decode', 'refused-validate', 'safety-net' or 'accepted'; anything else raises
    :class:`Finding`. ``reached`` collects the names of the consumers that ran."""
    reached = set() if reached is None else reached
    stage = "decode"
    try:
        reached.add("decode")
        try:
            plain, plain_error = decode_plain(data, source="fuzz"), None
        except MetadataFormatError as e:
            plain, plain_error = None, str(e)
        if plain is None:  # rm and gc still read the names of an object the decoder refuses
            stage = "references"
            fuzz_consumers.after_decode(data, None, reached)
            stage = "decode"
        try:
            md = decode_metadata(data, source="fuzz")
        except MetadataFormatError as e:
            if str(e) != plain_error:
                raise Finding(f"the DCP decode refused ({e}), the plain one "
                              f"{'accepted' if plain_error is None else 'refused otherwise: ' + plain_error}") from e
            raise
        if plain_error is not None:
            raise Finding(f"the plain decode refused ({plain_error}), the DCP one accepted")
        plain_matches(plain, md)
        stage = "verify, references"
        fuzz_consumers.after_decode(data, plain, reached)
        stage = "validate"
        reached.add("validate")
        validate_metadata(md, source="fuzz")
        stage = "lookups"
        reached.add("lookups")
        sd = md.storage_data
        if sd is not None:
            for key in list(sd):
                loc = sd[key]
                assert isinstance(loc, ItemLocation)
            list(sd.values())
            if isinstance(sd, LazyStorageData):
                sd.object_extents()
                sd.object_names()
        stage = "reader, cooperative, export"
        fuzz_consumers.after_validate(md, fuzz_consumers.seed_of(data), reached)
    except MetadataFormatError as e:
        if stage not in ("decode", "validate"):
            raise Finding(f"{stage} after a successful decode raised {e!r}") from e
        _last_error[0] = str(e)[:300]
        return "safety-net" if SAFETY_NET in str(e) else f"refused-{stage}"
    except Exception as e:  # noqa: BLE001 - what the fuzzer exists to find
        raise Finding(f"{stage}: {type(e).__name__}: {e}"[:500]) from e
    return "accepted"


def check_safetensors(data: bytes, reached: set | None = None) -> str:
    """A safetensors file's header parsed and turned into a load's metadata: 'accepted' or
    'refused'; anything else raises :class:`Finding`."""
    try:
        return fuzz_consumers.check_safetensors(data, set() if reached is None else reached)
    except Exception as e:  # noqa: BLE001 - what the fuzzer exists to find
        raise Finding(f"safetensors: {type(e).__name__}: {e}"[:500]) from e


# ---------------------------------------------------------------------------------------------


class RssPeak:
    """This process's RSS sampled every ``interval_s`` on a thread of its own: the highest value
    since :meth:`reset`. (A spike shorter than the interval can be missed.)"""

    def __init__(self, interval_s: float = 0.002) -> None:
        self.interval_s, self.page = interval_s, os.sysconf("SC_PAGE_SIZE")
        self.peak = self.now()
        self._stop = threading.Event()
        threading.Thread(target=self._run, name="fuzz-rss", daemon=True).start()

    def now(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, self.now())

    def reset(self) -> int:
        self.peak = self.now()
        return self.peak

    def close(self) -> None:
        self._stop.set()


class Meter:
    """What one example cost: seconds, and the most memory it added: its RSS peak over the RSS
    it started with (every allocation, torch's too), or, with ``traced``, the peak of Python's and
    numpy's allocations (tracemalloc: exact, and several times slower), whichever is larger."""

    def __init__(self, rss: RssPeak, traced: bool) -> None:
        self.rss, self.traced = rss, traced

    def __enter__(self) -> "Meter":
        if self.traced:
            tracemalloc.reset_peak()
            self.base = tracemalloc.get_traced_memory()[0]
        self.rss0 = self.rss.reset()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self.t0
        self.memory = max(self.rss.peak, self.rss.now()) - self.rss0
        if self.traced:
            self.memory = max(self.memory, tracemalloc.get_traced_memory()[1] - self.base)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=1.0, help="how long to run (default 1)")
    parser.add_argument("--examples", type=int, default=0, help="stop after this many examples instead")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--slow-s", type=float, default=2.0, help="an example slower than this is a finding")
    parser.add_argument("--memory-mib", type=float, default=256.0,
                        help="an example whose peak RSS (or, with --tracemalloc, allocations) grows more than this "
                             "is a finding")
    parser.add_argument("--tracemalloc", action="store_true", help="also trace Python's allocations (slower)")
    parser.add_argument("--json", default="results/fuzz.json", help="where to write the counts")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    src = RandomSource(rng)
    objects = [(name, data, "metadata") for name, data, _ in seeds()]
    objects += [(name, data, "safetensors") for name, data in fuzz_consumers.safetensors_seeds()]
    counts: Counter = Counter()
    reached: Counter = Counter()
    findings: list[dict] = []
    nets: list[dict] = []
    slowest, biggest = (0.0, ""), (0, "")
    limit = args.memory_mib * 2**20
    for name, data, kind in objects:  # once unmutated: what a first use costs (imports, caches) is not an example's
        (check if kind == "metadata" else check_safetensors)(data)
    rss = RssPeak()
    if args.tracemalloc:
        tracemalloc.start()
    end = time.monotonic() + args.minutes * 60
    n = 0
    while (n < args.examples) if args.examples else (time.monotonic() < end):
        name, data, kind = objects[rng.randrange(len(objects))]
        edit = mutate if kind == "metadata" else lambda s, d: fuzz_consumers.mutate_safetensors(s, d, _json_edit)
        mutated, what = edit(src, data)
        for _ in range(rng.randint(0, 2)):  # stack a few edits
            mutated, more = edit(src, mutated) if kind == "safetensors" or mutated[:1] in (b"\x89", b"{") \
                else (mutated, "")
            what += "; " + more
        here: set = set()
        with Meter(rss, args.tracemalloc) as cost:
            try:
                outcome = (check if kind == "metadata" else check_safetensors)(mutated, here)
            except Finding as e:
                outcome = "FINDING"
                findings.append({"seed": name, "mutation": what[:500], "error": str(e)})
                print(f"FINDING [{name}] {what[:300]}\n    {e}", flush=True)
        reached.update(here)
        if outcome == "safety-net" and len(nets) < 50:
            nets.append({"seed": name, "mutation": what[:500], "error": _last_error[0]})
            print(f"SAFETY NET [{name}] {what[:300]}\n    {_last_error[0]}", flush=True)
        memory = cost.memory
        if cost.seconds > slowest[0]:
            slowest = (cost.seconds, f"[{name}] {what}"[:300])
        if memory > biggest[0]:
            biggest = (memory, f"[{name}] {what}"[:300])
        if cost.seconds > args.slow_s:
            findings.append({"seed": name, "mutation": what[:500], "error": f"slow: {cost.seconds:.2f} s"})
            print(f"SLOW [{name}] {what[:300]}: {cost.seconds:.2f} s", flush=True)
        if memory > limit:
            findings.append({"seed": name, "mutation": what[:500], "error": f"memory: +{memory / 2**20:.0f} MiB"})
            print(f"MEMORY [{name}] {what[:300]}: +{memory / 2**20:.0f} MiB", flush=True)
        counts[outcome] += 1
        counts[f"{name}:{outcome}"] += 1
        n += 1
    rss.close()
    if args.tracemalloc:
        tracemalloc.stop()
    print(f"{n} examples over {len(objects)} seeds: " + ", ".join(
        f"{k} {v}" for k, v in sorted(counts.items()) if ":" not in k))
    print("consumers reached (examples): " + ", ".join(f"{c} {reached[c]}" for c in fuzz_consumers.CONSUMERS))
    print(f"slowest example: {slowest[0]:.3f} s  {slowest[1][:160]}")
    print(f"most memory: +{biggest[0] / 2**20:.1f} MiB  {biggest[1][:160]}")
    print(f"findings: {len(findings)}")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"examples": n, "counts": dict(counts), "reached": dict(reached), "slowest_s": slowest[0],
                   "slowest": slowest[1], "most_memory_bytes": biggest[0], "most_memory": biggest[1],
                   "findings": findings, "safety_net": nets}, f, indent=1)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
