"""Make TorchSnapshot find the ``s3dcp`` storage plugin as an installed s3dcp declares it.

TorchSnapshot resolves ``s3dcp://`` through the ``storage_plugins`` entry point group. An
environment whose s3dcp was installed before the entry point existed (or from another
checkout) lacks it; :func:`entry_point_dir` writes a minimal ``*.dist-info`` that declares the
entry point exactly as this checkout's pyproject.toml does, for tests and example scripts to
put on ``sys.path`` / ``PYTHONPATH``. Returns None when the environment already has it.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
GROUP = "storage_plugins"


def declared_entry_point() -> tuple[str, str]:
    """(name, value) of the storage_plugins entry point in pyproject.toml."""
    # (a regex, not tomllib: Python 3.10 has no TOML parser and the section is two lines)
    section = re.search(r'^\[project\.entry-points\."?' + GROUP + r'"?\]\n(.*?)(?=^\[|\Z)', PYPROJECT.read_text(),
                        re.M | re.S)
    entries = re.findall(r'^\s*([\w.-]+)\s*=\s*"([^"]+)"', section.group(1), re.M) if section else []
    if len(entries) != 1:
        raise AssertionError(f"{PYPROJECT}: expected one [project.entry-points.\"{GROUP}\"] entry, found {entries}")
    return entries[0]


def entry_point_dir() -> str | None:
    from importlib_metadata import entry_points  # what torchsnapshot uses

    name, value = declared_entry_point()
    if any(ep.name == name and ep.value == value for ep in entry_points(group=GROUP)):
        return None
    root = tempfile.mkdtemp(prefix="s3dcp-entry-points-")
    info = os.path.join(root, "s3dcp_test_entry_points-0.dist-info")
    os.makedirs(info)
    Path(info, "METADATA").write_text("Metadata-Version: 2.1\nName: s3dcp-test-entry-points\nVersion: 0\n")
    Path(info, "entry_points.txt").write_text(f"[{GROUP}]\n{name} = {value}\n")
    return root


@contextmanager
def entry_point_on_path():
    """:func:`entry_point_dir` on ``sys.path`` for the duration (nothing when not needed)."""
    path = entry_point_dir()
    if path is not None:
        sys.path.append(path)
    try:
        yield
    finally:
        if path is not None:
            sys.path.remove(path)
