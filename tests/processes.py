"""Whether processes a test started are gone: found by a path on their command line (the
test's own tmp dir), never by a program's name, so other work on the machine is not counted."""

from __future__ import annotations

import time

import psutil

__all__ = ["no_process_mentions"]


def no_process_mentions(path, by: float = 0.0) -> None:
    """No process mentions ``path`` by ``by`` (a ``time.monotonic()``; now if it has passed)."""
    while True:
        left = [p.pid for p in psutil.process_iter(["cmdline", "status"])
                if p.info["status"] != psutil.STATUS_ZOMBIE and any(str(path) in a for a in p.info["cmdline"] or [])]
        if not left or time.monotonic() > by:
            break
        time.sleep(0.2)
    assert left == [], f"processes still running on {path}: {left}"
