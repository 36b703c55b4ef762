"""validate_metadata: what a load relies on, checked the same way on every form of decoded metadata
(version 1, version 2 lazy, version 2 as a plain dict)."""

from __future__ import annotations

import dataclasses

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
from s3dcp.format.metadata import decode_metadata, encode_metadata, validate_metadata
from s3dcp.format.metadata.storage import LazyStorageData
from tests.format.test_metadata import build_scaled

FORMS = ["v1", "v2-lazy", "v2-dict"]


def decoded(md: Metadata, form: str) -> Metadata:
    if form == "v1":
        return decode_metadata(encode_metadata(md, version=1))
    out = decode_metadata(encode_metadata(md), lazy=form == "v2-lazy")
    assert md.storage_data is None or isinstance(out.storage_data, LazyStorageData) == (form == "v2-lazy")
    return out


def sample() -> Metadata:
    """Two tensors sharing a chunk layout (as v2 stores them), a 0-d tensor, a bytes item, block checksums."""
    chunks = [ChunkStorageMetadata(torch.Size([4 * r, 0]), torch.Size([4, 8])) for r in range(3)]
    sdm = {
        "a": TensorStorageMetadata(TensorProperties(torch.bfloat16), torch.Size([12, 8]), chunks),
        "b": TensorStorageMetadata(TensorProperties(torch.float32), torch.Size([12, 8]), list(chunks)),
        "step": TensorStorageMetadata(TensorProperties(torch.int64), torch.Size([]),
                                      [ChunkStorageMetadata(torch.Size([]), torch.Size([]))]),
        "note": BytesStorageMetadata(),
    }
    sd = {}
    for r in range(3):
        for fqn, size in (("a", 2), ("b", 4)):
            blocks = ("crc32c:00000001", "crc32c:00000002") if r == 1 else ()
            sd[MetadataIndex(fqn, chunks[r].offsets, r)] = ItemLocation(
                f"__{r}_0.t.distcp", 0 if fqn == "a" else 64, 32 * size, "crc32c:0000beef",
                "bfloat16" if fqn == "a" else "float32", (4, 8), block_size=16 * size if blocks else 0,
                block_checksums=blocks)
    sd[MetadataIndex("step", torch.Size([]), 0)] = ItemLocation("__0_0.t.distcp", 192, 8, "crc64nvme:" + "0" * 16,
                                                                "int64", ())
    sd[MetadataIndex("note")] = ItemLocation("__0_0.t.distcp", 200, 5, None)
    return Metadata(sdm, storage_data=sd)


@pytest.mark.parametrize("form", FORMS)
def test_real_metadata_is_valid(form):
    validate_metadata(decoded(sample(), form))
    validate_metadata(decoded(build_scaled(16, 30), form))


def _loc(md: Metadata, fqn: str, r: int = 0, **change) -> Metadata:
    key = next(k for k in md.storage_data if k.fqn == fqn and (k.offset is None or not len(k.offset) or k.offset[0] == 4 * r))
    sd = dict(md.storage_data)
    sd[key] = dataclasses.replace(sd[key], **change)
    return dataclasses.replace(md, storage_data=sd)


def _drop(md: Metadata, fqn: str, r: int = 0) -> Metadata:
    sd = {k: v for k, v in md.storage_data.items()
          if not (k.fqn == fqn and (k.offset is None or not len(k.offset) or k.offset[0] == 4 * r))}
    return dataclasses.replace(md, storage_data=sd)


def _chunk(md: Metadata, fqn: str, offsets, sizes) -> Metadata:
    item = md.state_dict_metadata[fqn]
    chunks = [ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))] + list(item.chunks[1:])
    return dataclasses.replace(md, state_dict_metadata={**md.state_dict_metadata,
                                                        fqn: dataclasses.replace(item, chunks=chunks)})


def _extra_chunk(md: Metadata, fqn: str) -> Metadata:
    item = md.state_dict_metadata[fqn]
    chunks = list(item.chunks) * 2
    return dataclasses.replace(md, state_dict_metadata={**md.state_dict_metadata,
                                                        fqn: dataclasses.replace(item, chunks=chunks)})


