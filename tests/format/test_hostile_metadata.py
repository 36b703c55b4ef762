"""Hostile metadata objects: small, hand-edited, with a valid trailer CRC. Each decodes or is refused
with a MetadataFormatError naming the field, without building what it declares (the issue's table)."""

from __future__ import annotations

import json
import struct
import zlib

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from s3dcp.errors import MetadataFormatError
from s3dcp.format.layout import ItemLocation
from s3dcp.format.metadata import decode_metadata, encode_metadata, v2
from tests.format.v2_objects import pack, parts, put_column, put_raw_column
from tests.rss import peak_rss_sampler

MiB = 2**20
EXTRA_RSS_LIMIT = 256 * MiB  # the goal for any object of <= 10 MB


def scalar_checkpoint() -> bytes:
    """What dcp.save of {"step": tensor(7), "w": ..., "note": bytes} records: a 0-d tensor among others."""
    scalar = TensorStorageMetadata(TensorProperties(torch.int64), torch.Size([]),
                                   [ChunkStorageMetadata(torch.Size([]), torch.Size([]))])
    w = TensorStorageMetadata(TensorProperties(torch.float32), torch.Size([4, 4]),
                              [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([4, 4]))])
    sd = {
        MetadataIndex("step", torch.Size([]), 0): ItemLocation("__0_0.t.distcp", 0, 8, "crc32c:0badf00d", "int64", ()),
        MetadataIndex("w", torch.Size([0, 0]), 0): ItemLocation("__0_0.t.distcp", 8, 64, "crc32c:01234567", "float32",
                                                                (4, 4)),
        MetadataIndex("note"): ItemLocation("__0_0.t.distcp", 72, 5, "crc32c:89abcdef"),
    }
    md = Metadata({"step": scalar, "w": w, "note": BytesStorageMetadata()}, planner_data={
        f"model.layers.{i}.w": ("model", "layers", str(i), "w") for i in range(12)}, storage_data=sd)
    return encode_metadata(md)


def bounded_decode(data: bytes, limit_bytes: int = EXTRA_RSS_LIMIT) -> MetadataFormatError | Metadata:
    """Decode ``data`` under an RSS sampler; the result or the MetadataFormatError (anything else fails the test)."""
    with peak_rss_sampler(0.005) as rss:
        try:
            result = decode_metadata(data, source="s3://b/ck/.metadata")
        except MetadataFormatError as e:
            result = e
    assert rss.extra <= limit_bytes, f"decode took {rss.extra / MiB:.0f} MiB more memory"
    return result


def test_scalar_checkpoint_is_small_and_decodes():
    data = scalar_checkpoint()
    assert 2_000 < len(data) < 4_000  # the 2.7 KB object
    md = decode_metadata(data)
    assert md.state_dict_metadata["step"].size == torch.Size([])


@pytest.mark.parametrize("count", [10**6, 3 * 10**6, 2**32 - 1])
def test_zero_d_layout_with_a_huge_chunk_count(count):
    """Row 1: layouts with ndim=0 store no values, so nothing in the object pays for the count.
    Before: 10^6 -> 0.85 s, +420 MiB; 3*10^6 -> +780 MiB; 2^32-1 -> MemoryError."""
    header, body = parts(scalar_checkpoint())
    (zero_d,) = [i for i, nd in enumerate(np.frombuffer(_column(header, body, "layout.ndim"), np.uint8)) if nd == 0]
    counts = np.frombuffer(_column(header, body, "layout.count"), np.uint8).astype(np.uint64)
    counts[zero_d] = count
    body = put_column(header, body, "layout.count", counts, "u8")
    # A chunk that costs nothing in the object may cost a few list slots in memory, no more.
    result = bounded_decode(pack(header, body), min(EXTRA_RSS_LIMIT, 16 * MiB + 48 * count))
    if isinstance(result, MetadataFormatError):
        assert "layout.count" in str(result) or "sdm.layout" in str(result), result
    else:  # a decode that builds them must have paid almost nothing for each
        assert len(result.state_dict_metadata["step"].chunks) == count
    if count == 2**32 - 1:
        assert isinstance(result, MetadataFormatError)
        assert "s3://b/ck/.metadata" in str(result) and "more than a metadata object of" in str(result)


