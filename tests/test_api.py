"""s3dcp.save / async_save / load: the one-call API picks the S3 writer and reader and raises
s3dcp's own errors (subclasses of Exception) instead of DCP's CheckpointException."""

import logging
import warnings

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

import s3dcp
import s3dcp.api
from s3dcp.errors import (
    AccessDeniedError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConfigError,
    IncompleteCheckpointError,
    S3ConnectionError,
    S3DCPError,
)

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _state(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(64, 32, generator=gen), "b": torch.randn(32, generator=gen)}, "step": 3}


def _zeros(state):
    return {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "step": 0}


def test_save_and_load_round_trip(uri, s3_config):
    state = _state()
    metadata = s3dcp.save(state, uri, config=s3_config)
    assert "model.w" in metadata.state_dict_metadata
    out = _zeros(state)
    assert s3dcp.load(out, uri, config=s3_config) is None
    assert torch.equal(out["model"]["w"], state["model"]["w"]) and out["step"] == 3


def test_async_save_delivers_the_checkpoint_as_staged(uri, s3_config):
    state = _state()
    expected = state["model"]["w"].clone()
    future = s3dcp.async_save(state, uri, config=s3_config)
    state["model"]["w"].add_(1)  # after async_save returns the loop may change its tensors
    assert "model.w" in future.result(timeout=120).state_dict_metadata
    out = _zeros(state)
    s3dcp.load(out, uri, config=s3_config)
    assert torch.equal(out["model"]["w"], expected)


def test_loading_a_missing_checkpoint_raises_a_catchable_error_and_logs_no_tracebacks(uri, s3_config, caplog):
    with caplog.at_level(logging.WARNING):
        with pytest.raises(CheckpointNotFoundError) as info:
            s3dcp.load(_zeros(_state()), uri, config=s3_config)
    err = info.value
    assert isinstance(err, Exception) and isinstance(err, S3DCPError)
    assert str(err).startswith(f"no checkpoint at {uri}")
    assert err.failed_ranks == [0] and err.rank_errors == {0: err}
    assert isinstance(err.checkpoint_exception, CheckpointException)  # DCP's report stays reachable
    assert not isinstance(err.__cause__, CheckpointException)  # ...but is not printed as its cause
    assert not [r for r in caplog.records if "metadata is not found" in r.getMessage()], caplog.text


def test_loading_an_incomplete_checkpoint(uri, s3_config, boto3_client, bucket):
    s3dcp.save(_state(), uri, config=s3_config)
    key = uri.split("/", 3)[3] + "/.metadata"
    boto3_client.delete_object(Bucket=bucket, Key=key)
    with pytest.raises(IncompleteCheckpointError, match="is incomplete"):
        s3dcp.load(_zeros(_state()), uri, config=s3_config)


def test_save_errors_are_catchable_with_except_exception(uri, s3_config):
    s3dcp.save(_state(), uri, config=s3_config)
    try:
        s3dcp.save(_state(1), uri, config=s3_config)
    except Exception as e:  # noqa: BLE001 - what the issue asks for: plain except Exception works
        caught = e
    assert isinstance(caught, CheckpointExistsError) and "overwrite=True (to s3dcp.save" in str(caught)
    assert caught.failed_ranks == [0]
    s3dcp.save(_state(1), uri, config=s3_config, overwrite=True)
    out = _zeros(_state())
    s3dcp.load(out, uri, config=s3_config)
    assert torch.equal(out["model"]["w"], _state(1)["model"]["w"])


def test_async_save_future_raises_the_unwrapped_error(uri, s3_server):
    bad = s3_server.s3_config(secret_access_key="wrong-secret")
    future = s3dcp.async_save(_state(), uri, config=bad)
    with pytest.raises(AccessDeniedError) as info:
        future.result(timeout=120)
    assert info.value.failed_ranks == [0] and info.value.status == 403


def test_process_executor_without_a_process_group_says_what_to_do(uri, s3_config):
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    with pytest.raises(ConfigError, match="init_process_group"):
        s3dcp.async_save(_state(), uri, config=s3_config, async_checkpointer_type=AsyncCheckpointerType.PROCESS)


def test_unwrap_error_prefers_an_s3dcp_error_over_collateral_ones():
    from torch.distributed.checkpoint.api import _wrap_exception

    from s3dcp.api import unwrap_error

    ours = CheckpointNotFoundError("no checkpoint at s3://b/x")
    collateral = RuntimeError("peer failed")
    wrapped = CheckpointException("plan", {0: _wrap_exception(collateral), 1: _wrap_exception(ours)})
    err = unwrap_error(wrapped)
    assert err is ours and err.failed_ranks == [0, 1] and err.rank_errors == {0: collateral, 1: ours}
    plain = ValueError("x")
    assert unwrap_error(plain) is plain


