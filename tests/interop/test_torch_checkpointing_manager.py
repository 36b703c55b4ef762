"""torch-checkpointing's CheckpointManager on S3 through s3dcp, on SeaweedFS and on moto: two ranks
(gloo) save sharded DTensors with async saves (the writer in torch-checkpointing's subprocess,
the commit on rank 0 after its barrier), retention keeps the last two, a save whose writers are
killed after writing everything but the commit never looks committed, and one process loads
the two-rank checkpoints back (resharding 2 → 1), bit for bit."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.default_resharder import DefaultResharder

from s3dcp.config import MiB
from s3dcp.interop.torch_checkpointing import S3StorageConfig, keep_last

from moto_server import MotoServer
from tc_helpers import gather_metadata_on_cpu, kill_writer_if_doomed
from test_multiprocess import Job, _assert_bitwise, run_jobs

pytestmark = pytest.mark.multiproc

WORLD = 2
STEPS = (1, 2, 3)
ROWS = 1536  # 6 MiB float32 tensors: each rank's file is a multipart upload of 5 MiB parts


def full_state(step: int) -> dict:
    """The state the ranks hold at ``step`` (made from a seed, then ``add_(1)`` per step)."""
    g = torch.Generator().manual_seed(41)
    state = {"w": torch.randn(ROWS, 1024, generator=g), "v": torch.randn(20, 30, generator=g).to(torch.bfloat16),
             "r": torch.randn(7, generator=g).double(), "opt": {"exp_avg": torch.randn(ROWS, 1024, generator=g)}}
    for _ in range(step - 1):
        for t in (state["w"], state["v"], state["r"], state["opt"]["exp_avg"]):
            t.add_(1)
    return state


def _sharded(mesh) -> dict:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    full = full_state(1)
    put = lambda t, p: distribute_tensor(t, mesh, [p], src_data_rank=None)  # noqa: E731
    return {"w": put(full["w"], Shard(0)), "v": put(full["v"], Shard(1)), "r": put(full["r"], Replicate()),
            "opt": {"exp_avg": put(full["opt"]["exp_avg"], Shard(0))}}


def _manager(root: str, s3, **changes) -> CheckpointManager:
    return CheckpointManager(CheckpointManager.Config(
        items={"model": ItemSpec(resharder=DefaultResharder())}, storage_config=S3StorageConfig(root=root, s3=s3),
        **changes))


def _worker(rank: int, world: int, targets: list) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    gather_metadata_on_cpu()
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for name, s3, root in targets:
        manager = _manager(root, s3, pre_finalize_callback=kill_writer_if_doomed)
        state = _sharded(mesh)
        writes = []
        for step in STEPS:
            writes.append(manager.save(f"step_{step}", {"model": state, "step": step}))  # async: staged, then written
            with manager.lock():  # training goes on: waits only while the staging copy runs
                for t in (state["w"], state["v"], state["r"], state["opt"]["exp_avg"]):
                    t.add_(1)
        for write in writes:
            write.result()
        storage = S3StorageConfig(root=root, s3=s3).create_storage()
        deleted = keep_last(storage, "/", 2) if rank == 0 else None
        dist.barrier()
        back = {k: torch.zeros_like(v) for k, v in state.items() if k != "opt"} | {
            "opt": {"exp_avg": torch.zeros_like(state["opt"]["exp_avg"])}}
        loaded = manager.load("step_3", into={"model": back, "step": 0})
        expected = full_state(3)
        for k in ("w", "v", "r"):
            _assert_bitwise(back[k].full_tensor(), expected[k], f"{name} {k} on two ranks")
        _assert_bitwise(back["opt"]["exp_avg"].full_tensor(), expected["opt"]["exp_avg"], f"{name} exp_avg")
        doomed = manager.save("doomed_4", {"model": state, "step": 4})
        try:
            doomed.result()
            killed = None
        except Exception as e:  # noqa: BLE001 - the writer subprocess was killed
            killed = f"{type(e).__name__}: {e}"
        try:
            manager.close()
        except Exception:  # noqa: BLE001 - it reports the killed writer again
            pass
        dist.barrier()
        out[name] = {"deleted": deleted, "step": loaded["step"], "killed": killed}
    return out


@pytest.fixture(scope="module")
def saved(s3_server, tmp_path_factory):
    """Both servers' runs, written by one two-rank job; yields {server: (root, s3 config, rank results)}."""
    with MotoServer() as moto:
        targets = []
        for name, server in (("seaweedfs", s3_server), ("moto", moto)):
            bucket = f"tc-mgr-{uuid.uuid4().hex[:10]}"
            server.create_bucket(bucket)
            targets.append((name, server.s3_config(part_size_bytes=5 * MiB), f"s3://{bucket}/run"))
        job = Job("tc-manager", _worker, WORLD, (targets,))
        run_jobs(tmp_path_factory.mktemp("tc-ranks"), job)
        yield {name: (root, s3, [r[name] for r in job.results]) for name, s3, root in targets}


