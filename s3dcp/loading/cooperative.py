"""Cooperative reads, the plan: each distinct stored byte range of a job goes to one reading rank.

Pure logic, no I/O. The coordinator sees every rank's LoadPlan; from each ReadItem and its
stored location it knows which bytes of which stored item that rank fetches (:func:`cover`:
the box's bytes, widened to the item's checksum blocks so the reader can verify them, exactly
as the plain read path widens them). :func:`plan` then

    every rank's covers ──sweep per stored item──► elementary ranges, each with the set of ranks
      that need it; neighbours with the same set merged, cut on block boundaries (a chunk is
      verified alone) into chunks ≤ window / world, and into as many as ranks need the range
    chunks in object order ──► rounds: no rank owns or receives more than window_bytes / 2 in
      one round; two rounds are in memory at a time (one exchanged while the next is read),
      so the window bounds the exchange's memory beyond the state itself
    each chunk of a round ──► one owner among the ranks that need it: the previous chunk's
      owner while within its fair share of the round (neighbours in one GET), else the least
      loaded node (its NIC), then the least loaded rank there, by bytes; a chunk one rank
      needs stays with it

and gives each rank its :class:`RankSchedule`: the chunks it owns or receives, round by round.
:mod:`s3dcp.loading.exchange` runs it. A job where no byte is needed by two ranks gets
schedules with no rounds: every rank reads its own bytes, as without cooperation.
"""

from __future__ import annotations

import hashlib
import os
import socket
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Mapping, NamedTuple, Sequence

from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from ..format import layout
from ..format.layout import ItemLocation
from ..format.metadata import str_to_dtype

__all__ = ["PeerInfo", "Chunk", "RankSchedule", "ItemKey", "item_key", "cover", "plan", "schedule_plans",
           "node_name", "DEFAULT_WINDOW_BYTES"]

DEFAULT_WINDOW_BYTES = 256 << 20
_MIN_CHUNK_BYTES = 1 << 20

ItemKey = tuple  # (object name, offset, length, checksums' digest): one stored item, however many indices name it


def item_key(loc: ItemLocation) -> ItemKey:
    """One stored item: its byte range and what it must hold. Two items naming one range with
    other checksums are two keys, read and verified each against its own checksums (one key
    would be verified against one item's only, and the other would get its bytes unchecked)."""
    sums = "" if loc.checksum is None and not loc.block_checksums else \
        hashlib.blake2b("|".join((str(loc.checksum), str(loc.block_size), *loc.block_checksums)).encode(),
                        digest_size=8).hexdigest()
    return (loc.object_name, loc.offset, loc.length, sums)


def node_name() -> str:
    """This process's node: torchrun's ``GROUP_RANK`` (the node's rank in the job) on top of the
    host name, so two simulated nodes on one host are told apart as real ones are."""
    return f"{socket.gethostname()}/{os.environ.get('GROUP_RANK', '')}"


@dataclass(frozen=True)
class PeerInfo:
    """What each rank tells the coordinator through its local plan's ``storage_data``."""

    node: str
    exchange: str  # "" when this rank's process group can carry the exchange, else why not


class Chunk(NamedTuple):
    """Bytes ``[start, end)`` of one stored item (``key``), read from S3 by ``owner`` and sent,
    verified, to each of ``receivers`` in round ``round``. (A named tuple: a DDP restore of many
    small tensors scatters thousands of them to every rank, and tuples pickle fast.)"""

    cid: int
    key: ItemKey
    start: int
    end: int
    owner: int
    receivers: tuple[int, ...]
    round: int

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class RankSchedule:
    """One rank's part of a cooperative load, in its LoadPlan's ``storage_data``.

    ``chunks``: the chunks this rank owns or receives, ordered by (round, cid) — the same
    order on both ends of every message. ``rounds == 0``: nothing is shared; the rank reads
    its own bytes. ``unique_bytes``: the distinct stored bytes the whole job needs.
    ``load_id``: the same on every rank, names the load in the group's store (liveness.py)."""

    rank: int
    rounds: int
    chunks: tuple[Chunk, ...]
    unique_bytes: int
    window_bytes: int
    load_id: str = ""


