"""Export and safetensors headers against hostile input (issue 33, rows 10 and 11): what a header
or a checkpoint's metadata declares is checked against what it can be before anything of that
size is allocated or written, and a bad value is an S3DCPError naming the field."""

from __future__ import annotations

import json
import os
import struct
import time

import pytest
import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from s3dcp.errors import ConfigError, MetadataFormatError
from s3dcp.format.layout import ItemLocation
from s3dcp.format.safetensors import MAX_DIMS, MAX_INDEX_BYTES, parse_header, parse_index
from s3dcp.interop.export import export_safetensors

from handmade import OBJECT, put_checkpoint, put_metadata, tensor_meta
from rss import peak_rss_sampler

MiB = 1 << 20


# ------------------------------------------------------------------------------ declared sizes (row 10)
@pytest.mark.parametrize("elements", [2**30, 2**40], ids=["4GiB", "4TiB"])
def test_export_checks_declared_sizes_against_the_objects_before_writing(uri, s3_config, tmp_path, elements):
    """A float32 tensor declared 4 GiB (4 TiB) long, stored in a 64-byte object: export wrote a
    4 GiB zero-filled file over 24.5 s before failing (4 TiB: "internal error: RuntimeError ...
    can't allocate memory"). download refused it up front; export now does too."""
    md = Metadata({"w": tensor_meta(torch.float32, [elements], [([0], [elements])])}, storage_data={
        MetadataIndex("w", torch.Size([0])): ItemLocation(OBJECT, 0, 4 * elements, "crc64nvme:0000000000000000",
                                                          "float32", (elements,))})
    put_metadata(uri, s3_config, md, {OBJECT: bytes(64)})
    out = tmp_path / "hf"
    start = time.perf_counter()
    with peak_rss_sampler() as rss:
        with pytest.raises(MetadataFormatError, match=rf"tensor 'w' of shape \[{elements}\].*past the end of {OBJECT} "
                                                      r"\(64 bytes\)"):
            export_safetensors(uri, str(out), config=s3_config)
    assert time.perf_counter() - start < 20 and rss.extra < 64 * MiB
    assert not out.exists() or os.listdir(out) == []  # nothing written


def test_export_of_an_intact_checkpoint_still_checks_only_the_tensors_it_exports(uri, s3_config, tmp_path):
    """A broken tensor left out by --only does not stop the export of the others."""
    a, b = torch.arange(6, dtype=torch.float32), torch.ones(3)
    put_checkpoint(uri, s3_config, {"a": tensor_meta(torch.float32, [6], [([0], [6])]),
                                    "b": tensor_meta(torch.float32, [5], [([0], [3])])},  # b: a hole
                   [("a", [0], a), ("b", [0], b)])
    export_safetensors(uri, str(tmp_path / "hf"), only=["a"], config=s3_config)
    with pytest.raises(MetadataFormatError, match=r"'b' of shape \[5\].*no chunk holds the elements at \(3,\)"):
        export_safetensors(uri, str(tmp_path / "hf2"), config=s3_config)


# ------------------------------------------------------------------------------ safetensors headers (row 11)
def _header(doc) -> bytes:
    text = json.dumps(doc).encode() if not isinstance(doc, bytes) else doc
    return struct.pack("<Q", len(text)) + text


@pytest.mark.parametrize("dtype", [["F32"], {"F32": 1}, 7, None])
def test_a_dtype_that_is_not_a_string_is_named(dtype):
    """A list or dict dtype gave "TypeError: unhashable type"."""
    raw = _header({"w": {"dtype": dtype, "shape": [2], "data_offsets": [0, 8]}})
    with pytest.raises(MetadataFormatError, match=r"x: tensor 'w' has dtype .*its 'dtype' must be a string"):
        parse_header(raw, source="x")