@pytest.mark.parametrize("server", ["seaweedfs", "moto"])
def test_two_rank_async_saves_load_back_on_one_rank_bit_for_bit(saved, server):
    root, s3, ranks = saved[server]
    assert [r["step"] for r in ranks] == [3, 3]
    manager = _manager(root, s3, save=CheckpointManager.Config.with_sync_save().save)
    try:
        for step in (2, 3):  # resharding 2 -> 1: every tensor whole, from both ranks' files
            g = full_state(step)
            into = {"w": torch.zeros(ROWS, 1024), "v": torch.zeros(20, 30, dtype=torch.bfloat16),
                    "r": torch.zeros(7, dtype=torch.float64), "opt": {"exp_avg": torch.zeros(ROWS, 1024)}}
            loaded = manager.load(f"step_{step}", into={"model": into, "step": 0})
            assert loaded["step"] == step
            for k in ("w", "v", "r"):
                _assert_bitwise(into[k], g[k], f"{server} step {step} {k}")
            _assert_bitwise(into["opt"]["exp_avg"], g["opt"]["exp_avg"], f"{server} step {step} exp_avg")
    finally:
        manager.close()


@pytest.mark.parametrize("server", ["seaweedfs", "moto"])
def test_retention_keeps_the_last_two_and_a_killed_save_never_looks_committed(saved, server):
    root, s3, ranks = saved[server]
    assert ranks[0]["deleted"] == ["step_1"]
    assert all(r["killed"] and "terminated" in r["killed"] for r in ranks), ranks
    storage = S3StorageConfig(root=root, s3=s3).create_storage()
    # everything of the killed save is there (both ranks' files, metadata.pkl) but its commit
    assert storage.ls(Path("/")) == ["step_2", "step_3", "tmp_doomed_4"]
    assert {"metadata.pkl", "model_0.pt", "model_1.pt"} <= set(storage.ls(Path("tmp_doomed_4")))
    assert storage.committed(Path("/")) == ["step_2", "step_3"]
    assert not storage.exists(Path("doomed_4")) and not storage.exists(Path("doomed_4/metadata.pkl"))
    manager = _manager(root, s3, save=CheckpointManager.Config.with_sync_save().save)
    try:
        into = {"w": torch.zeros(ROWS, 1024)}
        with pytest.raises(FileNotFoundError):
            manager.load("doomed_4", into={"model": into, "step": 0})
        assert not into["w"].any()
        with pytest.raises(FileExistsError, match="committed checkpoint"):  # a committed one is never overwritten
            manager.save("step_3", {"model": {"w": torch.ones(4)}, "step": 99})
        back = {"w": torch.zeros(ROWS, 1024)}
        manager.load("step_3", into={"model": back, "step": 0})
        _assert_bitwise(back["w"], full_state(3)["w"], "step_3 after the refused save")
    finally:
        manager.close()
