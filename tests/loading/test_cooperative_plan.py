"""The cooperative read plan (pure): every needed byte has exactly one reader, every rank gets
every byte it needs, rounds stay within the window, owners are balanced over nodes and ranks."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from s3dcp.format.layout import ItemLocation
from s3dcp.loading.cooperative import PeerInfo, RankSchedule, _cut, _merge, cover, plan, schedule_plans

MiB = 1 << 20


def _check(needs, steps, nodes, window):
    schedules = plan(needs, steps, nodes, window_bytes=window)
    world = len(needs)
    assert [s.rank for s in schedules] == list(range(world))
    rounds = {s.rounds for s in schedules}
    assert len(rounds) == 1
    chunks = {c.cid: c for s in schedules for c in s.chunks}
    union = {key: _merge(r for need in needs for r in need.get(key, ())) for key in {k for n in needs for k in n}}
    assert schedules[0].unique_bytes == sum(hi - lo for rs in union.values() for lo, hi in rs)
    if rounds == {0}:  # nothing shared: no rank needs a byte another rank needs
        for key, rs in union.items():
            assert sum(hi - lo for lo, hi in rs) == sum(hi - lo for n in needs for lo, hi in _merge(n.get(key, ())))
        return schedules
    # chunks of one item are disjoint and together are exactly the union of the needs
    for key, rs in union.items():
        spans = sorted((c.start, c.end) for c in chunks.values() if c.key == key)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
        assert _merge(spans) == rs
        step = steps.get(key, 1)
        for c in chunks.values():  # cut only on the item's block boundaries
            if c.key == key and step > 1:
                assert c.start % step == 0 or (c.start, c.end) == (rs[0][0], c.end) or c.start in {lo for lo, _ in rs}
    for s in schedules:
        assert list(s.chunks) == sorted(s.chunks, key=lambda c: (c.round, c.cid))
        for c in s.chunks:
            assert s.rank == c.owner or s.rank in c.receivers
    for c in chunks.values():
        needers = {r for r, need in enumerate(needs)
                   if any(lo < c.end and c.start < hi for lo, hi in need.get(c.key, ()))}
        assert c.owner in needers and set(c.receivers) == needers - {c.owner}
        # a receiver needs the whole chunk (nothing is sent that is not used)
        for r in needers:
            got = sum(max(0, min(hi, c.end) - max(lo, c.start)) for lo, hi in _merge(needs[r][c.key]))
            assert got == c.length
    # the window: two rounds at a time, each at most half of it, in the bytes a rank owns or
    # receives (a lone chunk may exceed it)
    for s in schedules:
        for rnd in range(s.rounds):
            mine = [c for c in s.chunks if c.round == rnd]
            assert sum(c.length for c in mine) <= window // 2 or len(mine) == 1
    return schedules


ranges = st.lists(st.tuples(st.integers(0, 64), st.integers(1, 16)), max_size=4).map(
    lambda xs: [(a * 4096, (a + n) * 4096) for a, n in xs])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.dictionaries(st.sampled_from(["a", "b", "c"]), ranges, max_size=3), min_size=2, max_size=6),
       st.sampled_from([1, 4096, 0]), st.integers(1, 3))
def test_every_needed_byte_has_one_reader_and_reaches_every_rank_that_needs_it(needs, step, n_nodes):
    needs = [{(k, 0, 1 << 30): v for k, v in n.items()} for n in needs]
    steps = {key: step for n in needs for key in n}
    nodes = [f"n{r % n_nodes}" for r in range(len(needs))]
    _check(needs, steps, nodes, window=MiB)


def test_ddp_spreads_the_reads_evenly_over_nodes_and_ranks_within_the_window():
    keys = [(f"obj{i}", 0, 64 * MiB) for i in range(8)]
    needs = [{k: [(0, 64 * MiB)] for k in keys} for _ in range(8)]
    nodes = ["a"] * 4 + ["b"] * 4  # ranks 0-3 on one node, 4-7 on the other
    schedules = _check(needs, {k: 16 * MiB for k in keys}, nodes, window=64 * MiB)
    owned = [sum(c.length for c in s.chunks if c.owner == s.rank) for s in schedules]
    assert owned == [64 * MiB] * 8  # 512 MiB read once, an eighth per rank
    assert schedules[0].unique_bytes == 512 * MiB and schedules[0].rounds == 16
    for rnd in range(16):  # every round has work on both nodes
        owners = {c.owner for c in schedules[0].chunks if c.round == rnd}
        assert {nodes[o] for o in owners} == {"a", "b"}


def test_replicas_of_a_sharded_state_read_each_shard_once():
    # HSDP: 2 replica groups × 4 shards; shard s needed by ranks s and s + 4
    needs = [{(f"shard{r % 4}", 0, 32 * MiB): [(0, 32 * MiB)]} for r in range(8)]
    schedules = _check(needs, {}, ["a"] * 4 + ["b"] * 4, window=256 * MiB)
    owned = [sum(c.length for c in s.chunks if c.owner == s.rank) for s in schedules]
    assert sum(owned) == 128 * MiB and max(owned) <= 16 * MiB + 2 * MiB


def test_neighbours_go_to_one_owner_so_one_get_reads_them():
    # 16 items of 1 MiB side by side in one object, each needed by both ranks
    needs = [{("obj", i * MiB, MiB): [(0, MiB)] for i in range(16)} for _ in range(2)]
    schedules = _check(needs, {}, ["a", "b"], window=256 * MiB)
    owners = [c.owner for c in sorted(schedules[0].chunks, key=lambda c: c.key)]
    assert owners.count(0) == owners.count(1) == 8
    assert sum(1 for a, b in zip(owners, owners[1:]) if a != b) == 1  # two runs: two GETs


def test_nothing_shared_means_no_rounds():
    needs = [{("x", 0, 100): [(0, 50)]}, {("x", 0, 100): [(50, 100)]}]
    assert [s.rounds for s in _check(needs, {}, ["a", "b"], window=MiB)] == [0, 0]


def test_an_item_with_one_checksum_is_never_cut():
    needs = [{("x", 0, 40 * MiB): [(0, 40 * MiB)]}] * 3
    schedules = _check(needs, {("x", 0, 40 * MiB): 0}, ["a", "b", "c"], window=8 * MiB)
    assert [(c.start, c.end) for c in schedules[0].chunks] == [(0, 40 * MiB)]


def test_cut_respects_blocks():
    assert _cut(0, 100, 10, 35) == [(0, 30), (30, 60), (60, 90), (90, 100)]
    assert _cut(5, 100, 0, 10) == [(5, 100)]
    assert _cut(0, 10, 1, 4) == [(0, 4), (4, 8), (8, 10)]


def test_cover_is_what_the_plain_path_fetches():
    loc = ItemLocation("o", 0, 64 * MiB, "crc32c:00000000", "float32", (4096, 4096), 16 * MiB, ("x",) * 4)
    # rows 1000..1999: bytes 1000*16 KiB .. 2000*16 KiB, widened to the 16 MiB blocks
    assert cover(loc, (1000, 0), (1000, 4096), checked=True, gap_bytes=MiB, slot_bytes=8 * MiB,
                 itemsize=4) == [(0, 32 * MiB)]
    assert cover(loc, (1000, 0), (1000, 4096), checked=False, gap_bytes=MiB, slot_bytes=8 * MiB,
                 itemsize=4) == [(1000 * 16384, 2000 * 16384)]
    assert cover(loc, None, None, checked=True, gap_bytes=0, slot_bytes=MiB, itemsize=1) == [(0, 64 * MiB)]


def _plans(world: int, info) -> list[LoadPlan]:
    """Every rank loads the whole of tensor "w" (DDP), with ``info(rank)`` as its storage_data."""
    index = MetadataIndex("w", torch.Size([0]))
    item = ReadItem(LoadItemType.TENSOR, index, torch.Size([0]), index, torch.Size([0]), torch.Size([1024]))
    return [LoadPlan([item], storage_data=info(r)) for r in range(world)]


LOC = ItemLocation("o", 0, 4096, "crc32c:00000000", "float32", (1024,))


def _schedule(plans):
    return schedule_plans(plans, lambda item: LOC, verify=True, slot_bytes=MiB, gap_bytes=MiB, window_bytes=MiB)


def test_the_coordinator_plans_every_rank_a_schedule():
    out = _schedule(_plans(4, lambda r: PeerInfo(f"n{r // 2}", "")))
    assert all(isinstance(p.storage_data, RankSchedule) for p in out)
    assert [p.storage_data.rank for p in out] == [0, 1, 2, 3] and out[0].storage_data.unique_bytes == 4096
    assert [len(p.items) for p in out] == [1] * 4


def test_a_rank_without_a_backend_for_the_exchange_makes_every_rank_read_plainly():
    out = _schedule(_plans(4, lambda r: PeerInfo("n", "backend 'nccl' carries ... here" if r == 2 else "")))
    assert [p.storage_data for p in out] == [None] * 4


def test_a_planner_that_uses_storage_data_or_one_rank_means_plain_reads():
    assert [p.storage_data for p in _schedule(_plans(3, lambda r: {"planner": r}))] == [None] * 3
    assert [p.storage_data for p in _schedule(_plans(1, lambda r: PeerInfo("n", "")))] == [None]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 7), min_size=1, max_size=3), st.data(), st.booleans(), st.sampled_from([0, 64]))
def test_cover_takes_the_shortcuts_only_where_box_pieces_agree(shape, data, checked, block):
    from s3dcp.format.layout import box_pieces

    offsets = [data.draw(st.integers(0, n - 1)) for n in shape]
    lengths = [data.draw(st.integers(1, n - o)) for n, o in zip(shape, offsets)]
    length = 4
    for n in shape:
        length *= n
    loc = ItemLocation("o", 0, length, "crc32c:0", "float32", tuple(shape), block if block < length else 0)
    gap, slot = data.draw(st.sampled_from([0, 8])), 64
    step = (loc.block_size or loc.length) if checked else 0
    pieces = box_pieces(tuple(shape), 4, tuple(offsets), tuple(lengths), item_bytes=length, block_bytes=step,
                        gap_bytes=gap, max_bytes=slot, flat=True)
    assert cover(loc, offsets, lengths, checked=checked, gap_bytes=gap, slot_bytes=slot, itemsize=4) == \
        _merge((p.start, p.end) for p in pieces)
