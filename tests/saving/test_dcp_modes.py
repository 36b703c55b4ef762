"""DCP's newer save modes with s3dcp's writer and reader, on 2 ranks (gloo, real processes, the
real server): background staging (FSDP2's DTensors included, and a loop that did not wait on one
rank only), DCP's DefaultStager with shared memory, ``use_collectives=False`` (refused by name,
docs/memory.md says why), and ``checkpoint_id=`` with path-less writers and readers.

One spawn of 2 ranks runs every check (see tests/test_multiprocess.py for the launcher); each
check's outcome is reported to its own test."""

from __future__ import annotations

import threading
import traceback
import uuid
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from s3dcp import S3Config, S3StorageReader, S3StorageWriter

from test_multiprocess import Job, _assert_tree_equal, run_jobs

pytestmark = pytest.mark.multiproc

_ELEMS = 100_000  # 400 KB float32: copied on the staging thread (>= 64 KiB)


def _state(rank: int) -> dict:
    g = torch.Generator().manual_seed(100 + rank)
    return {f"rank{rank}.w": torch.randn(_ELEMS, generator=g), f"rank{rank}.small": torch.randn(7, generator=g),
            "shared": torch.arange(_ELEMS, dtype=torch.float32), "meta": {"epoch": 2}}


def _model(mesh):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)


def _fsdp_state(model, optim) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd}


def _train_step(model, optim, rank: int) -> None:
    g = torch.Generator().manual_seed(rank)
    model(torch.randn(16, 256, generator=g)).square().mean().backward()
    optim.step()
    optim.zero_grad()


def _clone(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_clone(v) for v in tree]
    return tree.detach().clone() if isinstance(tree, torch.Tensor) else tree


