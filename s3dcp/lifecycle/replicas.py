"""The peer tier: each rank's local copy sent, after the step's commit, to a rank on another node.

    Replicas(nodes, ranks, group)   once, collectively (lifecycle/tier_sync.py, which knows every
                                    rank's node): a gloo group of its own for the transfers (they
                                    run on a thread of their own, beside the next save's
                                    collectives on the manager's group)
      peer[r]                       the rank on the next node (node order) with r's index there
      submit(step_root, r, save_id) this rank's copy goes to peer[r]; the copies of the ranks whose
                                    peer this rank is arrive into step_root/rank-<R>/ (marker last).
                                    Every rank submits the same steps (those every rank sealed)
      pending()                     the step roots still being sent or received: never retained away
      wait()                        every transfer so far done; the first error raised

Transfers are point-to-point sends of the files' own mapped pages (``torch.from_file``), into
files mapped on the receiving side (0600, in 0700 directories): no copy in user space. A manifest
(names, sizes, the marker's bytes) goes first. Every wait is bounded by a liveness watch: a peer
that dies or fails mid-transfer ends the transfer on every rank within seconds, and the peer tier
stops (its group is of no use any more). A single-node job has no peer: replication is off there
(logged).

Owns the peer mapping and the transfers; it must not decide which steps are replicated or
kept (:mod:`s3dcp.lifecycle.tiers`).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
from pathlib import Path

import torch

from ..format.local import MARKER_NAME, LocalMarker, rank_dir_name
from ..loading.liveness import Watch, attempt
from ..saving.local_copy import make_private_dirs, remove_copy, write_private

__all__ = ["Replicas", "peer_map"]

log = logging.getLogger("s3dcp")

_CHUNK = 64 << 20  # bytes per message
_MAX_MANIFEST = 8 << 20


def peer_map(nodes: list[str]) -> dict[int, int]:
    """rank -> the rank on the next node (in node order) holding its replica; empty with one node.
    On a node of k ranks, rank i (in rank order) sends to the i mod k-th rank of the next node."""
    order = sorted(set(nodes))
    if len(order) < 2:
        return {}
    by_node = {n: [r for r, m in enumerate(nodes) if m == n] for n in order}
    peers = {}
    for k, node in enumerate(order):
        target = by_node[order[(k + 1) % len(order)]]
        for i, rank in enumerate(by_node[node]):
            peers[rank] = target[i % len(target)]
    return peers


class Replicas:
    """This rank's side of the peer tier (see the module docstring). Made collectively, by
    every rank of ``process_group``, in the same order."""

    def __init__(self, nodes: list[str], ranks: list[int], process_group=None) -> None:
        """``nodes``: each rank's node (the group's numbering); ``ranks``: the group's global ranks."""
        import torch.distributed as dist

        self.rank = dist.get_rank()
        self.nodes = nodes
        self.group = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=process_group is not None)
        by_index = peer_map(nodes)  # in the group's numbering, as the copies' directories are
        self.peer = {ranks[i]: ranks[j] for i, j in by_index.items()}  # global ranks: the transfers'
        self.sources = sorted(r for r, p in self.peer.items() if p == self.rank)
        self.source_ranks = sorted(i for i, j in by_index.items() if ranks[j] == self.rank)  # the group's
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: list[Path] = []  # step roots submitted and not done, in order
        self._errors: list[BaseException] = []
        self._broken: BaseException | None = None  # the group failed under a transfer: no more of them
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        if not self.peer:
            log.warning("local_replicas=1, but every rank is on one node (%s): there is no other node to "
                        "hold a replica, so none is kept", nodes[0])

    @property
    def active(self) -> bool:
        return self.rank in self.peer

    def submit(self, step_root: Path, own_rank: int, save_id: str) -> None:
        """Send ``step_root/rank-<own_rank>`` (of save ``save_id``) to this rank's peer and receive
        the sources' copies into ``step_root`` — on the replication thread, in submission order."""
        if not self.active:
            return
        with self._lock:
            self._pending.append(step_root)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="s3dcp-replicas", daemon=True)
                self._thread.start()
        self._jobs.put((step_root, own_rank, save_id))

    def pending(self) -> list[Path]:
        """The step roots whose transfers are submitted and not done: they must not be deleted
        (the peer is sending into, or waiting to send from, them)."""
        with self._lock:
            return list(self._pending)

    def wait(self) -> None:
        """Wait until every submitted transfer is done; raise the first error (once)."""
        with self._lock:
            while self._pending:
                self._lock.wait()
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0]

    def _run(self) -> None:
        while True:
            step_root, own_rank, save_id = self._jobs.get()
            try:
                if self._broken is not None:
                    raise RuntimeError(f"the peer tier stopped after an earlier transfer failed ({self._broken})")
                watch = Watch(self.group, f"s3dcp/replica/{attempt()}/{save_id}/broken", "replication")
                try:
                    self._exchange(step_root, own_rank, watch)
                except BaseException as e:
                    self._broken = e
                    watch.broke(e)
                    raise
            except BaseException as e:  # noqa: BLE001 - reaches wait()
                log.warning("replicating %s to rank %d failed: %s", step_root / rank_dir_name(own_rank),
                            self.peer[self.rank], e)
                with self._lock:
                    self._errors.append(e)
            finally:
                with self._lock:
                    self._pending.remove(step_root)
                    self._lock.notify_all()

    def _exchange(self, step_root: Path, own_rank: int, watch: Watch) -> None:
        import torch.distributed as dist

        mine = step_root / rank_dir_name(own_rank)
        try:
            marker = (mine / MARKER_NAME).read_bytes()
            files = [(p.name, p.stat().st_size) for p in sorted(mine.iterdir())
                     if p.name != MARKER_NAME and not p.name.endswith(".tmp")]
            manifest = json.dumps({"files": files, "marker": marker.decode()}).encode()
        except (OSError, UnicodeDecodeError) as e:  # this rank's copy went meanwhile: its peer hears so
            log.warning("local copy %s cannot be replicated: %s", mine, e)
            files, manifest = [], json.dumps({"error": f"{type(e).__name__}: {e}"}).encode()
        peer = self.peer[self.rank]
        # 1. manifests: their sizes, then their bytes
        out_size = torch.tensor([len(manifest)], dtype=torch.int64)
        in_sizes = {s: torch.zeros(1, dtype=torch.int64) for s in self.sources}
        watch.wait([dist.isend(out_size, peer, group=self.group)]
                   + [dist.irecv(t, s, group=self.group) for s, t in in_sizes.items()])
        in_manifests = {}
        for s, t in in_sizes.items():
            if not 0 < int(t) <= _MAX_MANIFEST:
                raise RuntimeError(f"replica manifest of {int(t)} bytes from rank {s}")
            in_manifests[s] = torch.empty(int(t), dtype=torch.uint8)
        watch.wait([dist.isend(torch.frombuffer(bytearray(manifest), dtype=torch.uint8), peer, group=self.group)]
                   + [dist.irecv(t, s, group=self.group) for s, t in in_manifests.items()])
        incoming = {s: json.loads(bytes(t.numpy())) for s, t in in_manifests.items()}
        # 2. the files: sent from their mapped pages, received into mapped files
        work, keep = [], []
        for name, size in files:
            if size:
                data = torch.from_file(str(mine / name), shared=False, size=size, dtype=torch.uint8)
                keep.append(data)
                work += [dist.isend(data[i:i + _CHUNK], peer, group=self.group) for i in range(0, size, _CHUNK)]
        landed = []
        for s, doc in incoming.items():
            if "error" in doc:
                log.warning("rank %d sent no replica of step %s: %s", s, step_root.name, str(doc["error"])[:300])
                continue
            theirs = LocalMarker.decode(doc["marker"].encode(), f"the replica manifest from rank {s}")
            if theirs.rank not in self.source_ranks:
                raise RuntimeError(f"rank {s} sent a replica of rank {theirs.rank}, whose replicas this rank "
                                   f"does not hold ({self.source_ranks})")
            target = step_root / rank_dir_name(theirs.rank)
            remove_copy(target)
            make_private_dirs(target)
            for name, size in doc["files"]:
                path = _inside(target, name)
                if not isinstance(size, int) or size < 0:
                    raise RuntimeError(f"rank {s} sent a replica file {name!r} of size {size!r}")
                write_private(path, b"")
                os.truncate(path, size)
                if size:
                    into = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
                    keep.append(into)
                    work += [dist.irecv(into[i:i + _CHUNK], s, group=self.group) for i in range(0, size, _CHUNK)]
            landed.append((target, doc["marker"].encode()))
        watch.wait(work)
        del keep
        for target, marker_bytes in landed:  # complete: the marker, last
            tmp = target / f"{MARKER_NAME}.tmp"
            write_private(tmp, marker_bytes)
            os.replace(tmp, target / MARKER_NAME)


def _inside(directory: Path, name: str) -> Path:
    """``directory / name`` for a plain file name a peer sent (never a path out of it)."""
    if not name or "/" in name or name in (".", "..") or "\0" in name or name.startswith(MARKER_NAME):
        raise RuntimeError(f"a replica names the file {name!r}")
    return directory / name
