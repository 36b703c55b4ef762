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
    assert isinstance(err.__cause__, CheckpointException)  # DCP's report stays reachable
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
    assert isinstance(caught, CheckpointExistsError) and "overwrite=True" in str(caught)
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
    assert caught.failed_ranks == [0] and isinstance(caught.__cause__, CheckpointException)
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
