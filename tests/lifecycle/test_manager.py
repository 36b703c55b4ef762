"""CheckpointManager against the real server: retention, failed saves, latest/resume, two ranks."""

from __future__ import annotations

import ast
import concurrent.futures
import logging
import os
import re
import socket
import time
from concurrent.futures import Future
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from s3dcp import CheckpointManager, S3Config
from s3dcp.s3.client import S3Client
from s3dcp.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConfigError,
    IncompleteCheckpointError,
    S3ServerError,
)
from s3dcp.lifecycle.manager import delete_checkpoint
from s3dcp.uri import parse_s3_uri


def _state(step: int) -> dict:
    return {"w": torch.full((16, 8), float(step)), "b": torch.arange(5) * step, "step": step}


def _dirs(boto3_client, bucket, prefix="run/") -> dict[str, list[str]]:
    """Directory -> sorted object names, straight from the bucket (not through s3dcp)."""
    out: dict[str, list[str]] = {}
    resp = boto3_client.list_objects_v2(Bucket=bucket, Prefix=prefix)
    for obj in resp.get("Contents", []):
        directory, _, name = obj["Key"][len(prefix):].rpartition("/")
        out.setdefault(directory, []).append(name)
    return {k: sorted(v) for k, v in out.items()}


def _committed(dirs: dict[str, list[str]]) -> list[str]:
    return sorted(d for d, names in dirs.items() if ".metadata" in names)


class _FlakyCommit(S3Client):
    """A client whose commit (the .metadata PUT) fails while ``fail_commit`` is set."""

    fail_commit = False

    def put(self, bucket, key, data, **kwargs):
        if self.fail_commit and key.endswith("/.metadata"):
            f: Future = Future()
            f.set_exception(S3ServerError("PutObject failed: injected", operation="PutObject", bucket=bucket, key=key))
            return f
        return super().put(bucket, key, data, **kwargs)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def s3dcp_log():
    """Messages logged to the "s3dcp" logger (pytest's own log capture is off in these runs)."""
    logger, handler = logging.getLogger("s3dcp"), _Records()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler.lines
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_keep_last_keeps_exactly_the_newest_committed(bucket, s3_config, boto3_client, s3dcp_log):
    with CheckpointManager(f"s3://{bucket}/run", config=s3_config, keep_last=3) as manager:
        futures = [manager.save(step, _state(step)) for step in range(1, 7)]
    for step in range(1, 7):  # one INFO line per checkpoint (the writer's), with its figures
        lines = [line for line in s3dcp_log if f"step-{step:08d}" in line and "committed" in line]
        assert len(lines) == 1 and re.search(
            r": \d+ bytes from 1 rank\(s\); this rank: stall [\d.]+ s, upload [\d.]+ s, [\d.]+ GB/s$", lines[0]), lines
    assert not any(s3_config.secret_access_key in line for line in s3dcp_log)
    assert all(isinstance(f, Future) and f.done() and f.exception() is None for f in futures)
    dirs = _dirs(boto3_client, bucket)
    assert sorted(dirs) == ["step-00000004", "step-00000005", "step-00000006"]
    assert all(len(names) == 2 and names[0] == ".metadata" and names[1].endswith(".distcp") for names in dirs.values())
    infos = manager.list()
    assert [(i.step, i.committed, i.objects) for i in infos] == [(4, True, 2), (5, True, 2), (6, True, 2)]
    assert infos[0].uri == f"s3://{bucket}/run/step-00000004" and infos[0].bytes > 0 and infos[0].last_modified
    out = _state(0)
    assert manager.load(out) == 6
    assert torch.equal(out["w"], _state(6)["w"]) and out["step"] == 6
    assert manager.load(out, step=4) == 4 and torch.equal(out["b"], _state(4)["b"])


def test_keep_every_also_keeps_multiples(bucket, s3_config, boto3_client):
    manager = CheckpointManager(f"s3://{bucket}/run", config=s3_config, keep_last=2, keep_every=3,
                                async_mode=False, name_format="ckpt/{step}")
    for step in range(1, 8):
        assert manager.save(step, _state(step)) is None  # sync: committed on return
    assert _committed(_dirs(boto3_client, bucket)) == ["ckpt/3", "ckpt/6", "ckpt/7"]
    assert manager.latest() == 7
    manager.close()


