"""Loads of hand-edited metadata: a real checkpoint's ``.metadata`` with one field changed and
its trailer CRC recomputed (what anyone with write access to the bucket can make), put back
through the client. Each load must fail with an s3dcp error naming the field — never succeed
with the destination left as it was, never a CRT error, never a huge allocation."""

from __future__ import annotations

import pytest
import torch

import s3dcp
from s3dcp import S3StorageWriter
from s3dcp.errors import IntegrityError, MetadataFormatError
from s3dcp.format.layout import MAX_BYTES_ITEM_BYTES, METADATA_NAME
from s3dcp.s3.client import S3Client

from metadata_edit import column, edit_column, header
from rss import peak_rss_sampler

import torch.distributed.checkpoint as dcp


def _saved(uri: str, cfg, state: dict) -> tuple[S3Client, str, bytes]:
    dcp.save(state, storage_writer=S3StorageWriter(uri, config=cfg), no_dist=True)
    client = S3Client(cfg)
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    key = f"{prefix}/{METADATA_NAME}"
    return client, key, client.get(bucket, key).result()


def _row(raw: bytes, fqn: str) -> int:
    return column(raw, "sd.fqn").index(header(raw)["fqns"].index(fqn))


def _put_edited(uri, cfg, state, fqn, name, value) -> None:
    """Save ``state``, then set column ``name`` of ``fqn``'s storage row to ``value(old)``."""
    client, key, raw = _saved(uri, cfg, state)
    row = _row(raw, fqn)
    edited = edit_column(raw, name, lambda vs: [value(v) if i == row else v for i, v in enumerate(vs)])
    client.put(uri.removeprefix("s3://").partition("/")[0], key, edited).result()


def _state() -> dict:
    return {"w": torch.arange(16, dtype=torch.float32), "b": torch.full((4,), 7.0), "step": 11}


def _blank() -> dict:
    return {"w": torch.full((16,), -1.0), "b": torch.zeros(4), "step": 0}


@pytest.mark.parametrize("length", [0, -64, 63, 65])
def test_a_tensor_item_whose_length_is_not_its_chunks_bytes_is_refused(uri, s3_config, length):
    _put_edited(uri, s3_config, _state(), "w", "sd.length", lambda old: length)
    dest = _blank()
    with pytest.raises(MetadataFormatError, match=rf"'w'.*length {length} is not"):
        s3dcp.load(dest, uri, config=s3_config, verify=True)
    assert torch.equal(dest["w"], torch.full((16,), -1.0))


def test_a_negative_offset_is_a_format_error_not_a_crt_error(uri, s3_config):
    _put_edited(uri, s3_config, _state(), "w", "sd.offset", lambda old: -8)
    with pytest.raises(MetadataFormatError, match=r"'w'.*offset -8 is not a non-negative int"):
        s3dcp.load(_blank(), uri, config=s3_config)


@pytest.mark.parametrize("start", [1_000, 1_000_000], ids=["short-read", "range-past-the-end"])
def test_an_item_past_the_end_of_its_object_is_named(uri, s3_config, start):
    """A GET past the end is the object's or the metadata's fault (no one can tell which): an
    IntegrityError naming the item, never a CRT or HTTP error about a range."""
    _put_edited(uri, s3_config, {"w": torch.arange(16, dtype=torch.float32)}, "w", "sd.offset", lambda old: start)
    with pytest.raises(IntegrityError, match=r"'w'.*past the end of"):
        s3dcp.load({"w": torch.zeros(16)}, uri, config=s3_config)


def test_a_bytes_item_over_the_bound_is_refused_before_any_allocation(uri, s3_config):
    _put_edited(uri, s3_config, _state(), "step", "sd.length", lambda old: 2**40)
    with pytest.raises(MetadataFormatError, match=r"'step'.*length 1099511627776 of a non-tensor item is over"):
        s3dcp.load(_blank(), uri, config=s3_config)


def test_a_bytes_item_longer_than_its_object_is_refused_before_its_memory_is_filled(uri, s3_config):
    length = 3 << 30  # under the bound, so only the object's size can tell
    assert length < MAX_BYTES_ITEM_BYTES
    _put_edited(uri, s3_config, _state(), "step", "sd.length", lambda old: length)
    with peak_rss_sampler() as peak:
        with pytest.raises(MetadataFormatError, match=r"'step'.*past the end of"):
            s3dcp.load(_blank(), uri, config=s3_config)
    assert peak.extra < length // 4


def test_block_checksums_that_do_not_cover_the_item_are_refused(uri, s3_config):
    state = {"w": torch.arange(5 << 20, dtype=torch.float32)}  # 20 MiB: two 16 MiB checksum blocks
    _put_edited(uri, s3_config, state, "w", "sd.block_size", lambda old: old * 2)
    with pytest.raises(MetadataFormatError, match=r"'w'.*2 block checksum\(s\) for block_size 33554432"):
        s3dcp.load({"w": torch.zeros(5 << 20)}, uri, config=s3_config)


def test_an_untouched_checkpoint_still_loads(uri, s3_config):
    _saved(uri, s3_config, _state())
    dest = _blank()
    s3dcp.load(dest, uri, config=s3_config)
    assert torch.equal(dest["w"], torch.arange(16, dtype=torch.float32)) and dest["step"] == 11


def test_chunks_that_overlap_beside_a_hole_are_refused(uri, s3_config):
    """'w' of 4 elements in chunks 0..2 and 1..3: their volumes add up to 4, but element 1 is in
    both and element 3 in none. A load used to succeed, leaving w[3] as the destination held it
    (export refused it); the reader now applies the export's tiling check (issue 33, row 7)."""
    from handmade import put_checkpoint, tensor_meta

    w = torch.arange(4, dtype=torch.float32)
    put_checkpoint(uri, s3_config, {"w": tensor_meta(torch.float32, [4], [([0], [2]), ([1], [2])])},
                   [("w", [0], w[0:2]), ("w", [1], w[1:3])])
    for cooperative in (False, True):  # one process: the cooperative reader falls back, same checks
        dest = {"w": torch.full((4,), -1.0)}
        with pytest.raises(MetadataFormatError, match=r"'w'.*chunk at \(1,\) overlaps another chunk"):
            s3dcp.load(dest, uri, config=s3_config, cooperative=cooperative)
        assert torch.equal(dest["w"], torch.full((4,), -1.0))
