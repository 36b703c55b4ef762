"""The job as the local tier sees it, learned once at the first save: each rank's node, who
cleans which directories of a node's ``local_dir``, and the tier's own collectives.

    TierSync(group, replicas)       collectively, by every rank of ``group``, at the first save:
                                    every rank's node; a gloo group of the tier's own for the
                                    agreements; the peer tier (lifecycle/replicas.py) when asked
      agree(save_id, mine)          every rank's ``mine`` after a save's local commit, so that all
                                    decide the same (seal, or drop the step's copies everywhere);
                                    every wait bounded by a liveness watch
      owned(rank_dirs)              the rank directories of a step this rank cleans: its own, the
                                    replicas it receives, and, on the node's first rank, the ones no
                                    rank of the node owns any more (another world size, node order,
                                    replicas switched off)

The agreements run on the thread that completes a save (DCP's upload thread for async saves):
on a group of their own, so they never interleave with the training loop's collectives or
DCP's, in save order on every rank (one save uploads at a time on a multi-rank job).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from ..loading.cooperative import node_name
from ..loading.liveness import Watch, attempt, gather_objects
from .replicas import Replicas, peer_map

__all__ = ["TierSync"]

log = logging.getLogger("s3dcp")


class TierSync:
    """See the module docstring. Made by every rank of ``process_group`` (``None``: the default
    group), in the same order."""

    def __init__(self, process_group: Any, *, replicas: bool) -> None:
        import torch.distributed as dist

        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        nodes: list = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(nodes, node_name(), group=process_group)
        self.nodes = nodes
        ranks = dist.get_process_group_ranks(process_group) if process_group is not None else list(range(len(nodes)))
        # only the group's ranks make it (a rank of the world outside the group never would)
        self.group = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=process_group is not None)
        self.replicas = Replicas(nodes, ranks, process_group) if replicas else None
        here = [r for r, n in enumerate(nodes) if n == nodes[self.rank]]
        self.leader = self.rank == here[0]  # the node's first rank also cleans what nobody owns
        peers = peer_map(nodes) if self.replicas is not None and self.replicas.active else {}
        self._node_owns = set(here) | {r for r, p in peers.items() if p in here}
        self._mine = {self.rank} | {r for r, p in peers.items() if p == self.rank}
        self._lock = threading.Lock()

    @property
    def local_world(self) -> int:
        """Ranks on this node (they share its local_dir)."""
        return sum(1 for n in self.nodes if n == self.nodes[self.rank])

    def owned(self, ranks: list[int]) -> list[int]:
        """Of the saving ranks whose directories a step holds on this node, those this rank
        cleans (see the module docstring)."""
        return [r for r in ranks if r in self._mine or (self.leader and r not in self._node_owns)]

    def agree(self, save_id: str, mine: Any) -> list:
        """Every rank's ``mine`` for the save ``save_id``, in rank order. A peer that dies or
        fails meanwhile ends it on every rank within seconds (PeerReadError or the group's error)."""
        with self._lock:
            watch = Watch(self.group, f"s3dcp/tier/{attempt()}/{save_id}/broken", "local tier agreement")
            try:
                return gather_objects(mine, self.group, watch)
            except BaseException as e:
                watch.broke(e)
                raise