def test_metadata_values_must_be_strings():
    raw = _header({"__metadata__": {"format": ["pt"]}, "w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})
    with pytest.raises(MetadataFormatError, match="__metadata__ is not a JSON object of strings"):
        parse_header(raw, source="x")


def test_a_shape_of_millions_of_dimensions_is_refused_in_bounded_memory():
    """A 9.7 MiB header with one 3.4-million-dimension shape: +285 MiB and 2.4 s to parse."""
    dims = 3_400_000
    text = b'{"w":{"dtype":"U8","shape":[' + b",".join([b"1"] * dims) + b'],"data_offsets":[0,1]}}'
    assert len(text) > 6 * MiB
    with peak_rss_sampler(0.005) as rss:
        start = time.perf_counter()
        with pytest.raises(MetadataFormatError, match=rf"'shape' in the safetensors header has {dims} dimensions, "
                                                      rf"more than {MAX_DIMS}"):
            parse_header(_header(text), source="x")
        seconds = time.perf_counter() - start
    assert rss.extra < 48 * MiB and seconds < 5, (rss.extra / MiB, seconds)


def test_a_shape_past_the_bound_is_refused_even_when_its_key_is_escaped():
    """JSON lets a key be written with escapes ("\\u0073hape"): the pre-parse scan misses it, the
    parsed entry is still refused."""
    text = b'{"w":{"dtype":"U8","\\u0073hape":[' + b",".join([b"1"] * (MAX_DIMS + 1)) + b'],"data_offsets":[0,1]}}'
    with pytest.raises(MetadataFormatError, match=rf"tensor 'w' has a 'shape' of {MAX_DIMS + 1} dimensions"):
        parse_header(_header(text), source="x")
    ok = b'{"w":{"dtype":"U8","shape":[' + b",".join([b"1"] * MAX_DIMS) + b'],"data_offsets":[0,1]}}'
    assert parse_header(_header(ok), source="x").tensors[0].shape == (1,) * MAX_DIMS


def test_many_shape_keys_before_one_bracket_are_scanned_once():
    """The pre-parse shape scan looked ahead from every '"shape":[' to the next ']': a header of
    that key repeated, with one ']' at its end, cost time quadratic in its length."""
    text = b'{"w":{"dtype":"U8",' + b'"shape":[' * 60_000 + b"]"
    start = time.perf_counter()
    with pytest.raises(MetadataFormatError, match="not JSON"):
        parse_header(_header(text), source="x")
    assert time.perf_counter() - start < 2


def test_error_messages_quote_a_huge_entry_in_bounded_text():
    spec = {"dtype": "U8", "shape": [1], "junk": "x" * 5_000_000}  # no data_offsets
    with pytest.raises(MetadataFormatError, match="malformed header entry") as e:
        parse_header(_header({"w": spec}), source="x")
    assert len(str(e.value)) < 500


@pytest.mark.parametrize("raw", [b" " * (MAX_INDEX_BYTES + 1), b"[" * 300_000])
def test_a_safetensors_index_too_large_or_too_deep_is_refused(raw):
    with pytest.raises(MetadataFormatError, match="safetensors index"):
        parse_index(raw, source="x")


def test_the_reader_refuses_an_index_larger_than_any_before_reading_it(s3_config, bucket, boto3_client):
    from s3dcp.interop.safetensors_reader import S3SafetensorsReader

    boto3_client.put_object(Bucket=bucket, Key="m/model.safetensors.index.json", Body=b" " * (MAX_INDEX_BYTES + 1))
    reader = S3SafetensorsReader(f"s3://{bucket}/m", config=s3_config)
    with pytest.raises(MetadataFormatError, match="more than a safetensors index holds"):
        reader.read_headers()
    assert reader.last_header_bytes == 0  # refused by its size in the listing, not read


def test_a_tensor_named_like_the_headers_metadata_is_refused_by_export(uri, s3_config, tmp_path):
    """A checkpoint tensor named ``__metadata__`` gave "internal error: KeyError"."""
    w = torch.arange(4, dtype=torch.float32)
    put_checkpoint(uri, s3_config, {"__metadata__": tensor_meta(torch.float32, [4], [([0], [4])])},
                   [("__metadata__", [0], w)])
    with pytest.raises(ConfigError, match="tensor '__metadata__' would be named '__metadata__' in the export, the key "
                                          "safetensors reserves"):
        export_safetensors(uri, str(tmp_path / "hf"), config=s3_config)
    assert not os.path.exists(tmp_path / "hf") or os.listdir(tmp_path / "hf") == []
