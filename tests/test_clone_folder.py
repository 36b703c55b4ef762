"""``import s3dcp`` from the folder that holds a clone named ``s3dcp`` (issue 39, row 13): the clone
folder has no ``__init__.py``, so Python takes it for a namespace package, and setuptools' default
editable install (an import hook consulted after the path) lost to it (``s3dcp.save`` raised
AttributeError). scripts/env.sh installs with ``editable_mode=compat``: the clone is on sys.path,
and a regular package there wins over a namespace portion."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import s3dcp

ROOT = Path(__file__).resolve().parent.parent


def test_import_from_the_folder_holding_a_clone_named_s3dcp_finds_the_package(tmp_path):
    (tmp_path / "s3dcp").mkdir()  # a folder named s3dcp, as a clone of the repository would be
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # as a user's shell has it
    out = subprocess.run([sys.executable, "-c", "import s3dcp; print(s3dcp.__file__); print(callable(s3dcp.save))"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(Path(s3dcp.__file__)), "True"], out.stdout
