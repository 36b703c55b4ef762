"""Metadata format version 3: exact round trips (odd planner_data included), when the writer picks
it, hostile objects refused by name, old readers refusing it by name, and a DCP save and load of
20,000 uniquely named tensors through S3 that writes it."""

from __future__ import annotations

import json
import os
import math
import struct
import zlib

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

import s3dcp.format.metadata.common as s3common
import s3dcp.format.metadata.plain_v2 as plain_v2
import s3dcp.format.metadata.v2 as s3v2
import s3dcp.format.metadata.v3 as s3v3
from s3dcp import S3StorageReader, S3StorageWriter
from s3dcp.errors import MetadataFormatError
from s3dcp.format.layout import METADATA_NAME, ItemLocation
from s3dcp.format.metadata import FORMAT_VERSION, decode_metadata, encode_metadata, format_version_of
from s3dcp.format.metadata.packing import header_limit_bytes
from tests.format.test_metadata import assert_same, roundtrip
from tests.rss import peak_rss_sampler

SOURCE = "s3://b/ck/.metadata"


def checkpoint(fqns: list[str], planner_data=None, *, storage: bool = True) -> Metadata:
    """One rank's Metadata: a small tensor per fqn (bytes items for names ending in '.bytes')."""
    sdm, sd, offset = {}, {}, 0
    for i, fqn in enumerate(fqns):
        if fqn.endswith(".bytes"):
            sdm[fqn] = BytesStorageMetadata()
            sd[MetadataIndex(fqn)] = ItemLocation("__0_0.t.distcp", offset, 9, f"crc32c:{i:08x}")
            offset += 9
            continue
        shape = torch.Size([i % 7 + 1, 4])
        sdm[fqn] = TensorStorageMetadata(TensorProperties(torch.float32), shape,
                                         [ChunkStorageMetadata(torch.Size([0, 0]), shape)])
        n = 4 * shape.numel()
        sd[MetadataIndex(fqn, torch.Size([0, 0]), 0)] = ItemLocation("__0_0.t.distcp", offset, n, f"crc32c:{i:08x}",
                                                                     "float32", tuple(shape))
        offset += n
    return Metadata(sdm, planner_data=planner_data, storage_data=sd if storage else None)


def moe_fqns(n: int) -> list[str]:
    """``n`` uniquely named tensors of an MoE with unstacked experts, and their Adam states."""
    out, layer = [], 0
    while len(out) < n:
        for e in range(64):
            for w in ("w1", "w2", "w3"):
                p = f"model.layers.{layer}.mlp.experts.{e}.{w}.weight"
                out += [p, f"optim.state.{p}.exp_avg", f"optim.state.{p}.exp_avg_sq"]
        layer += 1
    return out[:n]


def dcp_paths(fqns: list[str]) -> dict:
    """planner_data as DCP writes it for {"model": model.state_dict(), "optim": ...}."""
    out = {}
    for f in fqns:
        if f.startswith("optim.state."):
            param, _, state = f.removeprefix("optim.state.").rpartition(".")
            out[f] = ("optim", "state", param, state)
        else:
            out[f] = tuple(f.split(".", 1))
    return out


def v3_parts(data: bytes) -> tuple[dict, dict, bytes]:
    """(outer header, packed header, body) of a version-3 object."""
    (n,) = struct.unpack_from("<Q", data, 8)
    outer = json.loads(data[16:16 + n])
    rest = data[16 + n:-4]
    entry = outer["header"]
    packed = rest[:entry["length"]]
    inner = json.loads(zlib.decompress(packed) if entry["codec"] == "zlib" else packed)
    return outer, inner, rest[entry["length"]:]


def v3_pack(outer: dict, inner: dict | bytes, body: bytes, *, codec: str = "zlib", **lies) -> bytes:
    """A version-3 object with a valid CRC; ``lies`` overrides fields of the packed header's entry."""
    raw = inner if type(inner) is bytes else json.dumps(inner).encode()
    packed = zlib.compress(raw) if codec == "zlib" else raw
    outer = dict(outer, header={"codec": codec, "length": len(packed), "size": len(raw), **lies})
    head = json.dumps(outer).encode()
    out = s3v3.MAGIC + struct.pack("<Q", len(head)) + head + packed + body
    return out + struct.pack("<I", zlib.crc32(out))


