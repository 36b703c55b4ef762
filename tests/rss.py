"""Peak RSS of this process during a block (tests that bound a load's memory)."""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import psutil


class RssRise:
    """``.bytes``: the highest RSS seen during the block minus the RSS when it began."""

    bytes = 0


@contextlib.contextmanager
def rss_rise(interval_s: float = 0.002) -> Iterator[RssRise]:
    """Sample RSS every ``interval_s`` on a thread while the block runs; the final RSS counts too."""
    me = psutil.Process()
    before = me.memory_info().rss
    peak = [before]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(interval_s):
            peak[0] = max(peak[0], me.memory_info().rss)

    result = RssRise()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield result
    finally:
        stop.set()
        sampler.join()
        result.bytes = max(peak[0], me.memory_info().rss) - before
