"""The scripts in examples/ run as a user runs them: with no endpoint configured (each starts its own
embedded server) and with one configured (as "Try it locally" leaves it: they use its s3://demo),
without a warning."""

from __future__ import annotations

import json
import os
import re
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


def _configured_env(s3_server) -> dict[str, str]:
    """An endpoint and its credentials in the environment, as ``eval "$(s3dcp server --print-env)"`` leaves."""
    return {**_env(), **s3_server.env()}


def _no_warnings(output: str) -> None:
    """Our examples print none of torch's (or anyone's) warnings: Python's ("UserWarning: ..."),
    those Lightning prints without their category ("path/x.py:224: You're resuming ..." or "...
    is deprecated"), and log records at level WARNING (torchtitan's "[titan] ... - WARNING - ...")."""
    for mark in ("Warning", "deprecated", " WARNING "):
        assert mark not in output, output
    located = [line for line in output.splitlines() if re.match(r"\S+\.py:\d+: ", line)]
    assert not located, "\n".join(located)


def _losses(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.multiproc
def test_train_fsdp2_is_killed_and_resumes_from_the_nodes_copy_with_identical_losses(tmp_path):
    """With the local tier on: saves at 2 (S3 too), 4 and 6 (the node only: --s3-every 3), killed at 8;
    the next run resumes from the node's copy of 4 or 6, nothing read from S3."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                os.path.join(EXAMPLES, "train_fsdp2.py"), "--server-dir", str(tmp_path / "data"),
                "--steps", "8", "--every", "2", "--local-dir", str(tmp_path / "node"), "--s3-every", "3"]
    crashed = subprocess.run([*torchrun, "--crash-at-step", "8", "--loss-log", str(tmp_path / "first.jsonl")],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), timeout=300,
                             cwd=tmp_path)  # one stream, as a terminal shows it
    # The embedded server goes within its stop grace of its starter's death (weed's volume server
    # can wait ~30 s for the killed ranks' connections; the reaper SIGKILLs it after the grace).
    server_gone_by = time.monotonic() + _STOP_GRACE_S + 5
    lines = crashed.stdout.splitlines()
    killed = [i for i, line in enumerate(lines) if "killed at step" in line]
    assert crashed.returncode != 0 and len(killed) == 1, crashed.stdout
    # its own line, after the loss line of step 8 (it used to land in the middle of it)
    assert lines[killed[0]] == "# every rank is killed at step 8 (--crash-at-step)", lines[killed[0]]
    assert any(line.startswith("step   8  loss") and line.endswith(")") for line in lines[:killed[0]]), lines
    first = {r["step"]: r["loss"] for r in _losses(tmp_path / "first.jsonl")}
    assert sorted(first) == list(range(1, 9))

    resumed = subprocess.run([*torchrun, "--loss-log", str(tmp_path / "second.jsonl")],
                             capture_output=True, text=True, env=_env(), timeout=300, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    second = _losses(tmp_path / "second.jsonl")
    start = second[0]["resumed_from"]
    assert start in (4, 6), start  # step 6 may have been being written when the job was killed
    assert [r["step"] for r in second] == list(range(start + 1, 9))
    assert {r["step"]: r["loss"] for r in second} == {s: first[s] for s in range(start + 1, 9)}  # bit for bit
    assert f"resumed from step {start} of s3://demo/fsdp2, read from the local tier (" in resumed.stdout
    assert " from peer nodes, 0 from S3)" in resumed.stdout, resumed.stdout
    # the resumed run's first save goes to S3 (6 or 8), its next one stays on the node (8, from step 4);
    # the node-only steps of the first run (4, and 6 if it was resumed from) never reached S3
    if start == 6:
        done = ("S3 holds step(s) 2, 8 of s3://demo/fsdp2; this run's last save, step 8, is there (and on the "
                "nodes)")
    else:
        done = (f"S3 holds step(s) 2, 6 of s3://demo/fsdp2; this run's last save, step 8, is on the nodes only "
                f"({tmp_path / 'node'}), not in S3")
    assert f"# done at step 8; {done}" in resumed.stdout, resumed.stdout
    _no_warnings(resumed.stdout + resumed.stderr)
    no_process_mentions(tmp_path, by=server_gone_by)


def test_every_example_takes_uri_for_where_it_saves():
    """The README says the examples take --uri: torchtitan_s3.py took only --folder and
    lightning_s3.py only --root ("unrecognized arguments: --uri"). Those stay as other names."""
    names = sorted(n for n in os.listdir(EXAMPLES) if n.endswith(".py"))
    assert len(names) == 7, names  # an example added or gone: check it here, and the README's list
    helps = {name: subprocess.Popen([sys.executable, os.path.join(EXAMPLES, name), "--help"], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env=_env()) for name in names}  # all at once
    for name, process in helps.items():
        out, err = process.communicate(timeout=120)
        assert process.returncode == 0, (name, err)
        assert re.search(r"^\s+--uri\b", out, re.M), (name, out)


@pytest.mark.multiproc
def test_train_fsdp2_uses_a_configured_endpoint_and_says_why_another_width_cannot_resume(tmp_path, s3_server,
                                                                                        demo_bucket):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                os.path.join(EXAMPLES, "train_fsdp2.py"), "--steps", "3", "--every", "3"]
    env = _configured_env(s3_server)
    first = subprocess.run(torchrun, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    assert f"the configured S3 endpoint {s3_server.endpoint_url}" in first.stdout
    assert "latest checkpoint s3://demo/fsdp2/step-00000003" in first.stdout
    assert not (tmp_path / "s3dcp-example-data").exists()  # no embedded server was started
    _no_warnings(first.stdout + first.stderr)
    # run again once finished: it says there is nothing to do (it printed "resumed from" and exited 0)
    again = subprocess.run([*torchrun, "--crash-at-step", "2"], capture_output=True, text=True, env=env, timeout=300,
                           cwd=tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert ("# nothing left to train: s3://demo/fsdp2 already holds step 3, and --steps is 3; --crash-at-step 2 is "
            "never reached. Give a larger --steps") in again.stdout, again.stdout
    assert not [line for line in again.stdout.splitlines() if line.startswith("step ")], again.stdout  # no training
    other = subprocess.run([*torchrun, "--width", "32", "--steps", "6"], capture_output=True, text=True, env=env,
                           timeout=300, cwd=tmp_path)
    assert other.returncode != 0
    assert "cannot resume from s3://demo/fsdp2/step-00000003" in other.stderr, other.stderr
    assert "kept between runs" in other.stderr and "another --width" in other.stderr


def test_process_executor_example(tmp_path):
    done = subprocess.run([sys.executable, os.path.join(EXAMPLES, "process_executor.py")], capture_output=True,
                          text=True, env=_env(), timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("reloaded: identical") == 2 and "process executor: OK" in done.stdout
    assert "# embedded S3 server on" in done.stdout
    _no_warnings(done.stdout + done.stderr)


def test_process_executor_example_uses_a_configured_endpoint(tmp_path, s3_server, demo_bucket):
    done = subprocess.run([sys.executable, os.path.join(EXAMPLES, "process_executor.py")], capture_output=True,
                          text=True, env=_configured_env(s3_server), timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr  # it used to exit 1 asking for --uri
    assert f"the configured S3 endpoint {s3_server.endpoint_url}; checkpoints under s3://demo/process-executor" \
        in done.stdout
    assert done.stdout.count("reloaded: identical") == 2 and "process executor: OK" in done.stdout
    _no_warnings(done.stdout + done.stderr)