def refuse(data: bytes, *words: str) -> str:
    with pytest.raises(MetadataFormatError) as info:
        decode_metadata(data, source=SOURCE)
    msg = str(info.value)
    assert msg.startswith(SOURCE + ": ")
    for w in words:
        assert w in msg, (w, msg)
    assert "corrupt s3dcp metadata (" not in msg, f"refused only by the safety net: {msg}"
    return msg


# ---------------------------------------------------------------------------------------------
# Round trips


FQNS = ["model.layers.0.w", "model.layers.0.b", "optim.state.model.layers.0.w.exp_avg",
        "optim.param_groups.0.lr.bytes", "a..b", ".lead", "tail.", "módel.wé", "x"]

ODD_PLANNER_DATA = {
    "none": None,
    "empty": {},
    "a list": [1, ("a", "b"), {"k": None}],
    "non-str keys": {("model", 0): ("model", 0), "x": ("x",)},
    "split": {f: tuple(f.split(".")) for f in FQNS},
    "dcp nested and flat": dcp_paths(FQNS),
    "list indices are ints": {"optim.param_groups.0.lr.bytes": ("optim", "param_groups", 0, "lr", "bytes"),
                              "model.layers.0.w": ("model", "layers", 0, "w"),
                              "model.layers.0.b": ("model", "layers", "0", "b")},
    "negative and big ints": {"a.-1": ("a", -1), "b.123456789012345678901234567890": ("b", 123456789012345678901234567890)},
    "empty parts": {"a..b": ("a.", "b"), ".lead": ("", "lead"), "tail.": ("tail.",), "": ("",)},
    "keys in another order": {f: tuple(f.split(".")) for f in reversed(FQNS)},
    "keys that name no fqn": {"not.an.fqn": ("not", "an", "fqn"), "x": ("x",), "also.not": ("also.not",)},
    "paths that are not their key": {"x": ("y",), "model.layers.0.w": ("model", "layers", "0", "W"),
                                     "model.layers.0.b": ("model.layers", "0", "b", "extra")},
    "odd values": {"x": torch.Size([2, 3]), "model.layers.0.w": torch.float32, "a..b": b"\x00\xff",
                   ".lead": math.nan, "tail.": ("tail", True), "módel.wé": (), "y": [("a",)],
                   "z": {"nested": ("a", 1)}, "w": ("w", 1.5)},
    "bools are not ints": {"a.1": ("a", True), "a.0": ("a", False), "b.1": ("b", 1)},
    "ints spelled oddly stay strings": {"a.01": ("a", "01"), "a.+1": ("a", "+1"), "a.-0": ("a", "-0")},
}


@pytest.mark.parametrize("name", list(ODD_PLANNER_DATA))
def test_planner_data_round_trips_exactly(name):
    pd = ODD_PLANNER_DATA[name]
    md = checkpoint(FQNS, pd)
    out = roundtrip(md, 3)  # deterministic, lazy == eager, re-encodes to the same bytes
    assert_same(out.planner_data, pd)
    assert_same(out, md)


def test_dcp_planner_data_costs_nothing_per_entry():
    """20,000 entries of 'path = the fqn split on dots' store no per-entry value; DCP's
    {"model": model.state_dict()} paths store one small id each, which zlib shrinks to nothing."""
    fqns = moe_fqns(20_000)
    bare = len(encode_metadata(checkpoint(fqns), version=3))
    split = encode_metadata(checkpoint(fqns, {f: tuple(f.split(".")) for f in fqns}), version=3)
    pd = v3_parts(split)[1]["planner_data"]
    assert (pd["entries"], pd["keys"], pd["ids"], pd["templates"], pd["odd"]) == (20_000, None, None, [], [])
    assert len(split) - bare < 100
    nested = encode_metadata(checkpoint(fqns, dcp_paths(fqns)), version=3)
    assert len(v3_parts(nested)[1]["planner_data"]["templates"]) == 2
    assert len(nested) - bare < 500  # version 2 spends ~100 bytes per entry on these
    assert len(encode_metadata(checkpoint(fqns, dcp_paths(fqns)), version=2)) - bare > 1_000_000


# ---------------------------------------------------------------------------------------------
# Which version the writer picks