def _column(header: dict, body: bytes, name: str) -> bytes:
    entry = header["columns"][name]
    assert entry["codec"] == "none"
    return body[entry["offset"]:entry["offset"] + entry["length"]]


@pytest.mark.parametrize("name", ["sd.fqn", "sd.length", "sdm.size", "layout.offsets", "layout.ndim"])
def test_compressed_column_declaring_1e8_values(name):
    """Row 2: a column that declares 10^8 values, zlib-compressed into ~100 KB: refused before it is
    inflated (before: inflated and widened first, +860 MiB over 2.3 s, then refused)."""
    header, body = parts(scalar_checkpoint())
    n = 10**8
    raw = zlib.compress(bytes(n), 9)
    assert len(raw) < 150_000
    if name == "sd.fqn":
        header["storage_data"]["rows"] = n  # the rows agree with the column: only the size can tell
    body = put_raw_column(header, body, name, raw, kind="u1", count=n, codec="zlib")
    result = bounded_decode(pack(header, body))
    assert isinstance(result, MetadataFormatError)
    field = "metadata.storage_data.rows" if name == "sd.fqn" else f"metadata.columns[{name!r}]"
    assert field in str(result), result


def test_column_past_zlib_ratio_refused_before_inflating():
    header, body = parts(scalar_checkpoint())
    raw = zlib.compress(bytes(10**4), 9)  # ~30 bytes
    header["storage_data"]["rows"] = 10**6  # 8 MB from 30 bytes: more than deflate can expand to
    body = put_raw_column(header, body, "sd.fqn", raw, kind="u8", count=10**6, codec="zlib")
    with pytest.raises(MetadataFormatError, match=r"sd\.fqn.*more than zlib can inflate"):
        decode_metadata(pack(header, body))


def test_budget_scales_with_the_object_not_below_its_floor():
    """A real object's columns (here: one that inflates ~1,000:1) decode while within the budget."""
    from s3dcp.format.metadata.budget import MIN_COLUMN_BYTES

    header, body = parts(scalar_checkpoint())
    n = MIN_COLUMN_BYTES // 2
    body = put_raw_column(header, body, "unknown.extra", zlib.compress(bytes(n), 9), kind="u1", count=n,
                          codec="zlib")
    assert decode_metadata(pack(header, body)).state_dict_metadata.keys() == {"step", "w", "note"}


def test_json_column_count_checked_against_its_bytes():
    from s3dcp.format.metadata.budget import DecodeBudget
    from s3dcp.format.metadata.columns import ColumnReader

    raw = b"[" + b"1," * 9 + b"1]"
    entries = {"c": {"type": "json", "count": 10**9, "offset": 0, "length": len(raw), "codec": "none"}}
    with pytest.raises(MetadataFormatError, match=r"'c'.*cannot fit"):
        ColumnReader(entries, memoryview(raw), DecodeBudget(len(raw))).ints("c")


def test_more_layouts_than_tensors_refused():
    header, body = parts(scalar_checkpoint())
    body = put_column(header, body, "layout.ndim", [1] * 4, "u1")
    with pytest.raises(MetadataFormatError, match=r"layout\.ndim.*4 chunk layouts for 3 state_dict entries"):
        decode_metadata(pack(header, body))


def test_huge_storage_rows_refused_naming_the_field():
    header, body = parts(scalar_checkpoint())
    header["storage_data"]["rows"] = 2**40
    with pytest.raises(MetadataFormatError, match=r"storage_data\.rows: declares 1099511627776 storage items"):
        decode_metadata(pack(header, body))


# ---------------------------------------------------------------------------------------------
# The goal: any object of <= 10 MB decodes or is refused within 256 MiB of extra memory. The
# densest objects the budget lets through: E tensors sharing one layout of C chunks, a storage
# row for every chunk, every column compressed, padded to 10 MB with incompressible bytes.


def _zcol(header: dict, body: bytes, name: str, values, kind: str) -> bytes:
    return put_column(header, body, name, np.asarray(values), kind, codec="zlib")


