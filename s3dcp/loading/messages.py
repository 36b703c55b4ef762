"""Cooperative reads: one round's messages between ranks, made before the round's flags.

    chunks of the round ──wires (_wires)──► what each chunk travels in: its landing place on CPU
      (gloo), a device buffer for NCCL
    wires ──posts (_posts)──► every rank named checked against the group; a chunk every rank needs
      as a broadcast, any other as isend/irecv, in the schedule's order on every rank
    posts ──swap (after the flags)──► posted, waited for (watching for a dead peer:
      :mod:`s3dcp.loading.liveness`), device buffers copied back into the landing places

Everything that can fail locally (allocations, a rank outside the group) happens before the
round's flags: a rank that failed after its peers posted would leave them waiting for its
messages. :mod:`s3dcp.loading.exchange` runs the rounds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .cooperative import Chunk
from .liveness import Watch

__all__ = ["wires", "posts", "swap", "Posts"]


def wires(chunks: list[Chunk], landed: dict, me: int, device: torch.device) -> dict:
    """What each chunk of a round this rank sends or receives travels in: its landing place on
    CPU (gloo), a device copy for NCCL; {cid: (wire, landing)}. Made before the round's flags,
    so nothing is left to fail locally once the messages are posted."""
    out = {}
    for c in chunks:
        if not c.length or (c.owner != me and me not in c.receivers):
            continue
        buf = landed[c.cid]
        if device.type == "cpu":
            out[c.cid] = (buf, buf)
        elif c.owner == me:
            out[c.cid] = (buf.to(device), buf)
        else:
            out[c.cid] = (torch.empty(c.length, dtype=torch.uint8, device=device), buf)
    return out


@dataclass
class Posts:
    """A round's messages for this rank, made before the round's flags so that nothing is left
    to fail locally once other ranks post theirs (a rank that failed after its peers posted would
    leave them waiting for its messages until the backend's timeout)."""

    group: Any
    broadcasts: list  # (wire, owner's rank in the group), in the schedule's order
    p2p: list  # P2POps, posted as one batch
    back: list  # (device wire, landing place) of each chunk received through a device buffer
    received: int  # bytes received from peers


def posts(chunks: list[Chunk], wires: dict, me: int, group) -> Posts:
    """Each owned chunk to its receivers and each chunk this rank needs from its owner (see
    :func:`swap`), every rank named checked against the group."""
    world = dist.get_world_size(group)
    out = Posts(group, [], [], [], 0)
    for c in chunks:
        if c.cid not in wires:
            continue
        wire, landing = wires[c.cid]
        if not (0 <= c.owner < world and all(0 <= r < world and r != c.owner for r in c.receivers)):
            raise RuntimeError(f"cooperative load: chunk {c.cid} names owner {c.owner} and receivers "
                               f"{list(c.receivers)}, not ranks of this group of {world}")
        if c.owner != me:
            out.received += c.length
            if wire is not landing:
                out.back.append((wire, landing))
        if world > 2 and len(c.receivers) == world - 1:
            out.broadcasts.append((wire, c.owner))
        elif c.owner == me:
            out.p2p.extend(dist.P2POp(dist.isend, wire, group=group, group_peer=r, tag=c.cid) for r in c.receivers)
        else:
            out.p2p.append(dist.P2POp(dist.irecv, wire, group=group, group_peer=c.owner, tag=c.cid))
    return out


def swap(posts: Posts, watch: Watch) -> int:
    """Post a round's messages and wait for them; the bytes received. A chunk every rank needs
    is broadcast (a tree or ring: the owner does not send it world − 1 times); any other goes
    point to point, isend/irecv in one batch. Every rank posts them in the schedule's order, so
    the two ends of each message, and the collectives, match. ``watch`` waits: a dead peer ends
    the wait within seconds (:mod:`s3dcp.loading.liveness`)."""
    works = [dist.broadcast(wire, group=posts.group, group_src=owner, async_op=True)
             for wire, owner in posts.broadcasts]
    if posts.p2p:
        works.extend(dist.batch_isend_irecv(posts.p2p))
    watch.wait(works)
    for wire, landing in posts.back:  # NCCL: from the device buffers into the landing places
        landing.copy_(wire)
    return posts.received