def test_the_writer_picks_version_3_only_where_it_pays():
    assert FORMAT_VERSION == 2
    assert s3v3.worth_it(1_000_000, 800_000) and s3v3.worth_it(600_000, 520_000)
    assert not s3v3.worth_it(1_000_000, 900_000)  # 100 KB, but under 1/8
    assert not s3v3.worth_it(100_000, 40_000)  # 60%, but under 64 KiB
    small = checkpoint(FQNS, dcp_paths(FQNS))
    assert format_version_of(encode_metadata(small)) == 2
    assert encode_metadata(small) == encode_metadata(small, version=2)
    assert format_version_of(encode_metadata(small, version=3)) == 3  # asked for, written
    fqns = moe_fqns(20_000)
    unique = checkpoint(fqns, dcp_paths(fqns))
    data = encode_metadata(unique)
    assert format_version_of(data) == 3 and data == encode_metadata(unique, version=3)
    assert len(data) * 8 < len(encode_metadata(unique, version=2))
    assert_same(decode_metadata(data, lazy=False), unique)


def test_old_readers_refuse_version_3_by_name(monkeypatch):
    """A reader of versions 1 and 2 reads the outer header as version 2's and stops at its version."""
    data = encode_metadata(checkpoint(FQNS, dcp_paths(FQNS)), version=3)
    header = s3v2.header_of(data)
    assert (header["format"], header["version"]) == ("s3dcp-metadata", 3)
    monkeypatch.setattr(s3common, "_READS", (1, 2))
    with pytest.raises(MetadataFormatError) as info:
        plain_v2.decode(data)  # the old reader's whole path: header_of, then the version check
    assert str(info.value) == ("written by a newer s3dcp (format version 3); this s3dcp reads versions 1 to 2 "
                               "— upgrade s3dcp")


def test_a_newer_version_in_version_3_clothes_is_refused_by_name():
    outer, inner, body = v3_parts(encode_metadata(checkpoint(FQNS), version=3))
    refuse(v3_pack(dict(outer, version=4), inner, body), "newer s3dcp (format version 4)", "upgrade s3dcp")


# ---------------------------------------------------------------------------------------------
# Hostile objects


def _sample() -> tuple[dict, dict, bytes]:
    return v3_parts(encode_metadata(checkpoint(FQNS, dcp_paths(FQNS)), version=3))


def test_a_header_bomb_is_refused_before_it_is_inflated():
    outer, _, body = _sample()
    bomb = b" " * (64 * 2**20) + b"{}"  # valid JSON: 64 MiB of whitespace around an object
    packed = zlib.compress(bomb, 9)
    assert len(packed) < 200_000 and header_limit_bytes(200_000) < len(bomb)
    head = json.dumps(dict(outer, header={"codec": "zlib", "length": len(packed), "size": len(bomb)})).encode()
    out = s3v3.MAGIC + struct.pack("<Q", len(head)) + head + packed + body
    data = out + struct.pack("<I", zlib.crc32(out))
    refuse(data, "metadata.header.size", "more than a metadata object")
    # Declaring less than it holds: inflating stops at the declared size.
    head = json.dumps(dict(outer, header={"codec": "zlib", "length": len(packed), "size": 1000})).encode()
    out = s3v3.MAGIC + struct.pack("<Q", len(head)) + head + packed + body
    with peak_rss_sampler(0.005) as rss:
        refuse(out + struct.pack("<I", zlib.crc32(out)), "metadata.header", "longer than its declared size")
    assert rss.extra < 32 * 2**20, f"the refusal took {rss.extra / 2**20:.0f} MiB: it inflated the bomb"


@pytest.mark.parametrize(
    "lies, words",
    [
        ({"size": 4 * 2**20 - 1}, ["metadata.header.size", "more than zlib can inflate to"]),
        ({"size": 10}, ["metadata.header", "declared size"]),
        ({"codec": "brotli"}, ["metadata.header.codec", "brotli"]),
        ({"length": 10**9}, ["metadata.header.length", "not a byte count within"]),
        ({"length": -1}, ["metadata.header.length"]),
        ({"size": "many"}, ["metadata.header.size", "non-negative integer"]),
    ],
)
def test_a_packed_header_entry_that_lies_is_refused(lies, words):
    outer, inner, body = _sample()
    refuse(v3_pack(outer, inner, body, **lies), *words)