def test_close_closes_the_client_the_manager_made_never_one_passed_in(bucket, s3_config):
    made = CheckpointManager(f"s3://{bucket}/run", config=s3_config, keep_last=1)
    made.save(1, _state(1))
    made.wait()
    assert made.client._use.native is not None
    made.close()
    assert made.client._use.native is None  # let go of at close, not by a finalizer some day
    given = S3Client(s3_config)
    with CheckpointManager(f"s3://{bucket}/run", client=given, keep_last=1) as manager:
        manager.save(2, _state(2))
    with pytest.raises(ValueError, match="on its way out"):
        with CheckpointManager(f"s3://{bucket}/run", client=given, keep_last=1) as manager:
            manager.save(3, _state(3))
            raise ValueError("on its way out")
    assert given._use.native is not None and manager.latest() == 3  # the caller's client stays open
    given.close()
    with CheckpointManager(f"s3://{bucket}/run", config=s3_config) as manager:
        assert manager.latest() == 3
    assert manager.client._use.native is None


def test_a_failed_save_never_deletes_older_good_ones(bucket, s3_config, boto3_client):
    client = _FlakyCommit(s3_config)
    manager = CheckpointManager(f"s3://{bucket}/run", client=client, keep_last=1)
    manager.save(1, _state(1))
    manager.wait()
    client.fail_commit = True
    future = manager.save(2, _state(2))
    try:
        manager.wait()
    except Exception as e:  # noqa: BLE001 - s3dcp's error, not DCP's BaseException: except Exception catches it
        caught = e
    assert isinstance(caught, S3ServerError) and "injected" in str(caught) and caught.key.endswith("/.metadata")
    assert caught.failed_ranks == [0] and isinstance(caught.checkpoint_exception, CheckpointException)
    assert future.exception() is caught
    dirs = _dirs(boto3_client, bucket)
    assert _committed(dirs) == ["step-00000001"]  # the only good checkpoint stays
    assert ".metadata" not in dirs["step-00000002"]  # data of the failed save, left for gc
    assert manager.latest() == 1

    # An error nobody waited for is raised by the next save, before it starts.
    concurrent.futures.wait([manager.save(3, _state(3))])
    client.fail_commit = False
    with pytest.raises(S3ServerError, match="injected"):
        manager.save(4, _state(4))
    assert _committed(_dirs(boto3_client, bucket)) == ["step-00000001"]

    manager.save(4, _state(4))
    manager.close()
    dirs = _dirs(boto3_client, bucket)
    assert _committed(dirs) == ["step-00000004"]  # retention ran after a good commit
    assert {"step-00000002", "step-00000003"} <= set(dirs)  # incomplete ones: gc's business
    assert [i.committed for i in manager.list()] == [False, False, True]

    with pytest.raises(CheckpointExistsError, match="committed checkpoint at step 4"):
        manager.save(4, _state(4))  # a committed step is never overwritten: refused before anything is written
    manager.close()
    manager.save(5, _state(5))
    manager.close()
    assert _committed(_dirs(boto3_client, bucket)) == ["step-00000005"]


def test_sync_save_and_load_raise_s3dcp_errors_not_checkpoint_exception(bucket, s3_config, boto3_client):
    manager = CheckpointManager(f"s3://{bucket}/run", config=s3_config, keep_last=None, async_mode=False)
    manager.save(1, _state(1))
    CheckpointManager(f"s3://{bucket}/run", config=s3_config, async_mode=False).save(2, _state(2))  # another one
    try:
        manager.save(2, _state(2))  # synchronous: raised by save itself (the writer refuses, inside DCP)
    except Exception as e:  # noqa: BLE001 - what a training script writes
        caught = e
    assert isinstance(caught, CheckpointExistsError) and "already holds a committed checkpoint" in str(caught)
    assert caught.failed_ranks == [0] and caught.rank_errors == {0: caught}
    assert isinstance(caught.checkpoint_exception, CheckpointException)

    with pytest.raises(CheckpointNotFoundError, match="no checkpoint at") as e:
        manager.load(_state(0), step=7)  # an explicit step that was never saved
    assert e.value.failed_ranks == [0] and isinstance(e.value.checkpoint_exception, CheckpointException)
    boto3_client.put_object(Bucket=bucket, Key="run/step-00000009/__0_0.aaaaaaaaaaaa.distcp", Body=b"x" * 10)
    with pytest.raises(IncompleteCheckpointError, match="is incomplete"):
        manager.load(_state(0), step=9)
    out = _state(0)
    assert manager.load(out) == 2 and torch.equal(out["w"], _state(2)["w"])  # nothing stuck
    manager.close()