def cover(loc: ItemLocation, offsets: Sequence[int] | None, lengths: Sequence[int] | None, *, checked: bool,
          gap_bytes: int, slot_bytes: int, itemsize: int) -> list[tuple[int, int]]:
    """The item-relative byte ranges a rank fetches for the box ``offsets``/``lengths`` of the
    stored item ``loc`` (sorted, disjoint): what the plain read path fetches for it, whatever
    the destination (whole items, runs of a box, or box pieces widened to checksum blocks when
    ``checked``). A non-tensor item (``offsets is None``) is all of its bytes."""
    if offsets is None or loc.shape is None:
        return [(0, loc.length)] if loc.length else []
    shape = tuple(loc.shape)
    if tuple(lengths) == shape and not any(offsets):  # the whole item (every DDP read)
        return [(0, loc.length)] if loc.length else []
    if not checked and layout.is_contiguous_box(shape, offsets, lengths):  # one run, nothing to widen
        lo, hi = layout.box_byte_range(shape, itemsize, offsets, lengths)
        return [(lo, hi)] if hi > lo else []
    block = (loc.block_size or loc.length) if checked else 0
    pieces = layout.box_pieces(tuple(loc.shape), itemsize, tuple(offsets), tuple(lengths), item_bytes=loc.length,
                               block_bytes=block, gap_bytes=gap_bytes, max_bytes=slot_bytes, flat=True)
    return _merge((p.start, p.end) for p in pieces)


