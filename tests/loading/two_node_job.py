"""A job for :mod:`multinode` (two simulated nodes): save a sharded state on 8 ranks, restore it
cooperatively on 8 as 2 replicas × 4 shards (replicas on different nodes) and plain-DDP style,
and on 4 of the ranks (two per node, in a process group of their own) resharded. Every rank
checks its tensors bitwise and writes its figures.
Usage: ``torchrun ... two_node_job.py s3://bucket/prefix``."""

from __future__ import annotations

import dataclasses
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from s3dcp import S3StorageReader, S3StorageWriter

from multinode import job_env, write_result


def full_state() -> dict:
    g = torch.Generator().manual_seed(11)
    return {"m": torch.randn(512, 128, generator=g), "emb": torch.randn(1000, 96, generator=g).to(torch.bfloat16),
            "rep": torch.randn(64, 64, generator=g)}


def _sharded(state: dict, mesh, placements) -> dict:
    return {"m": distribute_tensor(state["m"], mesh, placements),
            "emb": distribute_tensor(state["emb"], mesh, placements), "rep": state["rep"].clone(), "step": 0}


def _restore(uri: str, mesh, placements, cooperative: bool, group=None) -> dict:
    full = full_state()
    dest = _sharded({k: torch.zeros_like(v) for k, v in full.items()}, mesh, placements)
    reader = S3StorageReader(uri, cooperative=cooperative, process_group=group)
    dcp.load(dest, storage_reader=reader, process_group=group)
    for k in ("m", "emb"):
        got = dest[k].full_tensor()
        assert got.dtype == full[k].dtype and torch.equal(got, full[k]), k
    assert torch.equal(dest["rep"], full["rep"]) and dest["step"] == 42
    return dataclasses.asdict(reader.last_stats)


def main(uri: str) -> None:
    dist.init_process_group("gloo")
    env = job_env()
    world = env["world"]
    out = {"env": env}
    mesh = init_device_mesh("cpu", (world,))
    state = _sharded(full_state(), mesh, [Shard(0)])
    state["step"] = 42
    dcp.save(state, storage_writer=S3StorageWriter(uri))
    hsdp = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    out["hsdp"] = _restore(uri, hsdp, [Replicate(), Shard(0)], cooperative=True)
    out["ddp"] = _restore(uri, mesh, [Replicate()], cooperative=True)
    out["ddp_plain"] = _restore(uri, mesh, [Replicate()], cooperative=False)
    # 8 -> 4: two ranks per node restore in a group of their own, resharded over 4
    per_node = env["local_world"]
    members = [n * per_node + i for n in range(world // per_node) for i in range(2)]
    four = dist.new_group(members)
    if env["rank"] in members:
        out["resharded"] = _restore(uri, DeviceMesh.from_group(four, "cpu"), [Shard(0)], cooperative=True, group=four)
    write_result(out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
