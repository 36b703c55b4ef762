"""Reading a checkpoint from the nearest copy: this node's local files, a peer's, then S3.

    TieredReader (an S3StorageReader), every rank: the metadata given (a local copy's)
      prepare_global_plan, coordinator: for each object a rank reads,
          its node holds it         -> read from the local file
          another rank's node does  -> that rank sends it (whole), over the process group
          nobody does               -> S3
      read_data, every rank: the sends and receives first (point to point, files sent from their
          mapped pages), then DCP's reads through a TieredClient: local files and received objects
          served from memory (every item verified against its checksum, as from S3), the rest S3

Every wait of the transfers is bounded by a liveness watch (loading/liveness.py): a rank that
fails or dies mid-transfer ends every rank's load within seconds, as in a cooperative load.

Owns where each object is read from and the transfers between ranks; it must not choose the step
or decide which copies are intact (:mod:`s3dcp.lifecycle.tiers`).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import torch
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner

from ..errors import IntegrityError, PeerReadError
from ..s3.listing import ObjectInfo
from .liveness import Watch
from .reader import S3StorageReader

__all__ = ["TieredClient", "TieredReader", "Transfers", "plan_sources"]

_CHUNK = 64 << 20
_LOCAL_READERS = 2  # threads reading local files (the kernel's copy), beside the verification


class TieredClient:
    """An S3Client for one checkpoint whose objects may also be local files or bytes received
    from a peer (served first, counted per tier); every other call goes to ``s3``."""

    def __init__(self, s3, bucket: str, keys: dict[str, str], metadata: bytes, metadata_key: str) -> None:
        self.s3 = s3
        self.config = s3.config
        self.bucket = bucket
        self.files: dict[str, Path] = {}  # key -> a local file holding the object
        self.received: dict[str, torch.Tensor] = {}  # key -> the object's bytes, from a peer
        self._keys = keys  # object name -> key
        self._metadata, self._metadata_key = metadata, metadata_key
        self.bytes = {"local": 0, "peer": 0, "s3": 0}
        self._lock = threading.Lock()
        self._readers: ThreadPoolExecutor | None = None  # local reads, beside the reader's verification

    def close(self) -> None:
        """Let go of the local-read threads (the S3 client is the caller's)."""
        readers, self._readers = self._readers, None
        if readers is not None:
            readers.shutdown(wait=True)

    def add_file(self, name: str, path: Path) -> None:
        self.files[self._keys[name]] = path

    def add_received(self, name: str, data: torch.Tensor) -> None:
        self.received[self._keys[name]] = data

    def __getattr__(self, name: str) -> Any:  # list, put, ... : S3's
        return getattr(self.s3, name)

    def _count(self, tier: str, n: int) -> None:
        with self._lock:
            self.bytes[tier] += n

    def get(self, bucket: str, key: str) -> "Future[bytes]":
        if bucket == self.bucket and key == self._metadata_key:
            return _done(self._metadata)
        return self.s3.get(bucket, key)

    def head(self, bucket: str, key: str) -> "Future[ObjectInfo]":
        if bucket == self.bucket and key in self.files:
            return _done(ObjectInfo(key=key, size=self.files[key].stat().st_size, etag=None, last_modified=None))
        if bucket == self.bucket and key in self.received:
            return _done(ObjectInfo(key=key, size=self.received[key].numel(), etag=None, last_modified=None))
        return self.s3.head(bucket, key)

    def get_scatter(self, bucket: str, key: str, start: int, end: int,
                    sinks: Sequence[tuple[int, memoryview]]) -> "Future[int]":
        if bucket != self.bucket or (key not in self.files and key not in self.received):
            future = self.s3.get_scatter(bucket, key, start, end, sinks)
            future.add_done_callback(lambda f: f.exception() is None and self._count("s3", end - start))
            return future
        if self._readers is None:
            self._readers = ThreadPoolExecutor(_LOCAL_READERS, thread_name_prefix="s3dcp-local-read")
        return self._readers.submit(self._read_here, key, start, end, list(sinks))

    def _read_here(self, key: str, start: int, end: int, sinks) -> int:
        if key in self.files:
            got = _pread_scatter(self.files[key], start, end, sinks)
            self._count("local", got)
        else:
            got = _copy_scatter(self.received[key], start, end, sinks)
            self._count("peer", got)
        if got != end - start:
            raise IntegrityError(f"{self.files.get(key, key)}: asked for {end - start} bytes at offset {start}, "
                                 f"got {got} — the local copy is shorter than its metadata says")
        return got

    def get_range_into(self, bucket: str, key: str, offset: int, dest) -> "Future[int]":
        view = memoryview(dest).cast("B")
        return self.get_scatter(bucket, key, offset, offset + view.nbytes, [(offset, view)])


def _done(value) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


def _pread_scatter(path: Path, start: int, end: int, sinks) -> int:
    """Read ``[start, end)`` of the file into each sink that covers part of it; the bytes read."""
    got = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        for off, view in sinks:
            lo, hi = max(start, off), min(end, off + view.nbytes, size)
            at = lo
            while at < hi:
                n = os.preadv(fd, [view[at - off:hi - off]], at)
                if n <= 0:
                    break
                at += n
        got = max(0, min(end, size) - start)
    finally:
        os.close(fd)
    return got


def _copy_scatter(data: torch.Tensor, start: int, end: int, sinks) -> int:
    size = data.numel()
    for off, view in sinks:
        lo, hi = max(start, off), min(end, off + view.nbytes, size)
        if lo < hi:
            torch.frombuffer(view, dtype=torch.uint8)[lo - off:hi - off].copy_(data[lo:hi])
    return max(0, min(end, size) - start)


@dataclass(frozen=True)
class Transfers:
    """What a rank sends and receives before its reads: (object name, size, other rank)."""

    send: tuple = ()
    receive: tuple = ()
    agree: bool = False  # the job has transfers: every rank agrees that all are ready before any starts


def plan_sources(needs: Sequence[set[str]], sizes: dict[str, int], node_of: Sequence[str],
                 holders: dict[str, set[int]]) -> tuple[list[Transfers], dict[str, int]]:
    """Each rank's transfers, and bytes per source tier: an object a rank reads comes from its
    node's local file when the node holds it, else whole from the least busy rank whose node
    holds it, else S3. ``holders``: object -> ranks whose node has an intact copy."""
    load = [0] * len(needs)
    sends: list[list] = [[] for _ in needs]
    receives: list[list] = [[] for _ in needs]
    tiers = {"local": 0, "peer": 0, "s3": 0}
    for rank, names in enumerate(needs):
        for name in sorted(names):
            held_by = holders.get(name, set())
            if any(node_of[h] == node_of[rank] for h in held_by):
                tiers["local"] += sizes[name]
            elif held_by:
                sender = min(held_by, key=lambda h: (load[h], h))
                load[sender] += sizes[name]
                sends[sender].append((name, sizes[name], rank))
                receives[rank].append((name, sizes[name], sender))
                tiers["peer"] += sizes[name]
            else:
                tiers["s3"] += sizes[name]
    agree = any(sends)
    return [Transfers(tuple(s), tuple(r), agree) for s, r in zip(sends, receives)], tiers


class TieredReader(S3StorageReader):
    """An S3StorageReader over a :class:`TieredClient` (see the module docstring). ``holders``:
    object -> ranks whose node holds an intact copy (every rank passes the same); ``node_of``:
    each rank's node; ``local_paths``: object -> this node's file of it; ``transfer_group``: the
    group the transfers go over (default ``process_group``); ``watch_key``: names
    this load in the group's store (the same on every rank, new for every load)."""

    def __init__(self, path: str, *, client: TieredClient, holders: dict[str, set[int]], node_of: Sequence[str],
                 local_paths: dict[str, Path], process_group: Any = None, transfer_group: Any = None,
                 watch_key: str = "s3dcp/tiered/broken", **kwargs: Any) -> None:
        super().__init__(path, client=client, config=client.config, process_group=process_group, **kwargs)
        # the peer transfers' group (CPU tensors: gloo), the same ranks in the same order as DCP's
        self.transfer_group = transfer_group if transfer_group is not None else process_group
        self.watch_key = watch_key
        self.holders = holders
        self.node_of = list(node_of)
        self.local_paths = local_paths
        for name, file in local_paths.items():
            client.add_file(name, file)
        self.planned_tiers: dict[str, int] = {}

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        sizes: dict[str, int] = {}
        needs = []
        for plan in plans:
            names = set()
            for item in plan.items:
                loc = self.items.location(item)
                names.add(loc.object_name)
                sizes[loc.object_name] = max(sizes.get(loc.object_name, 0), loc.offset + loc.length)
            needs.append(names)
        transfers, self.planned_tiers = plan_sources(needs, sizes, self.node_of, self.holders)
        return [replace(plan, storage_data=t) for plan, t in zip(plans, transfers)]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner):
        transfers = plan.storage_data if isinstance(plan.storage_data, Transfers) else Transfers()
        if transfers.agree:  # every rank of the job, so that all take part in the agreement
            self._transfer(transfers)
        return super().read_data(plan, planner)

    def _transfer(self, transfers: Transfers) -> None:
        import torch.distributed as dist

        ranks = dist.get_process_group_ranks(self.transfer_group) if self.transfer_group is not None else None

        def global_rank(r: int) -> int:
            return ranks[r] if ranks is not None else r

        # every file mapped and every buffer made first, and every rank told whether all could
        # be: a rank that failed here alone would leave its partners waiting in a send or receive
        try:
            outgoing = [(torch.from_file(str(self.local_paths[name]), shared=False, size=size, dtype=torch.uint8), to)
                        for name, size, to in transfers.send]
            incoming = [(name, torch.empty(size, dtype=torch.uint8), sender) for name, size, sender in transfers.receive]
            error = None
        except Exception as e:  # noqa: BLE001 - raised below, once every rank knows
            error = e
        watch = Watch(self.transfer_group, self.watch_key, "restore from the nodes", also=(self.process_group,))
        failed = torch.tensor([0 if error is None else dist.get_rank(self.transfer_group) + 1], dtype=torch.int64)
        try:
            watch.wait([dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=self.transfer_group, async_op=True)])
        except BaseException as e:
            watch.broke(e)
            raise
        if error is not None:  # every rank knows: the group is still whole
            raise error
        if int(failed):
            rank = int(failed) - 1
            raise PeerReadError(f"rank {rank} could not prepare its transfers of the nodes' copies", [rank])
        try:
            work = []
            for data, to in outgoing:
                work += [dist.isend(data[i:i + _CHUNK], global_rank(to), group=self.transfer_group)
                         for i in range(0, data.numel(), _CHUNK)]
            for name, data, sender in incoming:
                self.client.add_received(name, data)
                work += [dist.irecv(data[i:i + _CHUNK], global_rank(sender), group=self.transfer_group)
                         for i in range(0, data.numel(), _CHUNK)]
            watch.wait(work)  # the mapped files (outgoing) stay referenced until every send is done
        except BaseException as e:
            watch.broke(e)  # a transfer failed mid-way: the group is of no further use
            raise
