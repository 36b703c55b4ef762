"""Pure layout logic: packing items into objects, sub-box byte ranges, read coalescing,
item checksums. Checked against brute force with hypothesis."""

import math
import os

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from s3dcp.format import integrity
from s3dcp.format.layout import (
    ObjectName,
    Segment,
    box_byte_range,
    box_pieces,
    coalesce,
    is_contiguous_box,
    object_name,
    pack,
    parse_object_name,
)


@given(st.lists(st.integers(0, 1000), max_size=40), st.integers(1, 2000))
def test_pack_keeps_order_and_respects_target(sizes, target):
    groups = pack(sizes, target)
    assert [i for g in groups for i in g] == list(range(len(sizes)))
    for g in groups:
        total = sum(sizes[i] for i in g)
        assert total <= target or len(g) == 1  # only a single oversized item may pass the target
    # greedy: a group could not have taken the next group's first item
    for g, nxt in zip(groups, groups[1:]):
        assert sum(sizes[i] for i in g) + sizes[nxt[0]] > target


def test_object_names_carry_rank_and_token():
    assert object_name(3, 1, "abc123") == "__3_1.abc123.distcp"
    assert parse_object_name("__3_1.abc123.distcp") == ObjectName(3, 1, "abc123")
    assert parse_object_name(".metadata") is None and parse_object_name("__x_1.ab.distcp") is None


def test_spread_names_round_robin_over_prefixes_and_parse_back():
    names = [object_name(rank, index, "f00d", spread=4) for rank in range(4) for index in range(2)]
    assert names[:3] == ["00-__0_0.f00d.distcp", "01-__0_1.f00d.distcp", "01-__1_0.f00d.distcp"]
    assert {n[:2] for n in names} == {"00", "01", "02", "03"}
    assert [parse_object_name(n) for n in names] == [ObjectName(r, i, "f00d") for r in range(4) for i in range(2)]


@st.composite
def boxes(draw):
    dims = draw(st.integers(0, 4))
    shape = [draw(st.integers(1, 5)) for _ in range(dims)]
    offsets = [draw(st.integers(0, n - 1)) for n in shape]
    lengths = [draw(st.integers(1, n - o)) for n, o in zip(shape, offsets)]
    return shape, offsets, lengths


@given(boxes(), st.sampled_from([1, 2, 4, 8]))
def test_box_byte_range_is_the_tightest_cover(box, itemsize):
    shape, offsets, lengths = box
    flat = torch.arange(math.prod(shape)).reshape(shape)
    sel = flat[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))].reshape(-1)
    lo, hi = int(sel.min()), int(sel.max())
    start, end = box_byte_range(shape, itemsize, offsets, lengths)
    assert start == lo * itemsize and end == (hi + 1) * itemsize
    contiguous = (hi - lo + 1) == sel.numel()
    assert is_contiguous_box(shape, offsets, lengths) == contiguous


@given(
    st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 500)), max_size=30),
    st.integers(0, 300),
    st.integers(1, 3000),
)
def test_coalesce_covers_every_segment_within_limits(raw, gap, max_bytes):
    segments = [Segment(o, n, i) for i, (o, n) in enumerate(raw)]
    runs = coalesce(segments, gap, max_bytes)
    assert sorted(s.tag for r in runs for s in r) == list(range(len(segments)))
    for run in runs:
        start, end = run[0].offset, max(s.end for s in run)
        assert all(start <= s.offset and s.end <= end for s in run)
        assert end - start <= max_bytes or len(run) == 1
        ordered = sorted(run, key=lambda s: s.offset)
        reach = ordered[0].end
        for s in ordered[1:]:
            assert s.offset - reach <= gap  # no hole bigger than the gap inside a run
            reach = max(reach, s.end)


def test_coalesce_merges_neighbours_and_splits_far_ones():
    runs = coalesce([Segment(0, 10), Segment(12, 8), Segment(5000, 1)], gap_bytes=4, max_bytes=1 << 20)
    assert [[(s.offset, s.length) for s in r] for r in runs] == [[(0, 10), (12, 8)], [(5000, 1)]]


