"""The README's commands and snippets run as written, against the session's server: an edit
that breaks one fails here. ``s3://bucket/`` in a snippet becomes a fresh bucket; ``s3dcp`` and
``python`` are this checkout's."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import pytest
import torch

import s3dcp
from s3dcp import CheckpointManager
from s3dcp import cli
from s3dcp import localserver

from doc_pages import ROOT, aws_env, blocks as _blocks, fresh_bucket as _fresh_bucket, in_bucket as _in, section as _section, tiny_lightning_model  # noqa: F401,E501


# ------------------------------------------------------------------ Quick start
def test_the_quick_start_is_the_two_scripts_and_by_hand_the_same_steps():
    """The two commands are there (CI runs scripts/test through .ci/run); the manual steps install
    what they install and run what they run."""
    two = _blocks("Quick start", "bash")[0]
    assert [line.split("#")[0].split() for line in two.splitlines()] == [["scripts/demo"], ["scripts/test"]]
    for name in ("demo", "test"):
        assert os.access(os.path.join(ROOT, "scripts", name), os.X_OK), name
    (manual,) = _blocks("By hand", "bash")
    steps = [line.split("#")[0].strip() for line in manual.splitlines()]
    with open(os.path.join(ROOT, "scripts", "env.sh"), encoding="utf-8") as f:
        env_sh = f.read()
    torch_spec = re.search(r"TORCH_SPEC:-([^}]+)}", env_sh).group(1)
    assert f"pip install {torch_spec}" in steps  # the same torch, from the configured index
    assert "--index-url" not in " ".join(steps)
    with open(os.path.join(ROOT, "scripts", "demo"), encoding="utf-8") as f:
        demo = f.read()
    with open(os.path.join(ROOT, "scripts", "test"), encoding="utf-8") as f:
        test = f.read()
    compat = "--config-settings editable_mode=compat"  # the clone on sys.path (tests/test_clone_folder.py)
    assert f'-e "$root[$extras]" {compat}' in env_sh
    assert "s3dcp_env bench" in demo and f"pip install -e '.[bench]' {compat}" in steps
    assert "benchmarks/train_loop.py" in demo and "python benchmarks/train_loop.py" in steps
    assert "s3dcp_env test" in test and "-m pytest" in test and f"pip install -e '.[test]' {compat} && pytest" in steps
    quick = _section("Quick start")
    assert re.search(r"`scripts/test` takes \d+–\d+ minutes on a 2-core machine", quick), quick  # how long to wait
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        assert "exec scripts/test --full " in f.read()  # CI runs the full set ...
    assert "`scripts/test --full` also runs the `full` set" in quick and "CI (`.ci/run`) runs that" in quick  # ... as said
    assert "leaves nothing in `.pytest-tmp/` when it passes" in quick  # tests/test_suite_cleanup.py



# ------------------------------------------------------------------ Try it locally in three commands
def test_try_it_locally_runs_as_written(s3_server, boto3_client, tmp_path):
    """The three commands in a shell whose ``s3dcp server`` is the session's server: a state
    file names it (the stand-in pid a sleeping process, so a --stop would end only that)."""
    (block,) = _blocks("Try it locally", "bash")
    lines = [line for line in block.splitlines() if line.strip()]
    assert [line.split()[0] for line in lines] == ["eval", "python", "s3dcp"], lines
    if "demo" in [b["Name"] for b in boto3_client.list_buckets()["Buckets"]]:  # from an earlier run: start bare
        for obj in boto3_client.list_objects_v2(Bucket="demo").get("Contents", []):
            boto3_client.delete_object(Bucket="demo", Key=obj["Key"])
        boto3_client.delete_bucket(Bucket="demo")

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, argv in (("python", [sys.executable]), ("s3dcp", [sys.executable, "-m", "s3dcp.cli"])):
        (bin_dir / name).write_text(f"#!/bin/sh\nexec {shlex.join(argv)} \"$@\"\n")
        (bin_dir / name).chmod(0o755)
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o700)
    stand_in = subprocess.Popen(["sleep", "600"])
    try:
        (state_dir / "server.json").write_text(json.dumps({
            "pid": stand_in.pid, "start_mark": localserver._start_mark(stand_in.pid),  # recorded as a server would
            "weed_pid": s3_server.pid, "endpoint_url": s3_server.endpoint_url,
            "buckets": [], "data_dir": str(tmp_path), "env": s3_server.env()}))
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}  # only the eval points at S3
        env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", S3DCP_STATE_DIR=str(state_dir),
                   PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
        done = subprocess.run(["bash", "-c", "set -euo pipefail\n" + block], capture_output=True, text=True,
                              env=env, cwd=tmp_path, timeout=180)
        again = subprocess.run(["bash", "-c", "set -euo pipefail\n" + block], capture_output=True, text=True,
                               env=env, cwd=tmp_path, timeout=180)  # the server still runs: as the README says
    finally:
        stand_in.kill()
        stand_in.wait()
        for path in state_dir.glob("*.json"):  # a server the block started itself (the stand-in not taken): stop it
            pid = json.loads(path.read_text()).get("pid")
            if pid != stand_in.pid:
                subprocess.run([sys.executable, "-m", "s3dcp.cli", "server", "--stop", "--pid", str(pid)], env=env,
                               capture_output=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"pid {stand_in.pid}" in done.stderr and "created now: s3://demo" in done.stderr, done.stderr
    (shown,) = _blocks("Try it locally", "text")  # what the README says `s3dcp ls` prints: exactly that, but the age
    assert _ageless(done.stdout) == _ageless(shown), (shown, done.stdout)
    assert again.returncode != 0 and "CheckpointExistsError" in again.stderr, again.stdout + again.stderr
    out = {"w": torch.zeros(3)}
    s3dcp.load(out, "s3://demo/run1/step-1", config=s3_server.s3_config())
    assert torch.equal(out["w"], torch.ones(3))


def _ageless(listing: str) -> list[list[str]]:
    """The words of an ``s3dcp ls`` listing, line by line, the AGE column's (``2s``, ``5m``) made ``AGE``."""
    return [[re.sub(r"^\d+[smhd]$", "AGE", word) for word in line.split()] for line in listing.splitlines()
            if line.strip()]


