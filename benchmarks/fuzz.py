"""Structure-aware fuzzing of s3dcp's metadata decoder: real metadata objects, mutated as a hostile
user would, must decode (and validate, and answer every lookup) or be refused with an S3DCPError.

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
name tables, add odd chunks, and cut or flip bytes, each time with the trailer CRC recomputed so
only s3dcp's own checks stand in the way (and once without, which the CRC must catch). In
version 3 the same edits reach the packed header (inflated, edited, packed again with or without
zlib), as do edits of its planner_data references (keys, template ids, templates, odd values)
and lies in the outer header about the packed header's codec, length and size. In
version 1 they replace any JSON value with an interesting one (huge, negative, another type),
delete keys, and cut or flip bytes.

The oracle (:func:`check`): ``decode_plain`` (the torch-free decode that ``s3dcp inspect`` and
``verify`` use) and ``decode_metadata`` (DCP's classes, built on it) refuse with the same
MetadataFormatError or both return, and then say the same thing (:func:`plain_matches`);
``decode_metadata`` either raises MetadataFormatError or returns;
then ``validate_metadata`` either raises MetadataFormatError or returns; then every key of the
storage data is looked up, every location built, and the object extents computed, none of which
may raise. Anything else (an internal error, a MemoryError, a decode slower than ``--slow-s``) is
a finding, printed with the mutation that caused it. Refusals through decode's last-resort
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
import time
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

SAFETY_NET = "corrupt s3dcp metadata ("  # decode_metadata's last-resort message


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
    what = src.integer(0, 11)
    if what <= 2:
        field = ("count", "offset", "length")[what]
        cols[name][field] = src.interesting(cols[name][field])
        return header, body, f"columns[{name}].{field}={cols[name][field]}"
    if what == 3:
        cols[name]["type"] = src.choice(["u1", "u2", "u4", "u8", "i8", "json", "f8", None])
        cols[name]["codec"] = src.choice(["none", "zlib", "shuffle-zlib", "lz4"])
        return header, body, f"columns[{name}] type/codec={cols[name]['type']}/{cols[name]['codec']}"
    if what == 4:  # new values for the column: any count, any width, compressed or not
        count = src.choice([cols[name]["count"], src.interesting(cols[name]["count"]) % 5000, 0, 1])
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
            fqns[i] = "x" * 10000
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
    header["odd_chunks"][str(src.interesting(0) % 50)] = src.choice([[[[0], [1]]], [], [[[], []]] * 3, "x"])
    return header, body, "odd_chunks added"


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
        pd["odd"].append(src.choice([{"__tuple__": ["a"]}, {"__size__": [1]}, {"x": 1}, None]))
    else:
        pd["extra_keys"].append(src.choice(["", "model.w", "x" * 1000, 7]))
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
    node[key] = src.choice([src.interesting(old if type(old) is int else None), None, "x", [], {}, True, 1.5,
                            [src.interesting()] * 3, "float32", "../../etc/passwd"])
    return f"{path + [key]} = {node[key]!r}"[:200]


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


def check(data: bytes) -> str:
    """Decode (both ways: :func:`plain_matches`), validate and look up everything in ``data``:
    'refused-decode', 'refused-validate', 'safety-net' or 'accepted'; anything else raises
    :class:`Finding`."""
    stage = "decode"
    try:
        try:
            plain, plain_error = decode_plain(data, source="fuzz"), None
        except MetadataFormatError as e:
            plain, plain_error = None, str(e)
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
        stage = "validate"
        validate_metadata(md, source="fuzz")
        stage = "lookups"
        sd = md.storage_data
        if sd is not None:
            for key in list(sd):
                loc = sd[key]
                assert isinstance(loc, ItemLocation)
            list(sd.values())
            if isinstance(sd, LazyStorageData):
                sd.object_extents()
                sd.object_names()
    except MetadataFormatError as e:
        if stage == "lookups":
            raise Finding(f"lookup after a successful decode raised {e!r}") from e
        _last_error[0] = str(e)[:300]
        return "safety-net" if SAFETY_NET in str(e) else f"refused-{stage}"
    except Exception as e:  # noqa: BLE001 - what the fuzzer exists to find
        raise Finding(f"{stage}: {type(e).__name__}: {e}"[:500]) from e
    return "accepted"


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=1.0, help="how long to run (default 1)")
    parser.add_argument("--examples", type=int, default=0, help="stop after this many examples instead")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--slow-s", type=float, default=2.0, help="a decode slower than this is a finding")
    parser.add_argument("--json", default="results/fuzz.json", help="where to write the counts")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    src = RandomSource(rng)
    objects = seeds()
    counts: Counter = Counter()
    findings: list[dict] = []
    nets: list[dict] = []
    slowest = (0.0, "")
    end = time.monotonic() + args.minutes * 60
    n = 0
    while (n < args.examples) if args.examples else (time.monotonic() < end):
        name, data, _ = objects[rng.randrange(len(objects))]
        mutated, what = mutate(src, data)
        for _ in range(rng.randint(0, 2)):  # stack a few edits
            mutated, more = mutate(src, mutated) if mutated[:1] in (b"\x89", b"{") else (mutated, "")
            what += "; " + more
        t0 = time.perf_counter()
        try:
            outcome = check(mutated)
        except Finding as e:
            outcome = "FINDING"
            findings.append({"seed": name, "mutation": what, "error": str(e)})
            print(f"FINDING [{name}] {what}\n    {e}", flush=True)
        seconds = time.perf_counter() - t0
        if outcome == "safety-net" and len(nets) < 50:
            nets.append({"seed": name, "mutation": what, "error": _last_error[0]})
            print(f"SAFETY NET [{name}] {what}\n    {_last_error[0]}", flush=True)
        if seconds > slowest[0]:
            slowest = (seconds, f"[{name}] {what}")
        if seconds > args.slow_s:
            findings.append({"seed": name, "mutation": what, "error": f"slow: {seconds:.2f} s"})
            print(f"SLOW [{name}] {what}: {seconds:.2f} s", flush=True)
        counts[outcome] += 1
        counts[f"{name}:{outcome}"] += 1
        n += 1
    print(f"{n} examples over {len(objects)} seeds: " + ", ".join(
        f"{k} {v}" for k, v in sorted(counts.items()) if ":" not in k))
    print(f"slowest check: {slowest[0]:.3f} s  {slowest[1][:160]}")
    print(f"findings: {len(findings)}")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"examples": n, "counts": dict(counts), "slowest_s": slowest[0], "findings": findings,
                   "safety_net": nets}, f, indent=1)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
