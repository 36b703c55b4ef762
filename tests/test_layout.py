"""Pure layout logic: packing items into objects, sub-box byte ranges, read coalescing,
item checksums. Checked against brute force with hypothesis."""

import math
import os

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from s3dcp import integrity
from s3dcp.layout import (
    ObjectName,
    Segment,
    box_byte_range,
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
