"""Cooperative reads: how every rank learns, within seconds, that a peer died mid-exchange.

A rank killed mid-exchange (SIGKILL, the OOM killer, a lost node) closes its connections, and
only the ranks whose current message goes to it or comes from it see an error at once. The
others wait inside their collective for a live peer that has already given up, until the
group's timeout (30 minutes by default); and so do DCP's collectives after ``read_data``. So:

    every wait of the exchange (Watch.wait) ──its works, waited for on a thread──► done: go on
       └─ meanwhile, every POLL_S: the store (the group's c10d store, not its connections)
          holds KEY? ──► raise
    a rank whose collective fails (Watch.broke) ──► store.set(KEY, why)        (the others see it)
                                                └─► the group's timeout := BROKEN_TIMEOUT_S
                                                    (DCP's next collective on it ends that soon)

Every survivor then leaves the exchange within :data:`POLL_S` of the first survivor's error
(immediate for a killed peer: the kernel closes its sockets), and ``dcp.load`` ends within
:data:`BROKEN_TIMEOUT_S` more, with DCP's collective error (its own error is logged). The group is
of no further use either way: one of its ranks is gone. A peer that hangs without dying (SIGSTOP)
breaks no connection and is not detected: the group's own timeout applies.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
from typing import Any

from ..errors import PeerReadError

__all__ = ["Watch", "POLL_S", "BROKEN_TIMEOUT_S", "attempt", "gather_objects"]

log = logging.getLogger("s3dcp")

POLL_S = 0.5  # how often a waiting rank asks the store whether a peer saw the group break
BROKEN_TIMEOUT_S = 10.0  # the group's timeout once it broke: DCP's collectives after read_data


def attempt() -> str:
    """This run of the job (torchrun's run id and restart count), for keys in the group's store: a
    key an earlier attempt set (a torchrun restart keeps the agent's store) never speaks for this one."""
    return f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}.{os.environ.get('TORCHELASTIC_RESTART_COUNT', '')}"


class Watch:
    """The waits of one cooperative load (or another exchange: ``what`` names it in messages) on
    ``group`` (``None``: the default group), ``key`` naming it in the group's store (the same on
    every rank). ``also``: other groups whose collectives follow these waits (DCP's, where the
    waits run on a group of their own); their timeout is shortened too when the group breaks."""

    def __init__(self, group: Any, key: str, what: str = "cooperative load", also: tuple = ()) -> None:
        import torch.distributed as dist

        self.pg = group if group is not None else dist.group.WORLD
        self.also = [g if g is not None else dist.group.WORLD for g in also]
        self.key = key
        self.what = what
        try:
            self.store = self.pg.get_group_store()
        except Exception:  # noqa: BLE001 - no store to share it through: peers wait for the group's timeout
            self.store = None
        self.rank = dist.get_rank(group)

    def wait(self, works: list) -> None:
        """Wait for every work of ``works``: their error, or :class:`PeerReadError` as soon as a
        peer said through the store that the group broke.

        The works are waited for on a thread of their own (gloo's point-to-point works say they
        are complete only once waited for), which hands over its error; this thread watches the
        store meanwhile. When the group broke, that thread is left blocked in gloo until the
        group's timeout: the works it holds then belong to a group nothing can use any more."""
        if not works:
            return
        done = threading.Event()
        failure: list[BaseException] = []

        def wait_all() -> None:
            try:
                for w in works:
                    w.wait()
            except BaseException as e:  # noqa: BLE001 - handed to the caller below
                failure.append(e)
            finally:
                done.set()

        threading.Thread(target=wait_all, name="s3dcp-exchange-wait", daemon=True).start()
        while not done.wait(POLL_S):
            self.check()
        if failure:
            raise failure[0]

    def check(self) -> None:
        """Raise :class:`PeerReadError` if a peer said the group broke (or the store is gone with it)."""
        if self.store is None:
            return
        try:
            said = self.store.get(self.key).decode(errors="replace") if self.store.check([self.key]) else None
        except Exception as e:  # noqa: BLE001 - the store's host (rank 0, or the agent) is gone
            said = f"the store is unreachable ({type(e).__name__}: {e})"
        if said is not None:
            raise PeerReadError(f"{self.what}: the process group broke ({said}); rank {self.rank} stopped too",
                                [])

    def broke(self, error: BaseException) -> None:
        """The group broke under this rank (``error``: its collective's, or the :class:`PeerReadError`
        of :meth:`check`): tell the others through the store when this rank saw it first, and
        shorten the group's timeout so that the collectives that follow (DCP's) end within
        :data:`BROKEN_TIMEOUT_S` instead of the group's own."""
        log.error("%s: rank %d stops, the process group is broken (%s: %s)", self.what, self.rank,
                  type(error).__name__, error)
        if self.store is not None and not isinstance(error, PeerReadError):
            try:
                self.store.set(self.key, f"rank {self.rank}: {type(error).__name__}: {str(error)[:300]}")
            except Exception:  # noqa: BLE001 - the store went with the dead rank: its peers see that
                pass
        for pg in (self.pg, *self.also):
            try:
                pg.set_timeout(datetime.timedelta(seconds=BROKEN_TIMEOUT_S))
            except Exception:  # noqa: BLE001 - a backend without it keeps the group's own timeout
                pass


def gather_objects(value: Any, group: Any, watch: Watch) -> list:
    """Every rank's ``value`` (picklable), in rank order: ``all_gather_object``, with each wait
    bounded by ``watch`` (a peer that dies or breaks the group ends it within seconds, instead of
    the group's timeout)."""
    import pickle

    import torch
    import torch.distributed as dist

    data = pickle.dumps(value)
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    watch.wait([dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=group, async_op=True)])
    longest = max(int(s) for s in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else mine[:0]
    every = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    watch.wait([dist.all_gather(every, mine, group=group, async_op=True)])
    # the peers' values are the job's own (the same program on every rank), never storage's
    return [pickle.loads(bytes(t[:int(n)].numpy())) for t, n in zip(every, sizes)]  # noqa: S301


def broadcast_bytes(data: bytes | None, src: int, group: Any, watch: Watch) -> bytes:
    """``data`` of rank ``src`` (its rank in ``group``) on every rank, each wait bounded by ``watch``."""
    import torch
    import torch.distributed as dist

    me = dist.get_rank(group)
    source = dist.get_global_rank(group, src) if group is not None else src
    size = torch.tensor([len(data) if me == src and data is not None else 0], dtype=torch.int64)
    watch.wait([dist.broadcast(size, source, group=group, async_op=True)])
    buffer = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if me == src and data
              else torch.empty(int(size), dtype=torch.uint8))
    if int(size):
        watch.wait([dist.broadcast(buffer, source, group=group, async_op=True)])
    return bytes(buffer.numpy())