BROKEN = [
    pytest.param(lambda md: _loc(md, "a", 2, length=63), ["'a'", "length", "64"], id="length-short"),
    pytest.param(lambda md: _loc(md, "b", 2, length=129), ["'b'", "length"], id="length-long"),
    pytest.param(lambda md: _loc(md, "step", length=4), ["'step'", "length"], id="0-d-length"),
    pytest.param(lambda md: _loc(md, "a", 0, dtype="float32"), ["'a'", "dtype", "bfloat16"], id="dtype"),
    pytest.param(lambda md: _loc(md, "a", 0, dtype=None), ["'a'", "dtype"], id="dtype-none"),
    pytest.param(lambda md: _loc(md, "a", 0, shape=(2, 16)), ["'a'", "shape", "(4, 8)"], id="shape"),
    pytest.param(lambda md: _loc(md, "b", 2, shape=None), ["'b'", "shape"], id="shape-none"),
    pytest.param(lambda md: _drop(md, "b", 2), ["'b'", "no location"], id="chunk-without-location"),
    pytest.param(lambda md: _drop(md, "note"), ["'note'", "no location"], id="bytes-without-location"),
    pytest.param(lambda md: _loc(md, "b", 1, block_checksums=("crc32c:00000001",)), ["'b'", "1 block checksum(s)", "block_size 64"],
                 id="too-few-blocks"),
    pytest.param(lambda md: _loc(md, "a", 0, block_size=0, block_checksums=("crc32c:00000001",)),
                 ["'a'", "1 block checksum(s)", "block_size 0"], id="blocks-without-size"),
    pytest.param(lambda md: _loc(md, "a", 0, checksum="md5:00"), ["checksum", "md5"], id="unknown-algorithm"),
    pytest.param(lambda md: _chunk(md, "a", [0, 1], [4, 8]), ["'a'", "chunks[0]", "inside"], id="chunk-outside"),
    pytest.param(lambda md: _chunk(md, "a", [0], [4]), ["'a'", "chunks[0]", "2-d"], id="chunk-ndim"),
    pytest.param(lambda md: dataclasses.replace(md, storage_data=None), ["storage_data", "missing"], id="no-storage"),
    pytest.param(lambda md: _chunk(md, "a", [0, 0], [3, 8]), ["'a'", "chunks", "88 elements", "96"], id="hole"),
    pytest.param(lambda md: _chunk(md, "b", [4, 0], [4, 8]), ["'b'", "same offsets"], id="same-offsets"),
    pytest.param(lambda md: _extra_chunk(md, "step"), ["'step'", "2 chunks hold 2 elements"], id="0-d-twice"),
]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("mutate, words", BROKEN)
def test_refuses_what_a_load_cannot_trust(mutate, words, form):
    md = decoded(mutate(sample()), form)
    with pytest.raises(MetadataFormatError) as e:
        validate_metadata(md, source="s3://b/ck/.metadata")
    for w in ["s3://b/ck/.metadata", *words]:
        assert w in str(e.value), (w, str(e.value))


def test_empty_chunks_may_share_offsets():
    """A DTensor of 0 rows sharded over ranks: every rank's empty shard starts at (0, 0)."""
    empty = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([0, 8])) for _ in range(4)]
    item = TensorStorageMetadata(TensorProperties(torch.float32), torch.Size([0, 8]), empty)
    md = Metadata({"e": item}, storage_data={
        MetadataIndex("e", torch.Size([0, 0]), 0): ItemLocation("o", 0, 0, None, "float32", (0, 8))})
    for form in FORMS:
        validate_metadata(decoded(md, form))


@pytest.mark.parametrize("form", ["v1"])
def test_refuses_negative_offsets(form):
    md = decoded(_loc(sample(), "a", 0, offset=-1), form)
    with pytest.raises(MetadataFormatError, match="offset -1"):
        validate_metadata(md)


def test_v2_negative_offset_column_refused():
    md = decoded(_loc(sample(), "a", 0, offset=-1), "v2-lazy")  # stored as an i8 column
    with pytest.raises(MetadataFormatError, match=r"'a'.*offset -1 is not a non-negative int"):
        validate_metadata(md)