def dense_object(tensors: int, chunks: int, size_bytes: int = 10 * 10**6) -> bytes:
    one = [ChunkStorageMetadata(torch.Size([0]), torch.Size([1]))]
    sdm = {f"t{i}": TensorStorageMetadata(TensorProperties(torch.float32), torch.Size([1]), list(one))
           for i in range(tensors)}
    sd = {MetadataIndex(f"t{i}", torch.Size([0]), 0): ItemLocation("o", 4 * i, 4, None, "float32", (1,))
          for i in range(tensors)}
    header, body = parts(encode_metadata(Metadata(sdm, storage_data=sd)))
    c, rows = chunks, tensors * chunks
    for name, values, kind in [
        ("layout.ndim", [1], "u1"), ("layout.count", [c], "u4"), ("layout.offsets", np.arange(c), "u4"),
        ("layout.sizes", np.ones(c), "u1"), ("sdm.size", np.full(tensors, c), "u4"),
        ("sd.fqn", np.repeat(np.arange(tensors), c), "u2"), ("sd.chunk", np.tile(np.arange(c), tensors), "u4"),
        ("sd.dtype", np.ones(rows), "u1"), ("sd.offset", np.arange(rows) * 4, "u4"), ("sd.length", np.full(rows, 4), "u1"),
    ] + [(name, np.zeros(rows), "u1") for name in ("sd.chunk.null", "sd.index", "sd.index.null", "sd.object",
                                                   "sd.shape.kind", "sd.block_size", "sd.blocks", "sd.checksum.null",
                                                   "sd.checksum")]:
        body = _zcol(header, body, name, values, kind)
    header["storage_data"].update(rows=rows, checksum={"algorithm": "crc32c", "hex_digits": 8})
    pad = size_bytes - len(pack(header, body)) - 200
    body = put_raw_column(header, body, "padding", np.random.default_rng(0).bytes(pad), kind="u1", count=pad)
    data = pack(header, body)
    assert len(data) <= size_bytes
    return data


@pytest.mark.parametrize("tensors, decodes", [(3000, True), (4000, False)])
def test_densest_ten_megabyte_objects_stay_bounded(tensors, decodes):
    """3 M storage rows in 10 MB decode (a checkpoint without checksums is about that dense);
    4 M are refused, naming the column; neither takes more than 256 MiB."""
    from s3dcp.format.metadata import validate_metadata

    result = bounded_decode(dense_object(tensors, 1000))
    if decodes:
        assert len(result.storage_data) == tensors * 1000
        validate_metadata(result)
    else:
        assert isinstance(result, MetadataFormatError) and "metadata.columns['sd." in str(result), result


def _v1(planner_data: bytes) -> bytes:
    return (b'{"format":"s3dcp-metadata","version":1,"dcp_version":null,"state_dict_metadata":{},'
            b'"storage_data":null,"storage_meta":null,"planner_data":' + planner_data + b"}")


