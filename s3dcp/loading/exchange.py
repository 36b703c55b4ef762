"""Cooperative reads, the run: a rank's :class:`~s3dcp.loading.cooperative.RankSchedule`, round by round.

    this rank's ReadItems ──the plain path's plan (ItemReads.plan, s3dcp.loading.items)──► targets: the byte range
      of a direct read (lands in the destination) or of one bounce piece (copied out of a buffer)
    per round:
      owned chunks ──ranged GETs (neighbours coalesced)──► landing buffers, each chunk verified
      all ranks: every rank's failure flag (all_reduce) ── any set: every rank stops and raises
      the next round's GETs issued, to run while this one is exchanged:
      isend each owned chunk to its receivers, irecv each chunk this rank needs (one batch);
        a chunk every rank needs is broadcast instead
      each chunk ──copied into the targets it overlaps──► a target complete: verified bytes
        committed as the plain path commits them (no second checksum: the reader verified)
    all ranks: flags and figures (all_gather) ── the slowest rank's seconds, bytes from S3/peers

A chunk that lies inside one direct target lands in the destination itself (a DDP restore
needs no buffer at all); any other lands in a buffer of its own, freed at the end of its round.
Rounds are half the window, and two are in memory at a time (one exchanged, the next read), so
a rank holds at most the window beyond its state (plus the bounce pieces being filled). Every
local error is held until the next collective, so all ranks leave at the same round: one
rank's failure is an error on every rank, never a hang.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ConfigError, MetadataFormatError, PeerReadError
from ..format import layout
from ..format.layout import Segment
from ..format.tensors import byte_view
from ..s3.request import abort_and_wait
from ..uri import object_key
from . import bounce
from .cooperative import Chunk, PeerInfo, RankSchedule, item_key, node_name, schedule_plans

__all__ = ["LoadStats", "exchange_device", "check_window", "with_peer_info", "global_plans", "read", "run"]


@dataclass(frozen=True)
class LoadStats:
    """Figures of one load, on every rank (``S3StorageReader.last_stats``).

    ``unique_bytes``: distinct stored bytes the job needed; ``s3_bytes``/``peer_bytes``: what
    this rank read from S3 / received from other ranks; ``job_s3_bytes``/``job_peer_bytes``:
    the same summed over the ranks; ``seconds``: this rank's read; ``slowest_rank_s``: the
    slowest rank's. Without cooperation (``mode="plain"``) there is no exchange of figures:
    the job fields are this rank's own. ``rounds``: exchange rounds (0: nothing was shared)."""

    mode: str
    unique_bytes: int
    s3_bytes: int
    peer_bytes: int
    job_s3_bytes: int
    job_peer_bytes: int
    seconds: float
    slowest_rank_s: float
    rounds: int = 0
    ranks: int = 1
    get_s: float = 0.0  # this rank's seconds in its GETs (cooperative: the rounds' GET phases)
    exchange_s: float = 0.0  # this rank's seconds sending and receiving (waiting for peers included)


def exchange_device(group) -> tuple[torch.device | None, str]:
    """Where the exchange's tensors live for ``group``'s backend: (CPU for gloo; the current
    CUDA device for NCCL alone), or (None, why not)."""
    try:
        backend = str(dist.get_backend(group)).lower()
    except Exception as e:  # noqa: BLE001 - not a usable group: no exchange
        return None, f"no process group ({e})"
    if "gloo" in backend or backend in ("mpi", "ucc"):
        return torch.device("cpu"), ""
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device()), ""
    return None, f"backend {backend!r} carries neither CPU (gloo) nor CUDA (nccl) tensors here"


def check_window(window_bytes: int) -> int:
    if not (isinstance(window_bytes, int) and window_bytes >= 1 << 20):
        raise ConfigError(f"exchange_window_bytes={window_bytes!r} must be an int >= 1 MiB")
    return window_bytes


def global_plans(reader, plans: list) -> list:
    """The coordinator's step: every rank's schedule, planned with the reader's settings."""
    slot_bytes, _ = reader._window_shape()
    return schedule_plans(plans, reader.items.location, verify=reader.verify, slot_bytes=slot_bytes,
                          gap_bytes=reader.config.coalesce_gap_bytes, window_bytes=reader.exchange_window_bytes)


def read(reader, plan, planner) -> LoadStats:
    """``read_data``'s work on every rank: the schedule the coordinator put in the plan, or a
    plain read (no cooperation planned) timed alone."""
    if isinstance(plan.storage_data, RankSchedule):
        device, _ = exchange_device(reader.process_group)
        return run(reader, plan, planner, plan.storage_data, reader.process_group, device)
    start = time.perf_counter()
    fetched = reader._read_plain(plan, planner)
    seconds = time.perf_counter() - start
    return LoadStats("plain", fetched, fetched, 0, fetched, 0, seconds, seconds)