def _blank(tree: Any) -> Any:
    """A load destination like ``tree``: zero tensors (DTensors alike), other values as they are."""
    if isinstance(tree, dict):
        return {k: _blank(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_blank(v) for v in tree]
    return torch.zeros_like(tree) if isinstance(tree, torch.Tensor) else tree


def _error_of(future) -> BaseException:
    from s3dcp import unwrap_error

    try:
        future.result(timeout=120)
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        return unwrap_error(e)
    raise AssertionError("the save did not fail")


def _worker(rank: int, world: int, bucket: str, cfg: S3Config) -> dict:
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.device_mesh import init_device_mesh

    from s3dcp import TornCheckpointError
    from s3dcp.errors import ConfigError
    from s3dcp.saving import background

    outcome: dict[str, Any] = {}
    uri = f"s3://{bucket}"
    bg = cfg.replace(staging="background")
    # DCP's collectives of a save in flight on a group of their own: FSDP2's forward issues its
    # own on the default group meanwhile, from the training thread (as examples/train_fsdp2.py)
    ckpt = dist.new_group(backend="gloo")

    def check(name: str, fn: Callable[[], Any]) -> None:
        try:
            outcome[name] = ("ok", fn())
        except Exception:  # noqa: BLE001 - reported by the test that owns the check
            outcome[name] = ("error", traceback.format_exc())
        dist.barrier()  # the ranks stay in step whatever a check did

    def background_plain():
        state = _state(rank)
        expected = _clone(state)
        response = dcp.async_save(state, storage_writer=S3StorageWriter(f"{uri}/bg", config=bg))
        response.staging_completion.result(timeout=60)
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                v.add_(1)  # after staging: the loop's optimizer step
        response.upload_completion.result(timeout=120)
        dest = _blank(expected)
        dcp.load(dest, storage_reader=S3StorageReader(f"{uri}/bg", config=cfg))
        _assert_tree_equal(dest, expected, "loaded")

    def background_fsdp2():
        mesh = init_device_mesh("cpu", (world,))
        model, optim = _model(mesh)
        saved = []
        _train_step(model, optim, rank)
        for step in range(1, 5):
            if step > 1:
                model(torch.randn(16, 256)).square().mean().backward()
                response.staging_completion.result(timeout=60)  # the contract: before the optimizer step
                optim.step()
                optim.zero_grad()
                response.upload_completion.result(timeout=120)
            state = _fsdp_state(model, optim)
            saved.append(_clone(state))
            response = dcp.async_save(state, storage_writer=S3StorageWriter(f"{uri}/fsdp-{step}", config=bg),
                                      process_group=ckpt)
        response.upload_completion.result(timeout=120)
        for step, expected in enumerate(saved, 1):
            dest = _blank(expected)
            dcp.load(dest, storage_reader=S3StorageReader(f"{uri}/fsdp-{step}", config=cfg), process_group=ckpt)
            _assert_tree_equal(dest, expected, f"step {step}")

    def torn_on_one_rank():
        # Rank 1's loop changes FSDP2's DTensor parameters in place (an EMA-like update, outside
        # the optimizer) while its staging thread copies: their local tensors keep their version
        # counters, the DTensors' own counters move. Both ranks' saves fail with rank 1's error;
        # nothing is committed; the next save of both ranks works (no rank left in a collective).
        mesh = init_device_mesh("cpu", (world,))
        model, optim = _model(mesh)
        _train_step(model, optim, rank)
        model(torch.randn(16, 256)).square().mean().backward()
        seam = background._seam
        if rank == 1:
            def change(phase):
                if phase == "copying":
                    with torch.no_grad():
                        for p in model.parameters():
                            p.mul_(0.5)

            background._seam = change
        try:
            response = dcp.async_save(_fsdp_state(model, optim), process_group=ckpt,
                                      storage_writer=S3StorageWriter(f"{uri}/torn", config=bg))
            error = _error_of(response.upload_completion)
        finally:
            background._seam = seam
        assert isinstance(error, TornCheckpointError), repr(error)
        assert error.failed_ranks == [1], error.failed_ranks
        big = [f"model.{k}" for k, v in model.state_dict().items() if v.to_local().nbytes >= 64 * 1024]
        assert big and error.names == big, (error.names, big)
        state = _fsdp_state(model, optim)
        expected = _clone(state)
        dcp.async_save(state, storage_writer=S3StorageWriter(f"{uri}/after-torn", config=bg),
                       process_group=ckpt).upload_completion.result(timeout=120)
        dest = _blank(expected)
        dcp.load(dest, storage_reader=S3StorageReader(f"{uri}/after-torn", config=cfg), process_group=ckpt)
        _assert_tree_equal(dest, expected, "the save after the torn one")

    def default_stager():
        state = _state(rank) | {f"rank{rank}.big": torch.full((9 << 18,), float(rank))}  # 9 MiB: a file sent as is
        expected = _clone(state)
        stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=True, use_async_staging=True,
                                              use_non_blocking_copy=False))
        writer = S3StorageWriter(f"{uri}/ds", config=cfg)
        try:
            response = dcp.async_save(state, storage_writer=writer, async_stager=stager)
            response.staging_completion.result(timeout=60)
            response.upload_completion.result(timeout=120)
        finally:
            stager.close()
        dest = _blank(expected)
        dcp.load(dest, storage_reader=S3StorageReader(f"{uri}/ds", config=cfg))
        _assert_tree_equal(dest, expected, "loaded")
        return {"copied_bytes": writer.last_stats.copied_bytes, "objects": writer.last_stats.objects}

    def no_collectives():
        state = _state(rank)
        with pytest.raises(ConfigError, match="use_collectives=True"):
            dcp.save(state, storage_writer=S3StorageWriter(f"{uri}/nc", config=cfg), use_collectives=False)
        response = dcp.async_save(state, storage_writer=S3StorageWriter(f"{uri}/nc-async", config=bg),
                                  use_collectives=False)
        assert isinstance(_error_of(response.upload_completion), ConfigError)
        # what the error offers instead: each rank a checkpoint of its own, no collective at all
        expected = _clone(state)
        response = dcp.async_save(state, storage_writer=S3StorageWriter(f"{uri}/own/rank-{rank}", config=bg),
                                  no_dist=True)
        response.staging_completion.result(timeout=60)
        response.upload_completion.result(timeout=120)
        dest = _blank(expected)
        dcp.load(dest, storage_reader=S3StorageReader(f"{uri}/own/rank-{rank}", config=cfg), no_dist=True)
        _assert_tree_equal(dest, expected, "a rank's own checkpoint")

    def checkpoint_id():
        assert S3StorageWriter.validate_checkpoint_id(f"{uri}/cid") and S3StorageReader.validate_checkpoint_id(uri)
        for other in ("/tmp/ckpt", "file:///tmp/ckpt", "gs://b/x", "S3://b/x", "s3:/b/x"):
            assert not S3StorageWriter.validate_checkpoint_id(other), other
            assert not S3StorageReader.validate_checkpoint_id(other), other
        state = _state(rank)
        dcp.save(state, checkpoint_id=f"{uri}/cid", storage_writer=S3StorageWriter(config=cfg))
        dest = _blank(state)
        dcp.load(dest, checkpoint_id=f"{uri}/cid", storage_reader=S3StorageReader(config=cfg))
        _assert_tree_equal(dest, state, "loaded by checkpoint_id")

    check("background", background_plain)
    check("background-fsdp2", background_fsdp2)
    check("torn-on-one-rank", torn_on_one_rank)
    check("default-stager", default_stager)
    check("no-collectives", no_collectives)
    check("checkpoint-id", checkpoint_id)
    outcome["threads"] = [t.name for t in threading.enumerate() if t.name == "s3dcp-staging"]
    return outcome


