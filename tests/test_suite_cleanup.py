"""The suite leaves nothing in ``.pytest-tmp`` after a run that passes (a run left 144 MiB there),
and keeps only a failed test's tmp_path dir after one that fails; a test marked ``full`` runs
only with ``--full``: checked on a small session of its own, with this checkout's pytest settings
and tests/conftest.py, in a base temp dir of its own."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_TESTS = '''
import pytest


@pytest.mark.full
def test_in_the_full_set_only(tmp_path):
    (tmp_path / "ran").write_text("with --full")
    assert False


def test_passes(tmp_path):
    (tmp_path / "data").write_bytes(b"x" * 1_000_000)


def test_fails(tmp_path):
    (tmp_path / "kept").write_text("look at me")
    assert False
'''


def _session(tmp_path, *args: str) -> subprocess.CompletedProcess:
    inner = tmp_path / "inner"
    inner.mkdir(exist_ok=True)
    (inner / "test_inner.py").write_text(_TESTS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "tests"), ROOT])}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c",
                           os.path.join(ROOT, "pyproject.toml"), "-p", "conftest", f"--basetemp={tmp_path / 'base'}",
                           str(inner / "test_inner.py"), *args], capture_output=True, text=True, env=env,
                          cwd=inner, timeout=300)


def test_a_passing_run_leaves_no_base_temp_dir_and_skips_the_full_set(tmp_path):
    done = _session(tmp_path, "-k", "passes or full_set")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed, 1 skipped" in done.stdout, done.stdout
    assert "in the full set only: scripts/test --full" in done.stdout, done.stdout  # -ra says why
    assert not (tmp_path / "base").exists(), list((tmp_path / "base").rglob("*"))


def test_a_failing_run_keeps_only_the_failed_tests_dirs_and_full_runs_the_full_set(tmp_path):
    done = _session(tmp_path, "--full")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "2 failed, 1 passed" in done.stdout, done.stdout
    left = sorted(p.relative_to(tmp_path / "base").as_posix() for p in (tmp_path / "base").rglob("*") if p.is_file())
    assert left == ["test_fails0/kept", "test_in_the_full_set_only0/ran"], left
