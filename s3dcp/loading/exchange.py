"""Cooperative reads, the run: a rank's :class:`~s3dcp.loading.cooperative.RankSchedule`, round by round.

    this rank's ReadItems ──the plain path's plan (ItemReads.plan, s3dcp.loading.items)──► targets: the byte range
      of a direct read (lands in the destination) or of one bounce piece (copied out of a buffer)
    per round:
      owned chunks ──ranged GETs (neighbours coalesced)──► landing buffers, each chunk verified
      all ranks: every rank's failure flag (all_reduce) ── any set: every rank stops and raises
      the next round's GETs issued, to run while this one is exchanged:
      isend each owned chunk to its receivers, irecv each chunk this rank needs (one batch);
        a chunk every rank needs is broadcast instead (s3dcp.loading.messages)
      each chunk ──copied into the targets it overlaps──► a target complete: verified bytes
        committed as the plain path commits them (no second checksum: the reader verified)
    all ranks: flags and figures (all_gather) ── the slowest rank's seconds, bytes from S3/peers

A chunk that lies inside one direct target lands in the destination itself (a DDP restore
needs no buffer at all); any other lands in a buffer of its own, freed at the end of its round.
Rounds are half the window, and two are in memory at a time (one exchanged, the next read), so
a rank holds about the window beyond its state (plus the bounce pieces being filled) — unless
a chunk is larger than half the window: chunks are cut only at checksum blocks, a round holds
at least one, and the bound is then about twice the largest chunk (the coordinator warns;
``LoadStats.largest_chunk_bytes`` and ``buffer_peak_bytes`` say what it was). Every local error,
from the first round's GETs on, is held until the next collective, so all ranks leave at the
same round: one rank's failure is an error on every rank, never a hang. A rank that dies ends
every other rank's waits within seconds (:mod:`s3dcp.loading.liveness`).
"""

from __future__ import annotations

import logging
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
from . import bounce, messages
from .cooperative import Chunk, PeerInfo, RankSchedule, item_key, node_name, schedule_plans
from .liveness import Watch

__all__ = ["LoadStats", "exchange_device", "check_window", "with_peer_info", "global_plans", "read", "run"]

log = logging.getLogger("s3dcp")


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
    # Cooperative: the exchange_window_bytes asked for; the largest chunk this rank owns or
    # receives (chunks are cut only at checksum blocks, so a round holds at least one: the real
    # bound is about max(window, 2 x this), plus bounce pieces being filled; docs/restore.md); and
    # the most bytes the exchange's own buffers held at once on this rank.
    window_bytes: int = 0
    largest_chunk_bytes: int = 0
    buffer_peak_bytes: int = 0


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
    """The coordinator's step: every rank's schedule, planned with the reader's settings. Warns
    when the window cannot bound the exchange's memory: a round holds at least one chunk, and
    chunks are cut only at checksum blocks (16 MiB; an item of one checksum not at all)."""
    slot_bytes, _ = reader._window_shape()
    window = reader.exchange_window_bytes
    out = schedule_plans(plans, reader.items.location, verify=reader.verify, slot_bytes=slot_bytes,
                         gap_bytes=reader.config.coalesce_gap_bytes, window_bytes=window)
    largest = max((c.length for p in out if isinstance(p.storage_data, RankSchedule) for c in p.storage_data.chunks),
                  default=0)
    if 2 * largest > window:
        log.warning("cooperative load of %s: exchange_window_bytes=%d is below what its chunks need: chunks are cut "
                    "only at checksum-block boundaries and the largest here is %d bytes, so a rank may hold up to "
                    "%d bytes beyond its state (two rounds), plus bounce pieces being filled (LoadStats."
                    "largest_chunk_bytes, buffer_peak_bytes)", reader._uri, window, largest, 2 * largest)
    return out


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
    watch = Watch(group, f"s3dcp/cooperative/{schedule.load_id}/broken")  # every wait: a dead peer ends it
    held = _Held()  # the exchange's own buffers, for LoadStats.buffer_peak_bytes
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
            try:  # a failure here (a bad object name, say) reaches every rank at round 0's flags
                ahead = _start_gets(reader, by_round[0], me, targets, held)
            except BaseException as e:  # noqa: BLE001
                error = e
        for k, chunks in enumerate(by_round):
            current, ahead = ahead, None
            if current is not None and error is not None:  # failed since they were issued
                abort_and_wait(current[1])
            elif current is not None:
                t = time.perf_counter()
                try:
                    s3_bytes += _finish_gets(reader, current, reads)
                    # every local step of the exchange (allocations, the messages) before the flags
                    posts = messages.posts(chunks, messages.wires(chunks, current[0], me, device), me, group)
                except BaseException as e:  # noqa: BLE001
                    error = e
                get_s += time.perf_counter() - t
            t = time.perf_counter()
            flags = torch.zeros(world, dtype=torch.int32, device=device)
            flags[me] = error is not None
            try:
                watch.wait([dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group, async_op=True)])
            except BaseException as e:  # noqa: BLE001 - a peer is gone
                error, broken = error or e, True
                watch.broke(e)
                break
            failed = [r for r, f in enumerate(flags.tolist()) if f]
            if failed:
                break
            landed = current[0]
            if k + 1 < schedule.rounds:
                try:
                    ahead = _start_gets(reader, by_round[k + 1], me, targets, held)
                except BaseException as e:  # noqa: BLE001 - heard of at the next round's flags
                    error = e
            try:
                peer_bytes += messages.swap(posts, watch)
            except BaseException as e:  # noqa: BLE001
                error, broken = e, True
                watch.broke(e)
                break
            finally:
                exchange_s += time.perf_counter() - t
            try:
                for c in chunks:
                    _deliver(reader, planner, c, landed.pop(c.cid), targets.get(c.key, ()), copier, held)
            except BaseException as e:  # noqa: BLE001
                error = e
            held.add(-current[3])  # this round's landing buffers are done with
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
            watch.wait([dist.all_gather(every, mine, group=group, async_op=True)])
            figures = [t.tolist() for t in every]
        except BaseException as e:  # noqa: BLE001
            error = error or e
            watch.broke(e)
    if error is not None:
        raise error
    failed = sorted(set(failed) | {r for r, f in enumerate(figures) if f[0]}) if len(figures) == world else failed
    if failed:
        raise PeerReadError(f"cooperative load: rank(s) {failed} failed (see their errors); rank {me} stopped too",
                            failed)
    return LoadStats("cooperative", schedule.unique_bytes, s3_bytes, peer_bytes,
                     int(sum(f[1] for f in figures)), int(sum(f[2] for f in figures)), seconds,
                     max(f[3] for f in figures), schedule.rounds, world, get_s, exchange_s,
                     schedule.window_bytes, max((c.length for c in schedule.chunks), default=0), held.peak)