@pytest.fixture(scope="module")
def two_ranks(s3_server, tmp_path_factory):
    bucket = f"modes-{uuid.uuid4().hex[:12]}"
    s3_server.create_bucket(bucket)
    job = Job("modes", _worker, 2, (bucket, s3_server.s3_config(object_size_target_bytes=1024 * 1024)))
    run_jobs(tmp_path_factory.mktemp("modes"), job)
    return bucket, job.results


def _outcome(results: list, name: str) -> list:
    errors = [f"---- rank {r}:\n{res[name][1]}" for r, res in enumerate(results) if res[name][0] != "ok"]
    if errors:
        pytest.fail(f"{name} failed:\n" + "\n".join(errors), pytrace=False)
    return [res[name][1] for res in results]


def _keys(s3_server, bucket: str, prefix: str) -> list[str]:
    listed = s3_server.boto3_client().list_objects_v2(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for o in listed.get("Contents", []))


def test_background_staging_on_two_ranks_saves_the_state_of_the_call(two_ranks):
    _outcome(two_ranks[1], "background")


def test_background_staging_of_fsdp2_dtensors_in_a_loop_that_waits_is_bitwise(two_ranks):
    _outcome(two_ranks[1], "background-fsdp2")


def test_a_loop_that_did_not_wait_on_one_rank_fails_the_save_on_both_and_commits_nothing(two_ranks, s3_server):
    _outcome(two_ranks[1], "torn-on-one-rank")
    bucket = two_ranks[0]
    assert not [k for k in _keys(s3_server, bucket, "torn/") if k.endswith(".metadata")]
    assert not [k for k in _keys(s3_server, bucket, "torn/") if k.startswith("torn/__1_")]  # the torn rank: nothing


def test_defaultstager_with_shared_memory_on_two_ranks_uploads_its_files_without_copying(two_ranks):
    stats = _outcome(two_ranks[1], "default-stager")
    # each rank: its 9 MiB tensor's file as an object of its own, the small ones together, nothing copied
    assert [s["copied_bytes"] for s in stats] == [0, 0] and all(s["objects"] >= 2 for s in stats), stats


def test_use_collectives_false_is_refused_by_name_and_leaves_nothing(two_ranks, s3_server):
    _outcome(two_ranks[1], "no-collectives")
    assert _keys(s3_server, two_ranks[0], "nc") == []


def test_checkpoint_id_with_pathless_writer_and_reader_on_two_ranks(two_ranks):
    _outcome(two_ranks[1], "checkpoint-id")


def test_one_staging_thread_per_rank_serves_every_background_save(two_ranks):
    assert [r["threads"] for r in two_ranks[1]] == [["s3dcp-staging"], ["s3dcp-staging"]]
