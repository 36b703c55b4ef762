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
import threading
from typing import Any

from ..errors import PeerReadError

__all__ = ["Watch", "POLL_S", "BROKEN_TIMEOUT_S"]

log = logging.getLogger("s3dcp")

POLL_S = 0.5  # how often a waiting rank asks the store whether a peer saw the group break
BROKEN_TIMEOUT_S = 10.0  # the group's timeout once it broke: DCP's collectives after read_data


class Watch:
    """The waits of one cooperative load on ``group`` (``None``: the default group), ``key``
    naming the load in the group's store (the same on every rank)."""

    def __init__(self, group: Any, key: str) -> None:
        import torch.distributed as dist

        self.pg = group if group is not None else dist.group.WORLD
        self.key = key
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
            raise PeerReadError(f"cooperative load: the process group broke ({said}); rank {self.rank} stopped too",
                                [])

    def broke(self, error: BaseException) -> None:
        """The group broke under this rank (``error``: its collective's, or the :class:`PeerReadError`
        of :meth:`check`): tell the others through the store when this rank saw it first, and
        shorten the group's timeout so that the collectives that follow (DCP's) end within
        :data:`BROKEN_TIMEOUT_S` instead of the group's own."""
        log.error("cooperative load: rank %d stops, the process group is broken (%s: %s)", self.rank,
                  type(error).__name__, error)
        if self.store is not None and not isinstance(error, PeerReadError):
            try:
                self.store.set(self.key, f"rank {self.rank}: {type(error).__name__}: {str(error)[:300]}")
            except Exception:  # noqa: BLE001 - the store went with the dead rank: its peers see that
                pass
        try:
            self.pg.set_timeout(datetime.timedelta(seconds=BROKEN_TIMEOUT_S))
        except Exception:  # noqa: BLE001 - a backend without it keeps the group's own timeout
            pass
