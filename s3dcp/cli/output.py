"""How ``s3dcp`` commands print: JSON on stdout, aligned tables, human sizes and ages, and a progress
bar on stderr (tqdm, only on a terminal).

Names read from storage (checkpoint and object names, FQNs) are anyone's who could write the
bucket, so no text line shows them raw: :func:`shown` writes every character that is not
printable (ESC and every other control character, line breaks, bidirectional overrides) as its
Python escape, ``\x1b``, as error messages do with ``repr``. :func:`print_table` does so for
every cell; the commands pass each line that holds such a name through it. JSON escapes them
itself.
"""

from __future__ import annotations

import json
import sys
from typing import Any

__all__ = ["print_json", "print_table", "shown", "format_size", "format_age", "progress_bar"]


def print_json(value: Any) -> None:
    """``value`` as indented JSON on stdout, flushed."""
    json.dump(value, sys.stdout, indent=2)
    sys.stdout.write("\n")
    sys.stdout.flush()


def shown(value: Any) -> str:
    """``str(value)`` with every character that is not printable written as its Python escape
    (``"\x1b[2J"`` -> ``"\\x1b[2J"``): a name from storage cannot move the cursor, clear the
    screen or start a new line."""
    text = str(value)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def print_table(header: list[str], rows: list[list[Any]], indent: int = 0) -> None:
    """``rows`` under ``header`` in left-aligned columns (every cell through :func:`shown`), or ``(none)``."""
    if not rows:
        print(" " * indent + "(none)")
        return
    cells = [header] + [[shown(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    for row in cells:
        print(" " * indent + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())


def format_size(n: int) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"  # pragma: no cover


def format_age(seconds: float | None) -> str:
    """Seconds in the largest whole unit: ``5400`` -> ``"1h"``; None -> ``"-"``."""
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"


class _NoBar:
    def __enter__(self) -> "_NoBar":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def update(self, n: int = 1) -> None:
        pass


def progress_bar(total: int, unit: str, quiet: bool):
    """A tqdm bar on stderr when it is a terminal (and tqdm is installed), else nothing."""
    if quiet or not sys.stderr.isatty():
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, unit=unit, unit_scale=unit == "B", unit_divisor=1024 if unit == "B" else 1000,
                file=sys.stderr, leave=False)
