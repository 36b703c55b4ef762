"""Processes a test starts: whether they are gone (found by a path on their command line, the
test's own tmp dir, never by a program's name, so other work on the machine is not counted), and
a command line that Ctrl-C (SIGINT) interrupts whatever the caller's signal dispositions."""

from __future__ import annotations

import time

import psutil

__all__ = ["interruptible", "no_process_mentions"]


def no_process_mentions(path, by: float = 0.0) -> None:
    """No process mentions ``path`` by ``by`` (a ``time.monotonic()``; now if it has passed)."""
    while True:
        left = [p.pid for p in psutil.process_iter(["cmdline", "status"])
                if p.info["status"] != psutil.STATUS_ZOMBIE and any(str(path) in a for a in p.info["cmdline"] or [])]
        if not left or time.monotonic() > by:
            break
        time.sleep(0.2)
    assert left == [], f"processes still running on {path}: {left}"


def interruptible(argv: list[str]) -> list[str]:
    """``[python, "-m", module, *args]`` as a command line whose Python turns SIGINT into
    KeyboardInterrupt, as it does when started from a terminal. A background job of a
    non-interactive shell (``scripts/test &`` in a script) inherits SIGINT *ignored*, and Python
    then installs no handler of its own: a test that interrupts such a child would wait for it in
    vain. The product keeps an inherited SIG_IGN, as programs should (such a job is not meant to
    get the terminal's Ctrl-C; ``s3dcp server --stop`` sends SIGTERM)."""
    python, flag, module, *args = argv
    if flag != "-m":
        raise ValueError(f"interruptible() takes [python, '-m', module, ...], not {argv!r}")
    code = ("import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
            f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)")
    return [python, "-c", code, *args]