def test_writer_options_pass_through_and_the_stats_are_reachable(bucket, s3_config):
    base = f"s3://{bucket}/run/step-1"
    state = _state()
    s3dcp.save(state, base, config=s3_config, item_checksum="crc64nvme")  # an S3StorageWriter option
    first = s3dcp.last_save_stats()
    assert first.bytes >= 64 * 32 * 4 and first.upload_s > 0 and first.inherited_bytes == 0
    state["model"]["b"].add_(1)  # w unchanged: an incremental save only refers to it
    future = s3dcp.async_save(state, f"s3://{bucket}/run/step-2", config=s3_config, incremental_from=base)
    assert isinstance(future, s3dcp.api.SaveFuture) and future.writer.incremental_from is not None
    future.result(timeout=120)
    assert future.stats.bytes == 32 * 4 and future.stats.inherited_bytes > 64 * 32 * 4  # b uploaded; w, step inherited
    assert future.stats.stage_s > 0 and s3dcp.last_save_stats() is future.stats
    out = _zeros(state)
    s3dcp.load(out, f"s3://{bucket}/run/step-2", config=s3_config)
    assert torch.equal(out["model"]["w"], state["model"]["w"]) and torch.equal(out["model"]["b"], state["model"]["b"])
    with pytest.raises(TypeError, match="no_such_option"):
        s3dcp.save(state, f"s3://{bucket}/run/step-3", config=s3_config, no_such_option=1)


def test_an_error_s3dcp_did_not_raise_comes_back_as_its_own_type(uri, s3_config):
    from torch.distributed.checkpoint import DefaultSavePlanner

    class Broken(DefaultSavePlanner):
        def create_local_plan(self):
            raise ValueError("planner says no")

    try:
        s3dcp.save(_state(), uri, config=s3_config, planner=Broken())
    except Exception as e:  # noqa: BLE001 - catchable, as the README says
        caught = e
    assert type(caught) is ValueError and str(caught) == "planner says no"
    assert caught.failed_ranks == [0] and isinstance(caught.checkpoint_exception, CheckpointException)
    assert s3dcp.unwrap_error is s3dcp.errors.unwrap_error is s3dcp.api.unwrap_error


# ------------------------------------------------------------------------------ two ranks
def _two_rank_worker(rank: int, world: int, uri: str, cfg) -> str:
    with pytest.raises(CheckpointNotFoundError) as info:  # the carrier crosses DCP's collectives
        s3dcp.load({"w": torch.zeros(2)}, uri, config=cfg)
    assert info.value.failed_ranks == [0, 1] and str(info.value).startswith(f"no checkpoint at {uri}")
    state = {f"w{rank}": torch.full((4,), float(rank + 1))}
    s3dcp.async_save(state, uri, config=cfg).result(timeout=120)
    with pytest.raises(CheckpointExistsError) as info:  # refused by the coordinator, seen on every rank
        s3dcp.save(state, uri, config=cfg)
    assert info.value.failed_ranks == [0]
    out = {f"w{rank}": torch.zeros(4)}
    s3dcp.load(out, uri, config=cfg)
    assert torch.equal(out[f"w{rank}"], state[f"w{rank}"])
    return "ok"


@pytest.mark.multiproc
def test_two_ranks_get_the_same_unwrapped_errors(s3_config, uri, tmp_path):
    from test_multiprocess import Job, run_jobs

    job = Job("api", _two_rank_worker, 2, (uri, s3_config))
    run_jobs(tmp_path, job)
    assert job.results == ["ok", "ok"]


# ------------------------------------------------------------------------------ what a newcomer meets
_ERRORS_SCRIPT = """
import sys, torch, s3dcp
from s3dcp import S3Config
cfg = S3Config()
uri, what = sys.argv[1], sys.argv[2]
s3dcp.save({"w": torch.ones(3)}, uri + "/a", config=cfg)
s3dcp.async_save({"w": torch.ones(3)}, uri + "/b", config=cfg).result()
with s3dcp.CheckpointManager(uri + "/run", config=cfg) as manager:
    manager.save(1, {"w": torch.ones(3)})
    manager.load({"w": torch.zeros(3)})
if what == "save":
    s3dcp.save({"w": torch.ones(3)}, uri + "/a", config=cfg)
else:
    s3dcp.load({"w": torch.zeros(3)}, uri + "/nothing", config=cfg)
"""