def test_a_plain_header_must_be_its_declared_size_and_json():
    outer, inner, body = _sample()
    refuse(v3_pack(outer, inner, body, codec="none", size=3), "metadata.header.size", "plain bytes")
    refuse(v3_pack(outer, b"[1, 2]", body, codec="none"), "metadata.header", "JSON object")
    refuse(v3_pack(outer, b"{not json", body), "metadata.header", "not valid JSON")
    assert_same(decode_metadata(v3_pack(outer, inner, body, codec="none"), lazy=False),
                checkpoint(FQNS, dcp_paths(FQNS)))


def _planner(**fields):
    def edit(inner):
        inner["planner_data"].update(fields)
    return edit


@pytest.mark.parametrize(
    "edit, words",
    [
        (_planner(keys=[0] * 8 + [5]), ["planner_data.keys", "outside the table"]),
        (_planner(keys=[0, -1] + [0] * 7), ["planner_data.keys", "key of two entries"]),
        (_planner(keys=[0] * 3), ["planner_data.keys", "array of 9 integers"]),
        (_planner(entries=10**9), ["planner_data.entries", "the table has 9"]),
        (_planner(entries=-1), ["planner_data.entries", "negative"]),
        (_planner(ids=[7] * 9), ["planner_data.ids", "template 7 is outside"]),
        (_planner(ids=[-1] * 9), ["planner_data.ids", "negative"]),
        (_planner(ids=[0] * 9), ["planner_data.odd", "0 values for 9 entries"]),
        (_planner(ids=[1] * 8 + [2]), ["template 2 does not fit key 'x'"]),
        (_planner(templates=[[["s", 0], ["s", 0]], [["s", 1]]]), ["templates[0]", "more than one"]),
        (_planner(templates=[[["f", 1]], []]), ["templates[0]", "bad element"]),
        (_planner(templates=[[["i", 2]], []]), ["templates[0]", "bad element"]),
        (_planner(ids=[4] + [1] * 8, templates=[[], [], [["i", 1], ["s", 0]]]), ["templates[0]", "non-empty"]),
        (_planner(extra_keys=["x"]), ["planner_data.extra_keys", "also an fqn"]),
        (_planner(extra_keys=[3]), ["planner_data.extra_keys", "strings"]),
        (_planner(odd="x"), ["planner_data.odd", "array"]),
        (_planner(entries=None), ["planner_data.entries", "integer"]),
        (lambda inner: inner["planner_data"].pop("templates"), ["planner_data", "missing field 'templates'"]),
        (lambda inner: inner.update(planner_data=[]), ["planner_data", "expected a JSON object"]),
        (lambda inner: inner.update(planner_data={"tree": {"__nope__": 1}}), ["planner_data", "unknown tag"]),
        (lambda inner: inner["columns"]["sd.offset"].update(count=10**9), ["columns['sd.offset']"]),
        (lambda inner: inner["storage_data"].update(rows=10**12), ["storage_data.rows", "more than a metadata object"]),
        (lambda inner: inner.update(fqns=inner["fqns"][:3]), ["state_dict_entries"]),
    ],
)
def test_references_and_counts_beyond_the_object_are_refused(edit, words):
    outer, inner, body = _sample()
    pd = inner["planner_data"]
    assert (pd["entries"], pd["keys"], pd["templates"]) == (9, None, [[["s", 1], ["s", 0]], [["s", 1], ["s", 1],
                                                                                              ["s", 0], ["s", 1]]])
    edit(inner)
    refuse(v3_pack(outer, inner, body), *words)


def test_an_int_template_reads_only_canonical_ints():
    md = checkpoint(["a.1", "a.01"], {"a.1": ("a", 1), "a.01": ("a", "01")})
    outer, inner, body = v3_parts(encode_metadata(md, version=3))
    assert inner["planner_data"]["templates"] == [[["s", 1], ["i", 1]]]
    inner["planner_data"]["ids"] = [2, 2]
    refuse(v3_pack(outer, inner, body), "reads '01' of key 'a.01' as an int")