@settings(max_examples=30)
@given(st.integers(0, 200_000), st.sampled_from(["crc32c", "crc64nvme"]))
def test_block_checksums_combine_to_the_whole(n, algorithm):
    data = memoryview(os.urandom(n))
    sums = integrity.compute(algorithm, data, block_size=16_384)
    assert sums.whole == integrity.checksum(algorithm, data)
    if n > 16_384:
        assert len(sums.blocks) == -(-n // 16_384)
        assert sums.blocks[-1] == integrity.checksum(algorithm, data[(len(sums.blocks) - 1) * 16_384:])
    else:
        assert sums.blocks == ()
    assert integrity.compute(None, data) == (None, ())


_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@settings(max_examples=300, deadline=None)
@given(boxes(), st.sampled_from([1, 2, 4, 8]), st.sampled_from([0, 8, 64, "item"]), st.integers(0, 64),
       st.integers(1, 600), st.booleans())
def test_box_pieces_fetch_the_box_and_copy_every_element_once(box, itemsize, block, gap, max_bytes, flat):
    """Fetch each piece's bytes of a random stored item, copy them where the piece says: the
    destination equals the box, every element written once; pieces stay in the item, on block
    boundaries, within the size limit; without blocks a piece starts and ends on wanted bytes
    and skips no hole it could bridge... and bridges none wider than the gap."""
    shape, offsets, lengths = box
    item_bytes = math.prod(shape) * itemsize
    block_bytes = item_bytes if block == "item" else block
    dtype = _DTYPES[itemsize]
    stored = torch.randint(0, 100, shape, dtype=dtype)
    raw = stored.reshape(-1).view(torch.uint8)
    want = stored[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))]
    dest = torch.zeros(tuple(lengths), dtype=dtype)
    hits = torch.zeros(tuple(lengths), dtype=torch.int32)
    pieces = box_pieces(shape, itemsize, offsets, lengths, item_bytes=item_bytes, block_bytes=block_bytes,
                        gap_bytes=gap, max_bytes=max_bytes, flat=flat)
    limit = max(max_bytes, 2 * max(block_bytes, 1), itemsize)
    limit = -(-limit // max(block_bytes, 1)) * max(block_bytes, 1)
    needed = torch.zeros(item_bytes, dtype=torch.bool)
    idx = torch.arange(math.prod(shape)).reshape(shape)[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))]
    for e in idx.reshape(-1).tolist():
        needed[e * itemsize:(e + 1) * itemsize] = True
    for p in pieces:
        assert 0 <= p.start < p.end <= item_bytes
        assert p.end - p.start <= limit
        if block_bytes:
            assert p.start % block_bytes == 0 and (p.end % block_bytes == 0 or p.end == item_bytes)
        else:
            assert needed[p.start] and needed[p.end - 1]  # tight
            holes = (~needed[p.start:p.end]).int().tolist()
            run = longest = 0
            for h in holes:
                run = run + 1 if h else 0
                longest = max(longest, run)
            assert longest <= gap
        fetched = raw[p.start:p.end].clone()  # its own storage: an offset past it raises
        src = fetched[:fetched.numel() // itemsize * itemsize].view(dtype).as_strided(p.sizes, p.strides, p.src_offset)
        target, count = (dest.view(-1), hits.view(-1)) if p.flat else (dest, hits)
        for i in p.index:
            target, count = target[i], count[i]
        target.narrow(0, p.first, p.count).copy_(src)
        count.narrow(0, p.first, p.count).add_(1)
    assert torch.equal(dest, want)
    assert bool((hits == 1).all())


def test_box_pieces_of_a_column_range_skip_the_other_columns():
    """A Shard(1)-style read of half the columns of rows larger than two blocks fetches about
    half the item; with one block per row it cannot skip anything; a contiguous box is cut on
    block boundaries without overlap."""
    mib = 1 << 20
    shape, half = (4, 8 * mib), (4, 4 * mib)  # fp32 rows of 32 MiB, blocks of 16 MiB
    for col in (0, 4 * mib):
        pieces = box_pieces(shape, 4, (0, col), half, item_bytes=128 * mib, block_bytes=16 * mib,
                            gap_bytes=mib, max_bytes=32 * mib)
        assert sum(p.end - p.start for p in pieces) == 64 * mib
    rows16 = box_pieces((8, 4 * mib), 4, (0, 0), (8, 2 * mib), item_bytes=128 * mib, block_bytes=16 * mib,
                        gap_bytes=mib, max_bytes=32 * mib)
    assert sum(p.end - p.start for p in rows16) == 128 * mib  # every block holds wanted bytes
    flat = box_pieces((64, mib), 4, (8, 0), (40, mib), item_bytes=256 * mib, block_bytes=16 * mib,
                      gap_bytes=mib, max_bytes=32 * mib)
    assert [(p.start, p.end) for p in flat] == [(s, s + 32 * mib) for s in range(32 * mib, 192 * mib, 32 * mib)]
    assert all(p.flat for p in flat)


def test_the_head_of_a_metadata_object_tells_s3dcp_metadata_from_another_writers():
    """``s3dcp ls`` reads only these bytes of each .metadata to mark a foreign one."""
    import pickle

    from torch.distributed.checkpoint.metadata import Metadata

    from s3dcp.format.layout import METADATA_HEAD_BYTES, is_s3dcp_metadata_head
    from s3dcp.format.metadata import encode_metadata

    md = Metadata(state_dict_metadata={})
    for version in (1, 2):
        assert is_s3dcp_metadata_head(encode_metadata(md, version=version)[:METADATA_HEAD_BYTES]), version
    assert not is_s3dcp_metadata_head(pickle.dumps(md)[:METADATA_HEAD_BYTES])  # DCP's own .metadata
    assert not is_s3dcp_metadata_head(b"")
    assert not is_s3dcp_metadata_head(b"\x89PNG\r\n\x1a\n")