@pytest.mark.parametrize("what", ["save", "load"])
def test_a_failed_call_prints_one_traceback_and_no_dcp_warning(what, uri, s3_server, tmp_path):
    """An uncaught error from the one-call API prints its traceback once (it used to print DCP's
    CheckpointException, whose text holds the same frames, then those frames again: 48-83
    lines), and none of the calls, nor a manager's, prints DCP's "torch.distributed is
    disabled" warning, though warnings are on ("-W always")."""
    import os
    import subprocess
    import sys

    script = tmp_path / "job.py"
    script.write_text(_ERRORS_SCRIPT)
    env = {**os.environ, **s3_server.env()}
    done = subprocess.run([sys.executable, "-W", "always", str(script), uri, what], capture_output=True, text=True,
                          env=env, timeout=120)
    err = done.stderr
    assert done.returncode == 1, err
    assert "torch.distributed is disabled" not in err and "CheckpointException" not in err, err
    frames = [line for line in err.splitlines() if line.lstrip().startswith("File ")]
    assert len(frames) == len(set(frames)), err  # no frame printed twice
    last = err.rstrip().splitlines()[-1]
    if what == "save":
        assert err.count("Traceback (most recent call last)") == 1, err
        assert last.startswith(f"s3dcp.errors.CheckpointExistsError: {uri}/a already holds a committed checkpoint; "
                               "save to a new path, or pass overwrite=True"), last
    else:  # its own cause (the 404 of .metadata) is printed too, once
        assert last.startswith(f"s3dcp.errors.CheckpointNotFoundError: no checkpoint at {uri}/nothing"), last
    assert len(err.splitlines()) < 45, err


def test_a_user_dcp_call_still_gets_dcps_warning(uri, s3_config):
    """Only s3dcp's own calls hide DCP's single-process warning: dcp.save with a writer the
    user made warns as DCP means it to, also after s3dcp's calls put their filter in place."""
    import torch.distributed.checkpoint as dcp

    from s3dcp import S3StorageWriter

    s3dcp.save({"w": torch.ones(2)}, f"{uri}/ours", config=s3_config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s3dcp.save({"w": torch.ones(2)}, f"{uri}/ours-again", config=s3_config)  # puts its filter first again
        dcp.save({"w": torch.ones(2)}, storage_writer=S3StorageWriter(f"{uri}/theirs", config=s3_config))
    texts = [str(w.message) for w in caught]
    assert sum(t.startswith("torch.distributed is disabled") for t in texts) == 1, texts


def test_an_https_endpoint_at_a_plain_http_server_says_so(uri, s3_server):
    """The Python API gives the diagnosis the CLI gives (it said only AWS_IO_SOCKET_CLOSED and
    'check that the endpoint is reachable')."""
    https = s3_server.endpoint_url.replace("http://", "https://")
    config = s3_server.s3_config(endpoint_url=https, max_retries=1)
    for call in (lambda: s3dcp.save(_state(), uri, config=config),
                 lambda: s3dcp.load(_zeros(_state()), uri, config=config),
                 lambda: s3dcp.async_save(_state(), uri, config=config).result(timeout=120),
                 lambda: s3dcp.CheckpointManager(uri, config=config, async_mode=False).save(1, _state())):
        with pytest.raises(S3ConnectionError) as info:
            call()
        text = str(info.value)
        assert f"{https} answers plain HTTP, not TLS" in text and f"use {s3_server.endpoint_url}" in text, text


def test_a_checkpoint_at_a_bucket_root_is_refused_by_name(bucket, s3_config, boto3_client):
    """An empty run-name variable (f"s3://{bucket}/{run}") used to save a checkpoint at the
    bucket's root, listed as '.'; the next save to s3://bucket/ failed."""
    for root in (f"s3://{bucket}", f"s3://{bucket}/"):
        with pytest.raises(ConfigError, match=f"is the root of bucket '{bucket}'.*folder of its own"):
            s3dcp.save(_state(), root, config=s3_config)
        with pytest.raises(ConfigError, match="is the root of bucket"):
            s3dcp.async_save(_state(), root, config=s3_config)
        with pytest.raises(ConfigError, match="CheckpointManager's run needs a folder of its own"):
            s3dcp.CheckpointManager(root, config=s3_config)
    assert boto3_client.list_objects_v2(Bucket=bucket).get("KeyCount", 0) == 0


def test_loading_a_run_folder_names_the_checkpoints_below_it(bucket, s3_config):
    run = f"s3://{bucket}/m"
    for step in (1, 2, 10):
        s3dcp.save(_state(), f"{run}/step-{step}", config=s3_config)
    s3dcp.save(_state(), f"{run}/other/step-1", config=s3_config)  # two levels down: not named
    for given in (run, f"{run}/"):
        with pytest.raises(CheckpointNotFoundError) as info:
            s3dcp.load(_zeros(_state()), given, config=s3_config)
        assert str(info.value) == (
            f"no checkpoint at {run} (no .metadata and no data objects); it holds 3 checkpoint(s) right below it: "
            f"step-1, step-2, step-10 — load one of them, e.g. {run}/step-10 (s3dcp ls {run}/ lists them)")
    with pytest.raises(CheckpointNotFoundError) as info:  # nothing below either: the message as before
        s3dcp.load(_zeros(_state()), f"s3://{bucket}/empty", config=s3_config)
    assert str(info.value) == f"no checkpoint at s3://{bucket}/empty (no .metadata and no data objects)"
