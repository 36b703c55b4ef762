"""Run by test_async.py in a fresh interpreter: async_saves with DCP's process executor (it
needs a process group and leaves a daemon process behind, so it gets its own process), blocking
and background staging, and a background stage torn on purpose.

Usage: python process_executor_job.py URI  (S3 settings in AWS_* environment variables)
"""

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from s3dcp import HostBufferPool, S3Config, S3StorageReader, S3StorageWriter


def main(uri: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    config = S3Config(access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
                      secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"])
    gen = torch.Generator().manual_seed(1)
    state = {f"w{i}": torch.randn(256, 256, generator=gen) for i in range(4)}
    state["step"] = 5
    expected = {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)}
    pool = HostBufferPool()
    for attempt in range(2):  # the second save reuses the (now shared-memory) arena
        target = f"{uri}-{attempt}"
        writer = S3StorageWriter(target, config=config, pool=pool)
        future = dcp.async_save(state, storage_writer=writer, async_checkpointer_type=AsyncCheckpointerType.PROCESS)
        for v in state.values():
            if isinstance(v, torch.Tensor):
                v.add_(1)  # the checkpoint must hold the values of the moment async_save returned
        future.result(timeout=300)
        out = {k: torch.zeros_like(v) for k, v in expected.items()}
        dcp.load(out, storage_reader=S3StorageReader(target, config=config))
        for k, v in expected.items():
            assert torch.equal(out[k], v), (attempt, k)
        expected = {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)}
    # Background staging: the child gets the staged tensors once the staging thread copied them,
    # and a copy the loop changed too early fails in the child's write_data, nothing committed.
    from s3dcp import TornCheckpointError, unwrap_error
    from s3dcp.saving import background

    background_config = config.replace(staging="background")
    for torn in (False, True):
        target = f"{uri}-background-{torn}"
        if torn:
            background._seam = lambda phase: state["w1"].add_(1) if phase == "copying" else None
        writer = S3StorageWriter(target, config=background_config, pool=pool)
        response = dcp.async_save(state, storage_writer=writer, async_checkpointer_type=AsyncCheckpointerType.PROCESS)
        response.staging_completion.result(timeout=300)
        for v in state.values():
            if isinstance(v, torch.Tensor):
                v.add_(1)
        if torn:
            try:
                response.upload_completion.result(timeout=300)
                raise AssertionError("a torn staged copy was saved")
            except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException
                assert isinstance(unwrap_error(e), TornCheckpointError), repr(e)
                assert unwrap_error(e).names == ["w1"], unwrap_error(e).names
            assert not writer._committed()
            continue
        response.upload_completion.result(timeout=300)
        out = {k: torch.zeros_like(v) for k, v in expected.items()}
        dcp.load(out, storage_reader=S3StorageReader(target, config=config))
        for k, v in expected.items():
            assert torch.equal(out[k], v), ("background", k)
        expected = {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)}
    assert pool.allocations == 1, pool.allocations
    print("process executor: OK", flush=True)
    dist.destroy_process_group()
    os._exit(0)  # the executor's daemon process is torn down with us


if __name__ == "__main__":
    main(sys.argv[1])
