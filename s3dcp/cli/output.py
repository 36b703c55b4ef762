from __future__ import annotations

import json
import sys
from typing import Any


# ---------------------------------------------------------------------- output helpers
def _print_json(value: Any) -> None:
    json.dump(value, sys.stdout, indent=2)
    sys.stdout.write("\n")
    sys.stdout.flush()


def _table(header: list[str], rows: list[list[Any]], indent: int = 0) -> None:
    if not rows:
        print(" " * indent + "(none)")
        return
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    for row in cells:
        print(" " * indent + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"  # pragma: no cover


def _age(seconds: float | None) -> str:
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


def _progress(total: int, unit: str, quiet: bool):
    """A tqdm bar on stderr when it is a terminal (and tqdm is installed), else nothing."""
    if quiet or not sys.stderr.isatty():
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, unit=unit, unit_scale=unit == "B", unit_divisor=1024 if unit == "B" else 1000,
                file=sys.stderr, leave=False)