def with_peer_info(plan, group):
    """Every rank's step before the coordinator plans: this rank's node, and whether its group
    can carry the exchange, in the local plan's ``storage_data`` (left alone when a planner
    already uses it, or without torch.distributed: the load is then plain)."""
    if plan.storage_data is not None or not (dist.is_available() and dist.is_initialized()):
        return plan
    _, why = exchange_device(group)
    return replace(plan, storage_data=PeerInfo(node_name(), why))


class _Target:
    """One range this rank fetches: a direct read (``piece is None``, lands in ``buf``, the
    destination's bytes) or one bounce piece (``buf`` made when its first bytes arrive)."""

    __slots__ = ("read", "piece", "start", "end", "left", "buf")

    def __init__(self, read, piece, start: int, end: int, buf: torch.Tensor | None) -> None:
        self.read, self.piece, self.start, self.end, self.buf = read, piece, start, end, buf
        self.left = end - start


def run(reader, plan, planner, schedule: RankSchedule, group, device: torch.device) -> LoadStats:
    """Carry out ``schedule`` for this rank (see the module docstring); raise this rank's error,
    or :class:`PeerReadError` when only others failed. ``reader`` is the S3StorageReader."""
    start_s = time.perf_counter()
    me = dist.get_rank(group)
    world = dist.get_world_size(group)
    error: BaseException | None = None
    broken = False  # the group failed under us: no more collectives
    s3_bytes = peer_bytes = 0
    get_s = exchange_s = 0.0
    failed: list[int] = []
    copier = bounce.DeviceCopier()
    by_round: list[list[Chunk]] = [[] for _ in range(schedule.rounds)]
    targets: dict[Any, list[_Target]] = {}
    reads: dict[Any, Any] = {}
    try:
        if me != schedule.rank:
            raise RuntimeError(f"cooperative load: this is rank {me} of the reader's process group but got rank "
                               f"{schedule.rank}'s plan; pass the process group given to dcp.load to the reader")
        if schedule.rounds == 0:  # nothing shared: this rank's own bytes, as a plain load reads them
            s3_bytes = reader._read_plain(plan, planner)
        else:
            targets, reads = _targets(reader, plan, planner)
            _check_covered(targets, schedule.chunks, reader)
            for c in schedule.chunks:
                by_round[c.round].append(c)
    except BaseException as e:  # noqa: BLE001 - raised after the others hear of it
        error = e

    ahead = None  # the next round's GETs, issued while this round is exchanged
    try:
        if error is None and schedule.rounds:
            ahead = _start_gets(reader, by_round[0], me, targets)
        for k, chunks in enumerate(by_round):
            current, ahead = ahead, None
            if current is not None and error is not None:  # failed since they were issued
                abort_and_wait(current[1])
            elif current is not None:
                t = time.perf_counter()
                try:
                    s3_bytes += _finish_gets(reader, current, reads)
                    # every local step of the exchange (allocations, the messages) before the flags
                    posts = _posts(chunks, _wires(chunks, current[0], me, device), me, group)
                except BaseException as e:  # noqa: BLE001
                    error = e
                get_s += time.perf_counter() - t
            t = time.perf_counter()
            flags = torch.zeros(world, dtype=torch.int32, device=device)
            flags[me] = error is not None
            try:
                dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
            except BaseException as e:  # noqa: BLE001 - a peer is gone
                error, broken = error or e, True
                break
            failed = [r for r, f in enumerate(flags.tolist()) if f]
            if failed:
                break
            landed = current[0]
            if k + 1 < schedule.rounds:
                try:
                    ahead = _start_gets(reader, by_round[k + 1], me, targets)
                except BaseException as e:  # noqa: BLE001 - heard of at the next round's flags
                    error = e
            try:
                peer_bytes += _swap(posts)
            except BaseException as e:  # noqa: BLE001
                error, broken = e, True
                break
            finally:
                exchange_s += time.perf_counter() - t
            try:
                for c in chunks:
                    _deliver(reader, planner, c, landed.pop(c.cid), targets.get(c.key, ()), copier)
            except BaseException as e:  # noqa: BLE001
                error = e
    finally:
        if ahead is not None:  # they write into destinations and buffers: end them first
            abort_and_wait(ahead[1])
    try:
        copier.close()
    except BaseException as e:  # noqa: BLE001
        error = error or e
    seconds = time.perf_counter() - start_s
    figures = [[float(error is not None), float(s3_bytes), float(peer_bytes), seconds]]
    if not broken:
        mine = torch.tensor(figures[0], dtype=torch.float64, device=device)
        every = [torch.empty_like(mine) for _ in range(world)]
        try:
            dist.all_gather(every, mine, group=group)
            figures = [t.tolist() for t in every]
        except BaseException as e:  # noqa: BLE001
            error = error or e
    if error is not None:
        raise error
    failed = sorted(set(failed) | {r for r, f in enumerate(figures) if f[0]}) if len(figures) == world else failed
    if failed:
        raise PeerReadError(f"cooperative load: rank(s) {failed} failed (see their errors); rank {me} stopped too",
                            failed)
    return LoadStats("cooperative", schedule.unique_bytes, s3_bytes, peer_bytes,
                     int(sum(f[1] for f in figures)), int(sum(f[2] for f in figures)), seconds,
                     max(f[3] for f in figures), schedule.rounds, world, get_s, exchange_s)