def _merge(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if hi <= lo:
            continue
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


def plan(needs: Sequence[Mapping[ItemKey, list[tuple[int, int]]]], steps: Mapping[ItemKey, int],
         nodes: Sequence[str], *, window_bytes: int, load_id: str = "") -> list[RankSchedule]:
    """Every rank's schedule. ``needs[r]``: rank r's byte ranges per stored item (from
    :func:`cover`); ``steps[key]``: where the item may be cut (its checksum block size, 1 when
    unverified, 0 when it has one checksum and cannot be cut); ``nodes[r]``: rank r's node."""
    world = len(needs)
    chunk_bytes = max(_MIN_CHUNK_BYTES, window_bytes // max(1, world))
    pieces: list[tuple[ItemKey, int, int, tuple[int, ...]]] = []  # (key, start, end, ranks needing it)
    for key in sorted({k for need in needs for k in need}):
        for lo, hi, ranks in _sweep([(r, need.get(key, ())) for r, need in enumerate(needs)]):
            # a range k ranks need is cut in k at least, so each of them can read a part
            size = min(chunk_bytes, max(_MIN_CHUNK_BYTES, -(-(hi - lo) // len(ranks))))
            pieces.extend((key, a, b, ranks) for a, b in _cut(lo, hi, steps.get(key, 1), size))
    unique = sum(hi - lo for _, lo, hi, _ in pieces)
    if not any(len(ranks) > 1 for *_, ranks in pieces):
        return [RankSchedule(r, 0, (), unique, window_bytes, load_id) for r in range(world)]

    # Rounds: in object order, a new one when a rank taking part would pass half the window
    # (the next round is read while one is exchanged: two in memory at a time).
    rounds: list[int] = []
    used = [0] * world
    rnd = 0
    for _, lo, hi, ranks in pieces:
        if any(used[r] and used[r] + hi - lo > window_bytes // 2 for r in ranks):
            rnd += 1
            used = [0] * world
        for r in ranks:
            used[r] += hi - lo
        rounds.append(rnd)

    # Owners: chunks one rank needs are that rank's. The shared ones of a round go, in object
    # order, to the owner of the chunk just before them in the object while it stays within
    # its fair share of the round (so one GET reads a run of neighbours), else to the least
    # loaded node among their readers (by bytes, over the whole load), then to its least
    # loaded rank.
    rank_load = [0] * world
    node_load: dict[str, int] = {}
    chunks: list[Chunk] = []
    first = 0
    while first < len(pieces):
        last_i = first
        while last_i + 1 < len(pieces) and rounds[last_i + 1] == rounds[first]:
            last_i += 1
        share = [0.0] * world  # each shared chunk of the round split evenly among its readers
        for _, lo, hi, ranks in pieces[first:last_i + 1]:
            for r in ranks:
                share[r] += (hi - lo) / len(ranks)
        in_round = [0] * world
        last: dict[str, tuple[int, int]] = {}  # object -> (end of its last chunk, that chunk's owner)
        for i in range(first, last_i + 1):
            key, lo, hi, ranks = pieces[i]
            size = hi - lo
            end, prev = last.get(key[0], (-1, -1))
            if len(ranks) == 1:
                owner = ranks[0]
            elif end == key[1] + lo and prev in ranks and in_round[prev] + size / 2 <= share[prev]:
                owner = prev
            else:
                owner = min(ranks, key=lambda r: (node_load.get(nodes[r], 0), rank_load[r], r))
            rank_load[owner] += size
            in_round[owner] += size
            node_load[nodes[owner]] = node_load.get(nodes[owner], 0) + size
            last[key[0]] = (key[1] + hi, owner)
            chunks.append(Chunk(i, key, lo, hi, owner, tuple(r for r in ranks if r != owner), rounds[i]))
        first = last_i + 1

    mine: list[list[Chunk]] = [[] for _ in range(world)]
    for c in chunks:
        mine[c.owner].append(c)
        for r in c.receivers:
            mine[r].append(c)
    return [RankSchedule(r, rnd + 1, tuple(mine[r]), unique, window_bytes, load_id) for r in range(world)]


def schedule_plans(plans: list[LoadPlan], location: Callable[[ReadItem], ItemLocation], *, verify: bool,
                   slot_bytes: int, gap_bytes: int, window_bytes: int) -> list[LoadPlan]:
    """The coordinator's step: every rank's plan with its :class:`RankSchedule` in
    ``storage_data``; or with ``storage_data=None`` (plain reads, no exchange at all) when there
    is one rank or a rank cannot take part (its :class:`PeerInfo` is missing or says why)."""
    infos = [p.storage_data for p in plans]
    if len(plans) < 2 or not all(isinstance(i, PeerInfo) and not i.exchange for i in infos):
        return [replace(p, storage_data=None) for p in plans]
    needs: list[dict[ItemKey, list[tuple[int, int]]]] = []
    steps: dict[ItemKey, int] = {}
    for p in plans:
        need: dict[ItemKey, list[tuple[int, int]]] = {}
        for item in p.items:
            loc = location(item)
            key = item_key(loc)
            checked = verify and loc.checksum is not None
            if item.type == LoadItemType.BYTE_IO:
                ranges = cover(loc, None, None, checked=checked, gap_bytes=gap_bytes, slot_bytes=slot_bytes,
                               itemsize=1)
            else:
                ranges = cover(loc, item.storage_offsets, item.lengths, checked=checked, gap_bytes=gap_bytes,
                               slot_bytes=slot_bytes, itemsize=str_to_dtype(loc.dtype).itemsize)
            need.setdefault(key, []).extend(ranges)
            steps[key] = (loc.block_size or 0) if checked else 1
        needs.append(need)
    schedules = plan(needs, steps, [i.node for i in infos], window_bytes=window_bytes, load_id=os.urandom(8).hex())
    return [replace(p, storage_data=s) for p, s in zip(plans, schedules)]


def _sweep(ranges: list[tuple[int, Iterable[tuple[int, int]]]]) -> list[tuple[int, int, tuple[int, ...]]]:
    """Cut the union of every rank's ranges (of one item) into maximal ranges needed by one set
    of ranks: [(start, end, ranks)], in order."""
    events: list[tuple[int, int, int]] = []
    for rank, rs in ranges:
        for lo, hi in _merge(rs):
            events.append((lo, 1, rank))
            events.append((hi, -1, rank))
    events.sort()
    out: list[tuple[int, int, tuple[int, ...]]] = []
    active: set[int] = set()
    pos = None
    i = 0
    while i < len(events):
        at = events[i][0]
        if pos is not None and active and at > pos:
            ranks = tuple(sorted(active))
            if out and out[-1][1] == pos and out[-1][2] == ranks:
                out[-1] = (out[-1][0], at, ranks)
            else:
                out.append((pos, at, ranks))
        while i < len(events) and events[i][0] == at:
            _, kind, rank = events[i]
            if kind > 0:
                active.add(rank)
            else:
                active.discard(rank)
            i += 1
        pos = at
    return out


def _cut(lo: int, hi: int, step: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` in chunks of about ``chunk_bytes``, cut only at multiples of ``step`` from
    the item's start (``step`` 0: not at all)."""
    if step <= 0 or hi - lo <= chunk_bytes:
        return [(lo, hi)]
    size = max(step, chunk_bytes // step * step)
    cuts = list(range(-(-lo // step) * step, hi, size)) if step > 1 else list(range(lo, hi, size))
    bounds = sorted({lo, *[c for c in cuts if lo < c < hi], hi})
    return list(zip(bounds, bounds[1:]))