def test_v1_document_of_empty_arrays_refused_before_parsing():
    """'[],' is 3 bytes of text and ~120 bytes once parsed and decoded: 10 MB of it took +483 MiB."""
    result = bounded_decode(_v1(b"[" + b"[]," * (10**7 // 3) + b"[]]"), 16 * MiB)
    assert isinstance(result, MetadataFormatError) and "JSON arrays and objects" in str(result), result


def test_v1_densest_document_accepted_stays_bounded():
    result = bounded_decode(_v1(b"[" + b"[0,0,0,0,0]," * (10**7 // 12 - 20) + b"[]]"))
    assert len(result.planner_data) == 10**7 // 12 - 19


# ---------------------------------------------------------------------------------------------
# Long names (issue 33, rows 5 and 6): the decoder used to build each check's context text (the
# field's path, holding the tensor's full name) for every chunk before any check, so one name of
# megabytes times many chunks made a decode copy terabytes. Context is now built only on error,
# names are charged to the budget by length, and format 2's JSON header has format 1's parse bound.

DECODE_LIMIT_S = 6.0  # the goal is 2 s; this machine is shared and slow. Before: 19.7 s, 46 s, > 60 s


def _decode_everything(data: bytes):
    """What every consumer of .metadata runs: the plain decode (inspect, verify, rm), DCP's (a
    load) and the load's validation; the result, or the MetadataFormatError."""
    import time

    from s3dcp.format.metadata import decode_plain, validate_metadata
    from s3dcp.format.references import object_names

    start = time.perf_counter()
    outcomes = []
    for step in (lambda: decode_plain(data, source="s3://b/ck/.metadata"),
                 lambda: object_names(data, "s3://b/ck/.metadata"),
                 lambda: validate_metadata(decode_metadata(data, source="s3://b/ck/.metadata"))):
        with peak_rss_sampler(0.005) as rss:
            try:
                step()
                outcomes.append("ok")
            except MetadataFormatError as e:
                outcomes.append(str(e))
        assert rss.extra <= EXTRA_RSS_LIMIT, f"{rss.extra / MiB:.0f} MiB more memory"
    seconds = time.perf_counter() - start
    assert seconds <= DECODE_LIMIT_S, f"took {seconds:.1f} s"
    return outcomes


_PROPS = b'{"dtype":"float32","layout":"strided","requires_grad":false,"memory_format":"contiguous_format",' \
         b'"pin_memory":false}'


def v1_long_name(total: int) -> bytes:
    """Format 1: one tensor whose name is about half the object, with as many 0-d chunks as the
    rest holds (as many as format 1's container bound lets through)."""
    chunk = b'{"offsets":[],"sizes":[]}'
    n = min(total // 2 // (len(chunk) + 1), 2**18 // 3 - 10)
    head = (b'{"format":"s3dcp-metadata","version":1,"dcp_version":null,"storage_data":null,"storage_meta":null,'
            b'"planner_data":null,"state_dict_metadata":{"')
    tail = b'":{"type":"tensor","properties":' + _PROPS + b',"size":[],"chunks":[' + b",".join([chunk] * n) + b"]}}}"
    return head + b"a" * (total - len(head) - len(tail)) + tail


def v3_long_name(total: int = 224_000, name_chars: int = 3_500_000, chunks: int = 40_000) -> bytes:
    """Format 3: one tensor named by one repeated letter (it compresses to nothing), its chunks
    as odd chunks in the packed header, padded with incompressible bytes to ``total`` bytes."""
    from s3dcp.format.metadata import v3

    header, body = parts(scalar_checkpoint())  # a format-2 object: its header becomes format 3's packed one
    header["fqns"] = ["a" * name_chars]
    header["state_dict_entries"] = 1
    header["odd_chunks"] = {"0": [[[], []]] * chunks}
    header["storage_data"] = None
    header["planner_data"] = {"__dict__": []}
    for name, values in (("sdm.properties", [1]), ("sdm.layout", [0]), ("sdm.size.len", [0])):
        body = put_column(header, body, name, values, "u1")
    for name in ("sdm.size", "layout.ndim", "layout.count", "layout.offsets", "layout.sizes"):
        body = put_column(header, body, name, [], "u1")
    small = v3.encode(pack(header, body))
    pad = total - len(small)
    body = put_raw_column(header, body, "padding", np.random.default_rng(0).bytes(pad), kind="u1", count=pad)
    data = v3.encode(pack(header, body))
    assert abs(len(data) - total) < 100 and data[:8] == v3.MAGIC
    return data


def test_format_3_object_with_one_long_compressed_name_decodes_in_bounded_time():
    """224 KB of format 3 holding a 3.5 MB name and 40,000 chunks: 46 s in every decode before."""
    data = v3_long_name()
    plain, names, loaded = _decode_everything(data)
    assert plain == names == "ok"
    assert "state_dict_metadata['aaaa" in loaded and "... (3500000 characters)" in loaded, loaded[:400]
    assert len(loaded) < 1000  # the name is cut in the message


@pytest.mark.parametrize("total", [3 * 10**6, 94 * 10**5])
def test_format_1_document_with_one_long_name_decodes_in_bounded_time(total):
    """Format 1, the name half the object and 87,000 chunks: 3 MB took 19.7 s, 9.4 MB over 60 s."""
    plain, names, loaded = _decode_everything(v1_long_name(total))
    assert plain == names == "ok"
    assert "two chunks at the same offsets" in loaded or "hold 0 elements" in loaded or "chunks hold" in loaded, \
        loaded[:300]
    assert len(loaded) < 1000


def test_format_2_header_of_empty_arrays_refused_before_parsing():
    """A 9.44 MiB format-2 object whose header is planner_data of "[]," (as format 1 refuses it):
    parsed before, +469 MiB and 5 s; now refused by the same bound, naming the header."""
    header, body = parts(scalar_checkpoint())
    header["planner_data"] = "PLACEHOLDER"
    n = (int(9.44 * MiB) - len(pack(header, body))) // 3
    head = json.dumps(header).encode().replace(b'"PLACEHOLDER"', b"[" + b"[]," * n + b"[]]")
    out = v2.MAGIC + struct.pack("<Q", len(head)) + head + body
    data = out + struct.pack("<I", zlib.crc32(out))
    assert len(data) >= 9.4 * MiB
    for refusal in _decode_everything(data):  # rm's light reader leaves it to the decoder, which refuses it
        assert "s3://b/ck/.metadata: corrupt s3dcp metadata header: " in refusal, refusal
        assert "JSON arrays and objects" in refusal, refusal


def test_names_are_charged_to_the_budget_by_length():
    from s3dcp.format.metadata.budget import DecodeBudget

    budget = DecodeBudget(1000)
    budget.names("metadata.fqns", ["x" * (8 * budget.objects_limit // 2)], "fqns")  # half the budget
    with pytest.raises(MetadataFormatError, match=r"metadata\.fqns: declares \d+ characters of fqns"):
        budget.names("metadata.fqns", ["y" * (8 * budget.objects_limit // 2)], "fqns")


def test_planner_data_of_millions_of_values_decodes_in_bounded_time():
    """A 10 MB format-1 document whose planner_data is one list of five million numbers (one JSON
    array: within the parse bound), and the same values as a tagged tuple in format 2: every
    value went through the tree decoder's recursion (~1.2 s a million)."""
    numbers = b"[" + b"0," * (5 * 10**6 - 1) + b"0]"
    for outcome in _decode_everything(_v1(numbers)):
        assert outcome == "ok", outcome
    header, body = parts(scalar_checkpoint())
    header["planner_data"] = {"__tuple__": [0] * (2 * 10**6)}
    for outcome in _decode_everything(pack(header, body)):
        assert outcome == "ok", outcome


def test_a_huge_value_where_a_number_belongs_is_named_in_bounded_time():
    """Format 3's outer header saying its packed header's length is a list of a million numbers:
    the message printed the whole list first."""
    from s3dcp.format.metadata import v3

    data = v3.encode(scalar_checkpoint())
    (n,) = struct.unpack_from("<Q", data, 8)
    outer = json.loads(data[16:16 + n])
    outer["header"]["length"] = [0] * 10**6
    head = json.dumps(outer).encode()
    out = v2.MAGIC + struct.pack("<Q", len(head)) + head + data[16 + n:-4]
    for refusal in _decode_everything(out + struct.pack("<I", zlib.crc32(out))):
        assert "metadata.header.length: [0, 0, 0, 0, 0, 0, 0, 0, ...] is not a byte count" in refusal, refusal[:300]


# ---------------------------------------------------------------- the light readers (ls, rm, gc)
def test_object_names_as_a_string_are_never_taken_for_names():
    """A header's (or a pending marker's) object_names written as a string: set() of it gave
    its characters, which rm and gc would have taken as names other checkpoints use."""
    from s3dcp.format.references import object_names, pending_names

    header, body = parts(scalar_checkpoint())
    assert object_names(pack(header, body), "x") == {"__0_0.t.distcp"}
    header["storage_data"]["object_names"] = "__0_0.t.distcp"
    with pytest.raises(MetadataFormatError):  # the light reader declines; the decoder says what is wrong
        object_names(pack(header, body), "x")
    marker = {"format": "s3dcp-pending-references", "version": 1, "save_id": "s", "base": "b", "object_names": "ab"}
    with pytest.raises(MetadataFormatError, match="not a list of names"):
        pending_names(json.dumps(marker).encode(), "x")


@pytest.mark.parametrize("reader", ["object_names", "pending_names", "local_marker"])
def test_json_nested_past_the_parsers_depth_is_a_clear_error(reader):
    """200,000 nested '[' pass the container bound and make json.loads raise RecursionError."""
    from s3dcp.format.local import LocalMarker
    from s3dcp.format.references import object_names, pending_names

    raw = b"[" * 200_000
    call = {"object_names": lambda: object_names(raw, "x"), "pending_names": lambda: pending_names(raw, "x"),
            "local_marker": lambda: LocalMarker.decode(raw, "x")}[reader]
    with pytest.raises(MetadataFormatError):
        call()


# ---------------------------------------------------------------- planner_data paths (issue 42, row 6)
def _with_planner_data(planner_data: dict, version: int) -> bytes:
    """A checkpoint whose stored items are the keys of ``planner_data`` (bytes items, 8 bytes each)."""
    keys = [k for k in planner_data if isinstance(k, str)]
    sd = {MetadataIndex(k): ItemLocation("__0_0.t.distcp", 8 * i, 8, "crc32c:0badf00d") for i, k in enumerate(keys)}
    return encode_metadata(Metadata({k: BytesStorageMetadata() for k in keys}, planner_data=planner_data,
                                    storage_data=sd), version=version)


@pytest.mark.parametrize("version", [1, 2, 3])
def test_list_items_past_the_entries_that_use_a_list_are_charged_to_the_budget(version):
    """One planner_data path holding the list index 10^11 made a load into an empty state dict
    (s3dcp download) append None until the list was that long: MemoryError after 11.5 s under a
    2 GB cap, unbounded without one. An index within the entries that use its list costs
    nothing; past them (a list of empty dicts before a tensor gives that) each item is charged to
    the decode's budget; a negative index is refused."""
    honest = {f"opt.groups.{i}.lr": ("opt", "groups", i, "lr") for i in range(3)}
    honest |= {"opt.groups.0.wd": ("opt", "groups", 0, "wd"), "opt.state.0.0": ("opt", "state", 0, 0),
               "step": ("step",), "odd": ["a", 1], "size": torch.Size([2, 3]), "mixed": ("opt", "groups", "x"),
               "l.2": ("l", 2)}  # what DCP writes for {"l": [{}, {}, tensor]}: 3 items, 1 entry
    assert decode_metadata(_with_planner_data(honest, version)).planner_data == honest
    for key, path, words in [
        ("opt.groups.2.lr", ("opt", "groups", 10**11, "lr"),
         "declares 99999999996 list items (index 100000000000 at ('opt', 'groups'), past the 5 entries that use "
         "that list), more than a metadata object of"),
        ("opt.groups.2.lr", ("opt", "groups", 1e11, "lr"), "list items (index 100000000000.0 at ('opt', 'groups')"),
        ("opt.state.0.0", ("opt", "state", 0, 10**11), "list items (index 100000000000 at ('opt', 'state', 0), past "
                                                       "the 1 entries"),
        ("l.2", ("l", 2**40), "declares 1099511627776 list items (index 1099511627776 at ('l',)"),
        ("size", torch.Size([0, 10**11]), "declares 100000000001 list items a load would build"),
        ("opt.groups.2.lr", ("opt", "groups", -1, "lr"), "list index -1 at ('opt', 'groups') is negative"),
    ]:
        crafted = _with_planner_data({**honest, key: path}, version)
        assert len(crafted) < 4_000
        plain, light, load = _decode_everything(crafted)
        assert light == "ok" or words in light  # rm and gc need the object names alone
        for refusal in (plain, load):
            assert refusal.startswith(f"s3://b/ck/.metadata: metadata.planner_data[{key!r}]") and words in refusal, \
                refusal
    # the paths of what is not stored are another planner's data, kept as written
    assert decode_metadata(_with_planner_data({**honest, 7: ("opt", "groups", 10**11)}, version)).planner_data[7] \
        == ("opt", "groups", 10**11)
