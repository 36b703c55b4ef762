"""The scripts in examples/ run as a user runs them (each starts its own embedded server)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from s3dcp._seaweed_process import _STOP_GRACE_S

from processes import no_process_mentions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


def _env() -> dict[str, str]:
    """No S3 settings (so the examples start their own server), this checkout first, loopback gloo."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    env["GLOO_SOCKET_IFNAME"] = "lo"
    return env


def _losses(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.multiproc
def test_train_fsdp2_is_killed_and_resumes_with_identical_losses(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                os.path.join(EXAMPLES, "train_fsdp2.py"), "--server-dir", str(tmp_path / "data"),
                "--steps", "8", "--every", "3"]
    crashed = subprocess.run([*torchrun, "--crash-at-step", "8", "--loss-log", str(tmp_path / "first.jsonl")],
                             capture_output=True, text=True, env=_env(), timeout=300, cwd=tmp_path)
    # The embedded server goes within its stop grace of its starter's death (weed's volume server
    # can wait ~30 s for the killed ranks' connections; the reaper SIGKILLs it after the grace).
    server_gone_by = time.monotonic() + _STOP_GRACE_S + 5
    assert crashed.returncode != 0 and "killed at step 8" in crashed.stderr, crashed.stdout + crashed.stderr
    first = {r["step"]: r["loss"] for r in _losses(tmp_path / "first.jsonl")}
    assert sorted(first) == list(range(1, 9))

    resumed = subprocess.run([*torchrun, "--loss-log", str(tmp_path / "second.jsonl")],
                             capture_output=True, text=True, env=_env(), timeout=300, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    second = _losses(tmp_path / "second.jsonl")
    start = second[0]["resumed_from"]
    assert start in (3, 6), start  # step 6 may have been uploading when the job was killed
    assert [r["step"] for r in second] == list(range(start + 1, 9))
    assert {r["step"]: r["loss"] for r in second} == {s: first[s] for s in range(start + 1, 9)}  # bit for bit
    assert "latest checkpoint s3://demo/fsdp2/step-00000006" in resumed.stdout
    no_process_mentions(tmp_path, by=server_gone_by)


def test_process_executor_example(tmp_path):
    done = subprocess.run([sys.executable, os.path.join(EXAMPLES, "process_executor.py")], capture_output=True,
                          text=True, env=_env(), timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("reloaded: identical") == 2 and "process executor: OK" in done.stdout