def _targets(reader, plan, planner) -> tuple[dict, dict]:
    """This rank's reads as the plain path plans them, as targets per stored item (sorted by
    start), and one read per stored item (for its location and its name in errors)."""
    slot_bytes, _ = reader._window_shape()
    targets: dict[Any, list[_Target]] = {}
    reads: dict[Any, Any] = {}
    for item in plan.items:
        read = reader.items.plan(item, planner, slot_bytes)
        key = item_key(read.location)
        reads.setdefault(key, read)
        if read.pieces is None:  # lands in read.sink, the destination's (or bytes buffer's) memory
            buf = torch.frombuffer(read.sink, dtype=torch.uint8) if len(read.sink) else \
                torch.empty(0, dtype=torch.uint8)
            targets.setdefault(key, []).append(_Target(read, None, read.start, read.end, buf))
            if read.end == read.start:  # an empty item: nothing will arrive for it
                reader.items.finish(read, planner, verify=False)
        elif not read.pieces:
            planner.commit_tensor(read.item, read.dest)
        for piece in read.pieces or ():
            targets.setdefault(key, []).append(_Target(read, piece, piece.start, piece.end, None))
    for ts in targets.values():
        ts.sort(key=lambda t: t.start)
    return targets, reads


def _check_covered(targets: dict, chunks, reader) -> None:
    """Every byte this rank fetches must come in one of its chunks (a plan made with other
    settings than this rank's would leave holes: refuse it before any byte moves)."""
    have: dict[Any, list[tuple[int, int]]] = {}
    for c in chunks:
        have.setdefault(c.key, []).append((c.start, c.end))
    for key, ts in targets.items():
        spans = sorted(have.get(key, ()))
        for t in ts:
            got = sum(max(0, min(hi, t.end) - max(lo, t.start)) for lo, hi in spans)
            if got != t.end - t.start:
                raise MetadataFormatError(
                    f"{reader._uri}: the cooperative plan covers {got} of the {t.end - t.start} bytes this rank reads "
                    f"of {t.read.item.storage_index.fqn!r}; the ranks' readers must share verify= and S3Config")


def _landing(c: Chunk, ts) -> torch.Tensor:
    """Where chunk ``c`` lands on this rank: inside a direct target that holds all of it (the
    destination itself), else a buffer of its own."""
    for t in ts:
        if t.piece is None and t.start <= c.start and c.end <= t.end and t.end > t.start:
            return t.buf[c.start - t.start:c.end - t.start]
    return torch.empty(c.length, dtype=torch.uint8)


def _start_gets(reader, chunks: list[Chunk], me: int, targets: dict) -> tuple[dict, list, list[Chunk]]:
    """Where each chunk of a round lands, and the GETs of this rank's own chunks, issued
    (neighbours in one object in one GET): (landing places, futures, owned chunks)."""
    landed = {c.cid: _landing(c, targets.get(c.key, ())) for c in chunks}
    owned = [c for c in chunks if c.owner == me and c.length]
    uri = reader._require_uri()
    by_object: dict[str, list[Segment]] = {}
    for c in owned:
        by_object.setdefault(c.key[0], []).append(Segment(c.key[1] + c.start, c.length, c))
    # Only neighbours: a hole between two of this rank's chunks may be another rank's chunk,
    # and no byte is read twice.
    runs = [(name, run) for name, segs in by_object.items() for run in layout.coalesce(segs, 0, 1 << 30)]
    futures: list = []
    try:
        for name, run in runs:
            sinks = [(seg.offset, byte_view(landed[seg.tag.cid])) for seg in run]
            futures.append(reader.client.get_scatter(uri.bucket, object_key(uri, name), run[0].offset,
                                                     max(seg.end for seg in run), sinks))
    except BaseException:
        abort_and_wait(futures)
        raise
    return landed, futures, owned