# ------------------------------------------------------------------ Use
def test_the_one_call_snippets_run_as_written(aws_env, s3_server):
    one_call, catching, with_dcp = _blocks("Use", "python")[:3]
    assert "s3dcp.save(" in one_call and "except s3dcp.CheckpointNotFoundError" in catching
    assert "storage_writer=S3StorageWriter" in with_dcp

    bucket = _fresh_bucket(s3_server)
    saved = {"model": {"w": torch.randn(8, 4), "b": torch.randn(4)}, "step": 1000}
    state = {"model": {k: v.clone() for k, v in saved["model"].items()}, "step": 1000}
    exec(_in(one_call, bucket), {"state_dict": state})  # noqa: S102 - the README's own code
    for step in ("step-1000", "step-2000"):
        out = {"model": {k: torch.zeros_like(v) for k, v in saved["model"].items()}, "step": 0}
        s3dcp.load(out, f"s3://{bucket}/run7/{step}")
        assert torch.equal(out["model"]["w"], saved["model"]["w"]) and out["step"] == 1000

    fresh: list[str] = []
    exec(_in(catching, bucket), {"s3dcp": s3dcp, "state_dict": state, "start_fresh": lambda: fresh.append("x")})
    assert fresh == []  # it is there
    empty = _fresh_bucket(s3_server)
    exec(_in(catching, empty), {"s3dcp": s3dcp, "state_dict": state, "start_fresh": lambda: fresh.append("x")})
    assert fresh == ["x"]  # nothing there: the except clause caught it

    exec(_in(with_dcp, empty), {"state_dict": state})  # noqa: S102
    out = {"model": {k: torch.zeros_like(v) for k, v in saved["model"].items()}, "step": 0}
    s3dcp.load(out, f"s3://{empty}/run7/step-2000")
    assert torch.equal(out["model"]["b"], saved["model"]["b"])


def test_the_resume_recipe_runs_and_resumes(aws_env, s3_server):
    (recipe,) = _blocks("Checkpoint every N steps", "python")
    bucket = _fresh_bucket(s3_server)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    steps: list[int] = []
    scope = {"model": model, "optimizer": optimizer, "cfg": s3_server.s3_config(), "total_steps": 2000,
             "train_step": lambda: steps.append(1)}
    exec(_in(recipe, bucket), scope)  # noqa: S102
    assert scope["start"] == 0 and len(steps) == 2000
    weight = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.zero_()
    steps.clear()
    exec(_in(recipe, bucket), scope)  # noqa: S102 - run again: resumes at the last checkpoint
    assert scope["start"] == 2000 and steps == [] and torch.equal(model.weight, weight)
    assert [c.step for c in scope["manager"].list()] == [1000, 2000]


def test_the_stall_snippet_stages_in_the_background_and_saves_the_state_of_each_save(aws_env, s3_server,
                                                                                      monkeypatch):
    """The loop of "The stall": background staging (a 256 KiB weight is copied on the staging
    thread, slowed down here), the wait before each optimizer step, the checkpoints as they were."""
    import time

    from s3dcp.saving import background

    (snippet,) = _blocks("The stall: staging behind the next step", "python")
    bucket = _fresh_bucket(s3_server)
    monkeypatch.setattr(background, "_seam", lambda phase: time.sleep(0.2) if phase == "copying" else None)
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(8, 256)
    scope = {"model": model, "optimizer": optimizer, "cfg": s3_server.s3_config(), "total_steps": 6,
             "batches": iter(lambda: x, None)}
    code = _in(snippet, bucket).replace("step % 1000 == 0", "step % 3 == 0")  # 2 saves, not 2,000 steps
    assert code.count("step % 3 == 0") == 1
    exec(code, scope)  # noqa: S102
    manager = scope["manager"]
    assert manager.config.staging == "background" and [c.step for c in manager.list()] == [3, 6]
    loaded = torch.nn.Linear(256, 256)
    manager.load({"model": loaded, "optim": torch.optim.AdamW(loaded.parameters(), lr=1e-3)}, step=6)
    assert torch.equal(loaded.weight, model.weight)  # the last save: no optimizer step since