class _Held:
    """Bytes of the exchange's own buffers on this rank (landing buffers of chunks that do not
    land in a destination, bounce pieces being filled) and their high-water mark."""

    __slots__ = ("now", "peak")

    def __init__(self) -> None:
        self.now = self.peak = 0

    def add(self, n: int) -> None:
        self.now += n
        self.peak = max(self.peak, self.now)


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


def _landing(c: Chunk, ts, held: "_Held") -> torch.Tensor | None:
    """Where chunk ``c`` lands on this rank when one target holds all of it: the destination
    itself (a direct target), or the buffer of a bounce piece (made now, counted in ``held``),
    so that its bytes are not held twice; None: it needs a buffer of its own."""
    for t in ts:
        if t.start <= c.start and c.end <= t.end and t.end > t.start:
            if t.buf is None:  # a bounce piece's first bytes
                t.buf = torch.empty(t.end - t.start, dtype=torch.uint8)
                held.add(t.end - t.start)
            return t.buf[c.start - t.start:c.end - t.start]
    return None


def _start_gets(reader, chunks: list[Chunk], me: int, targets: dict, held: "_Held") -> tuple[dict, list, list, int]:
    """Where each chunk of a round lands, and the GETs of this rank's own chunks, issued
    (neighbours in one object in one GET): (landing places, futures, owned chunks, bytes of
    buffers made for it, counted in ``held``)."""
    landed = {c.cid: _landing(c, targets.get(c.key, ()), held) for c in chunks}
    fresh = [cid for cid, buf in landed.items() if buf is None]
    lengths = {c.cid: c.length for c in chunks}
    for cid in fresh:
        landed[cid] = torch.empty(lengths[cid], dtype=torch.uint8)
    buffered = sum(lengths[cid] for cid in fresh)
    held.add(buffered)
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
        held.add(-buffered)
        raise
    return landed, futures, owned, buffered


def _finish_gets(reader, started: tuple, reads: dict) -> int:
    """Wait for a round's GETs and verify each chunk (the reading rank's duty); the bytes read.
    On an error the other GETs are aborted and waited for."""
    landed, futures, owned, _ = started
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


def _deliver(reader, planner, c: Chunk, buf: torch.Tensor, ts, copier, held: _Held) -> None:
    """Copy chunk ``c`` (in ``buf``) into every target it overlaps; finish each target that is
    now complete as the plain path finishes it, without verifying again."""
    for t in ts:
        lo, hi = max(t.start, c.start), min(t.end, c.end)
        if hi <= lo:
            continue
        if t.buf is None:
            t.buf = torch.empty(t.end - t.start, dtype=torch.uint8)
            held.add(t.end - t.start)
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
                held.add(-(t.end - t.start))