def test_damaged_and_truncated_objects_are_refused():
    data = encode_metadata(checkpoint(FQNS, dcp_paths(FQNS)), version=3)
    bad = bytearray(data)
    bad[len(bad) // 2] ^= 0x40
    refuse(bytes(bad), "CRC32")
    refuse(data[:40], "truncated")


# ---------------------------------------------------------------------------------------------
# Through S3


def test_dcp_save_and_load_of_20000_unique_tensors_writes_version_3(uri, bucket, s3_config, boto3_client):
    """One rank of 20,000 uniquely named small tensors, nested as DCP flattens them and flat in
    one module's state dict: the writer picks version 3 and the load gives every value back."""
    n_layers, n_experts = 50, 200
    state: dict = {"model": {}, "moe": {"layers": {}}}
    for layer in range(n_layers):
        for e in range(n_experts):
            value = float(layer * n_experts + e)
            state["model"][f"layers.{layer}.experts.{e}.w"] = torch.full((2,), value)
            state["moe"]["layers"][str(layer)] = experts = state["moe"]["layers"].get(str(layer), {})
            experts[f"e{e}"] = {"w": torch.full((3,), -value, dtype=torch.bfloat16)}
    state["step"] = 7
    dcp.save(state, storage_writer=S3StorageWriter(uri, config=s3_config), no_dist=True)
    raw = boto3_client.get_object(Bucket=bucket, Key=f"ckpt/{METADATA_NAME}")["Body"].read()
    assert format_version_of(raw) == 3
    md = decode_metadata(raw)
    assert len(md.state_dict_metadata) == 2 * n_layers * n_experts + 1
    assert md.planner_data["moe.layers.3.e7.w"] == ("moe", "layers", "3", "e7", "w")
    assert md.planner_data["model.layers.3.experts.7.w"] == ("model", "layers.3.experts.7.w")

    dest: dict = {"model": {k: torch.zeros(2) for k in state["model"]},
                  "moe": {"layers": {str(layer): {f"e{e}": {"w": torch.zeros(3, dtype=torch.bfloat16)}
                                                  for e in range(n_experts)} for layer in range(n_layers)}},
                  "step": 0}
    dcp.load(dest, storage_reader=S3StorageReader(uri, config=s3_config), no_dist=True)
    assert dest["step"] == 7
    for k, v in state["model"].items():
        assert torch.equal(dest["model"][k], v), k
    for layer, experts in state["moe"]["layers"].items():
        for e, item in experts.items():
            assert torch.equal(dest["moe"]["layers"][layer][e]["w"], item["w"]), (layer, e)


def test_a_header_of_many_small_values_is_refused_before_it_is_parsed():
    """Unknown header fields are ignored, so a crafted one can hide millions of tiny JSON values
    (each ~50 bytes once parsed, for 3 bytes of text) that inflate from a few KB: refused by count."""
    outer, inner, body = _sample()
    inner["padding"] = [{}] * 1_000_000  # ~3 MB of JSON (under the 4 MiB any header may inflate to), ~3 KB packed
    data = v3_pack(outer, inner, body)
    assert len(data) < 100_000
    with peak_rss_sampler(0.005) as rss:
        refuse(data, "metadata.header", "JSON values", "damaged or crafted")
    assert rss.extra < 64 * 2**20, f"the refusal took {rss.extra / 2**20:.0f} MiB: it parsed the header"
    del inner["padding"]
    assert_same(decode_metadata(v3_pack(outer, inner, body), lazy=False), checkpoint(FQNS, dcp_paths(FQNS)))


def test_a_key_of_many_dots_is_charged_for_every_part_of_its_path():
    """A path is built from its key's dot-separated parts: one fqn of 8 * 10^6 dots (packed to a
    few KB, in an object padded to ~750 KB so that its header may inflate to ~12 MB) would make
    8 million strings; charged before anything is built."""
    outer, inner, body = _sample()
    inner["fqns"][0] = "." * 8_000_000 + "w"
    inner["padding"] = os.urandom(700_000).hex()  # an unknown field, ignored; incompressible
    data = v3_pack(outer, inner, body)
    assert len(data) < 900_000
    with peak_rss_sampler(0.005) as rss:
        refuse(data, "planner_data", "path parts", "more than a metadata object")
    assert rss.extra < 128 * 2**20, f"the refusal took {rss.extra / 2**20:.0f} MiB"