@pytest.mark.parametrize("async_mode", [True, False])
def test_a_run_started_over_an_existing_one_is_refused_before_anything_is_written(async_mode, bucket, s3_config,
                                                                                   boto3_client):
    """A second run under the same base: its first save used to write (the old run kept steps 2
    and 3 only, so step 1 was saved among them) and the next one failed, advising
    overwrite=True to S3StorageWriter, which the manager does not take. Now the first save is
    refused, with advice that fits the manager, and the bucket is as the old run left it."""
    old = CheckpointManager(f"s3://{bucket}/run", config=s3_config, keep_last=2, async_mode=False)
    for step in (1, 2, 3):
        old.save(step, _state(step))
    old.close()
    before = boto3_client.list_objects_v2(Bucket=bucket)["Contents"]
    assert _committed(_dirs(boto3_client, bucket)) == ["step-00000002", "step-00000003"]

    new = CheckpointManager(f"s3://{bucket}/run", config=s3_config, async_mode=async_mode)
    for step in (1, 3):  # below the old run's newest, and at it
        with pytest.raises(CheckpointExistsError) as info:
            new.save(step, _state(step))
        text = str(info.value)
        assert f"s3://{bucket}/run already holds a committed checkpoint at step 3 (s3://{bucket}/run/step-00000003)" \
            in text, text
        assert "manager.load(state_dict)" in text and f"s3dcp ls s3://{bucket}/run/" in text and \
            "S3StorageWriter" not in text, text
    new.close()
    assert boto3_client.list_objects_v2(Bucket=bucket)["Contents"] == before  # nothing written, nothing deleted
    assert new.load(_state(0)) == 3  # what the advice says: resume, then save later steps
    new.save(4, _state(4))
    new.close()
    assert _committed(_dirs(boto3_client, bucket)) == ["step-00000002", "step-00000003", "step-00000004"]


def test_latest_ignores_an_incomplete_newer_checkpoint(bucket, s3_config, boto3_client):
    manager = CheckpointManager(f"s3://{bucket}/run", config=s3_config, keep_last=1, async_mode=False)
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint under"):
        manager.load(_state(0))
    assert manager.latest() is None
    manager.save(1, _state(1))
    boto3_client.put_object(Bucket=bucket, Key="run/step-00000009/__0_0.aaaaaaaaaaaa.distcp", Body=b"x" * 10)
    boto3_client.put_object(Bucket=bucket, Key="run/step-9/.metadata", Body=b"{}")  # not a name we write
    boto3_client.put_object(Bucket=bucket, Key="run/notes/.metadata", Body=b"{}")
    assert manager.latest() == 1
    assert [(i.step, i.committed) for i in manager.list()] == [(1, True), (9, False)]
    out = _state(0)
    assert manager.load(out) == 1 and torch.equal(out["w"], _state(1)["w"])
    manager.save(2, _state(2))  # keep_last=1: step 1 goes, the incomplete step 9 stays
    assert _committed(_dirs(boto3_client, bucket)) == ["notes", "step-00000002", "step-9"]
    assert "step-00000009" in _dirs(boto3_client, bucket)