def _finish_gets(reader, started: tuple, reads: dict) -> int:
    """Wait for a round's GETs and verify each chunk (the reading rank's duty); the bytes read.
    On an error the other GETs are aborted and waited for."""
    landed, futures, owned = started
    try:
        for f in futures:
            f.result()
    except BaseException:
        abort_and_wait(futures)
        raise
    if reader.verify:
        for c in owned:
            reader.items.verify_bytes(reads[c.key], c.start, byte_view(landed[c.cid]))
    return sum(c.length for c in owned)


def _wires(chunks: list[Chunk], landed: dict, me: int, device: torch.device) -> dict:
    """What each chunk of a round this rank sends or receives travels in: its landing place on
    CPU (gloo), a device copy for NCCL; {cid: (wire, landing)}. Made before the round's flags,
    so nothing is left to fail locally once the messages are posted."""
    wires = {}
    for c in chunks:
        if not c.length or (c.owner != me and me not in c.receivers):
            continue
        buf = landed[c.cid]
        if device.type == "cpu":
            wires[c.cid] = (buf, buf)
        elif c.owner == me:
            wires[c.cid] = (buf.to(device), buf)
        else:
            wires[c.cid] = (torch.empty(c.length, dtype=torch.uint8, device=device), buf)
    return wires


@dataclass
class _Posts:
    """A round's messages for this rank, made before the round's flags so that nothing is left
    to fail locally once other ranks post theirs (a rank that failed after its peers posted would
    leave them waiting for its messages until the backend's timeout)."""

    group: Any
    broadcasts: list  # (wire, owner's rank in the group), in the schedule's order
    p2p: list  # P2POps, posted as one batch
    back: list  # (device wire, landing place) of each chunk received through a device buffer
    received: int  # bytes received from peers


def _posts(chunks: list[Chunk], wires: dict, me: int, group) -> _Posts:
    """Each owned chunk to its receivers and each chunk this rank needs from its owner (see
    :func:`_swap`), every rank named checked against the group."""
    world = dist.get_world_size(group)
    posts = _Posts(group, [], [], [], 0)
    for c in chunks:
        if c.cid not in wires:
            continue
        wire, landing = wires[c.cid]
        if not (0 <= c.owner < world and all(0 <= r < world and r != c.owner for r in c.receivers)):
            raise RuntimeError(f"cooperative load: chunk {c.cid} names owner {c.owner} and receivers "
                               f"{list(c.receivers)}, not ranks of this group of {world}")
        if c.owner != me:
            posts.received += c.length
            if wire is not landing:
                posts.back.append((wire, landing))
        if world > 2 and len(c.receivers) == world - 1:
            posts.broadcasts.append((wire, c.owner))
        elif c.owner == me:
            posts.p2p.extend(dist.P2POp(dist.isend, wire, group=group, group_peer=r, tag=c.cid) for r in c.receivers)
        else:
            posts.p2p.append(dist.P2POp(dist.irecv, wire, group=group, group_peer=c.owner, tag=c.cid))
    return posts


def _swap(posts: _Posts) -> int:
    """Post a round's messages and wait for them; the bytes received. A chunk every rank needs
    is broadcast (a tree or ring: the owner does not send it world − 1 times); any other goes
    point to point, isend/irecv in one batch. Every rank posts them in the schedule's order, so
    the two ends of each message, and the collectives, match."""
    works = [dist.broadcast(wire, group=posts.group, group_src=owner, async_op=True)
             for wire, owner in posts.broadcasts]
    if posts.p2p:
        works.extend(dist.batch_isend_irecv(posts.p2p))
    for work in works:
        work.wait()
    for wire, landing in posts.back:  # NCCL: from the device buffers into the landing places
        landing.copy_(wire)
    return posts.received


def _deliver(reader, planner, c: Chunk, buf: torch.Tensor, ts, copier) -> None:
    """Copy chunk ``c`` (in ``buf``) into every target it overlaps; finish each target that is
    now complete as the plain path finishes it, without verifying again."""
    for t in ts:
        lo, hi = max(t.start, c.start), min(t.end, c.end)
        if hi <= lo:
            continue
        if t.buf is None:
            t.buf = torch.empty(t.end - t.start, dtype=torch.uint8)
        dest = t.buf[lo - t.start:hi - t.start]
        if dest.data_ptr() != buf.data_ptr() + (lo - c.start):  # not landed there already
            dest.copy_(buf[lo - c.start:hi - c.start])
        t.left -= hi - lo
        if t.left == 0:
            if t.piece is None:
                reader.items.finish(t.read, planner, verify=False)
            else:
                tokens: list = []
                reader.items.finish_piece(t.read, t.piece, t.buf, copier, tokens, planner, verify=False)
                for token in tokens:
                    copier.wait(token)
                t.buf = None