def test_the_local_tier_snippet_keeps_steps_on_the_node_and_restarts_from_there(aws_env, s3_server, tmp_path):
    (snippet,) = _blocks("Restart from the nearest copy", "python")
    bucket = _fresh_bucket(s3_server)
    code = _in(snippet, bucket).replace('"/dev/shm/run7"', repr(str(tmp_path / "run7")))
    scope = {"CheckpointManager": CheckpointManager, "cfg": s3_server.s3_config()}
    exec(code, scope)  # noqa: S102 - the README's own code
    state = {"w": torch.arange(10.0)}
    with scope["manager"] as manager:
        for step in (1, 2):  # step 1 goes to S3 too (the first of every s3_every); step 2 stays on the node
            state["w"].add_(1)
            manager.save(step, state)
    exec(code, scope)  # noqa: S102 - the restarted job's manager
    out = {"w": torch.zeros(10)}
    assert scope["manager"].load(out) == 2 and torch.equal(out["w"], state["w"])
    assert scope["manager"].last_load_stats["tier"] == "local"
    assert [c.step for c in scope["manager"].list() if c.committed] == [1]  # in S3: step 1 only


# ------------------------------------------------------------------ The s3dcp command
def test_every_cli_line_runs(aws_env, s3_server, tmp_path, monkeypatch, capsys):
    """Each line of the command block, flags and all (``--older-than 1h``, ``--to-torch-save``),
    on two checkpoints made for it; ``rm`` last, the server lines by the test above and test_cli."""
    (block,) = _blocks("The `s3dcp` command", "bash")
    bucket = _fresh_bucket(s3_server)
    state = {"model": {"w": torch.randn(16, 8)}, "step": 1}
    s3dcp.save(state, f"s3://{bucket}/run7/step-00001000", item_checksum="crc64nvme")
    state["step"] = 2
    s3dcp.save(state, f"s3://{bucket}/run7/step-00002000", incremental_from=f"s3://{bucket}/run7/step-00001000")
    local_dir = tmp_path / "shm-run7"  # the node's copies --local-dir shows: 3000 also in S3, 4000 only there
    with CheckpointManager(f"s3://{bucket}/run7", local_dir=local_dir, s3_every=2, async_mode=False) as manager:
        for step in (3000, 4000):
            manager.save(step, state)
    lines = [shlex.split(_in(line, bucket).replace("/dev/shm/run7", str(local_dir)) if "s3://bucket" in line else line,
                         comments=True) for line in block.splitlines()]
    commands = [argv[1:] for argv in lines if argv and argv[0] == "s3dcp"]
    run = [c for c in commands if c[0] not in ("server", "rm")] + [c for c in commands if c[0] == "rm"]
    assert {c[0] for c in run} >= {"ls", "inspect", "verify", "materialize", "gc", "download", "export", "mb",
                                   "rm"}
    monkeypatch.chdir(tmp_path)
    for argv in run:
        capsys.readouterr()
        code = cli.main(argv)
        out, err = capsys.readouterr()
        assert code == 0, (argv, out, err)
    loaded = torch.load(tmp_path / "model.pt", weights_only=True)
    assert torch.equal(loaded["model"]["w"], state["model"]["w"])
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    assert [c.step for c in s3dcp.CheckpointManager(f"s3://{bucket}/run7").list()] == [2000, 3000]


# ------------------------------------------------------------------ Trainers
def test_the_trainer_snippets_run_as_written(aws_env, s3_server):
    titan, lightning = _blocks("Trainers: torchtitan", "python")
    bucket = _fresh_bucket(s3_server)
    found: dict = {}
    exec(_in(titan, bucket), found)  # noqa: S102 - the README's own code
    config = found["checkpoint"]
    assert (config.folder, config.keep_latest_k, config.incremental) == (f"s3://{bucket}/run", 3, True)

    first: dict = {"model": tiny_lightning_model(8, batch_size=4, lr=0.1)}
    exec(_in(lightning, bucket), first)  # noqa: S102 - 3 epochs, checkpoints in the bucket
    assert first["trainer"].global_step == 6
    again: dict = {"model": tiny_lightning_model(8, batch_size=4, lr=0.1)}
    exec(_in(lightning, bucket), again)  # noqa: S102 - resumes from last: nothing left to train
    assert again["trainer"].global_step == 6
    assert torch.equal(again["model"].net.weight, first["model"].net.weight)