def test_delete_removes_the_metadata_first(bucket, s3_config, boto3_client):
    class Recorder(S3Client):
        calls: list = []

        def delete(self, bucket, keys):
            keys = list(keys)
            self.calls.append(keys)
            return super().delete(bucket, keys)

    client = Recorder(s3_config)
    manager = CheckpointManager(f"s3://{bucket}/run", client=client, async_mode=False)
    manager.save(1, {"a": torch.randn(300_000), "b": torch.randn(300_000)})
    boto3_client.put_object(Bucket=bucket, Key="run/step-00000001/README", Body=b"mine")
    count, nbytes = delete_checkpoint(client, parse_s3_uri(manager.uri(1)))
    assert client.calls[0] == ["run/step-00000001/.metadata"]
    assert all(k.endswith(".distcp") for k in client.calls[1])
    assert count == 1 + len(client.calls[1]) and nbytes > 2_400_000
    assert _dirs(boto3_client, bucket) == {"step-00000001": ["README"]}  # not ours: left


def test_bad_arguments_are_refused(s3_config):
    for kwargs in ({"keep_last": 0}, {"keep_every": 0}, {"name_format": "step"}, {"name_format": "{step}-{step}"},
                   {"name_format": "/{step}"}, {"name_format": "{epoch}"}):
        with pytest.raises(ConfigError):
            CheckpointManager("s3://bucket/run", config=s3_config, **kwargs)
    with pytest.raises(ConfigError):
        CheckpointManager("s3://bucket/run", config=s3_config).save(-1, {})


# ------------------------------------------------------------------------------ resume
class _AppState(Stateful):
    """The DCP recipe: model and optimizer behind one Stateful."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict):
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])


def _model_and_optimizer(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)


def _train_step(model, optimizer, step):
    gen = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(32, 8, generator=gen), torch.randn(32, 1, generator=gen)
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()


def test_resume_is_bitwise_and_training_continues_identically(bucket, s3_config):
    model, optimizer = _model_and_optimizer(0)
    for step in range(3):
        _train_step(model, optimizer, step)
    with CheckpointManager(f"s3://{bucket}/run", config=s3_config) as manager:
        manager.save(3, {"app": _AppState(model, optimizer), "epoch": 1})

    model2, optimizer2 = _model_and_optimizer(1)  # different weights, empty optimizer state
    restored = {"app": _AppState(model2, optimizer2), "epoch": 0}
    assert CheckpointManager(f"s3://{bucket}/run", config=s3_config).load(restored) == 3
    assert restored["epoch"] == 1
    for (name, p), p2 in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(p, p2), name
    s1, s2 = optimizer.state_dict(), optimizer2.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    for k in s1["state"]:
        for field, value in s1["state"][k].items():
            assert torch.equal(value, s2["state"][k][field]), (k, field)

    _train_step(model, optimizer, 3)
    _train_step(model2, optimizer2, 3)
    for p, p2 in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, p2)


# ------------------------------------------------------------------------------ two ranks
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_rank_worker(rank: int, port: int, base: str, config: S3Config, outdir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        manager = CheckpointManager(base, config=config, keep_last=2)
        for step in (1, 2, 3):
            manager.save(step, {f"rank{rank}": torch.full((4,), float(rank * 10 + step)), "step": step})
        manager.wait()
        if rank == 0:  # a newer save that never committed
            target = parse_s3_uri(manager.uri(4))
            manager.client.put(target.bucket, target.key("__1_0.bbbbbbbbbbbb.distcp"), b"x").result()
        dist.barrier()
        latest = manager.latest()
        out = {f"rank{rank}": torch.zeros(4), "step": 0}
        loaded = manager.load(out)
        assert torch.equal(out[f"rank{rank}"], torch.full((4,), float(rank * 10 + 3))) and out["step"] == 3
        steps = [(i.step, i.committed) for i in manager.list()]
        with open(os.path.join(outdir, f"rank{rank}"), "w") as f:
            f.write(repr((latest, loaded, steps)))
    finally:
        dist.destroy_process_group()


@pytest.mark.multiproc
def test_two_ranks_agree_on_latest(bucket, s3_config, tmp_path):
    ctx = mp.start_processes(_two_rank_worker, args=(_free_port(), f"s3://{bucket}/run", s3_config, str(tmp_path)),
                             nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + 120
    try:
        while not ctx.join(timeout=0.2):
            assert time.monotonic() < deadline, "two-rank run timed out"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    results = [ast.literal_eval((tmp_path / f"rank{r}").read_text()) for r in range(2)]
    assert results[0] == results[1] == (3, 3, [(2, True), (3, True), (4, False)])
