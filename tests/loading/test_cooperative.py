"""Cooperative reads on 4 ranks (gloo, two simulated nodes of 2) against the real server: full
replication (DDP), replicas × shards with resharding and partial overlaps (DTensor), other
destination dtypes, bytes items, an incremental checkpoint's references, a corrupt object and
an S3 fault on one rank only, a
failure on one rank after the exchange, a restore on two of the ranks in a group of their own —
every byte bitwise, every stored byte read from S3 once, every failure an error on every rank
(never a hang), and the group usable afterwards. The same on 8 ranks launched by torchrun as two
nodes: tests/loading/test_two_nodes.py (the full set)."""

from __future__ import annotations

import datetime
import os
from urllib.parse import urlsplit

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from s3dcp import S3StorageReader, S3StorageWriter
from s3dcp.errors import unwrap_error

from test_multiprocess import Job, _assert_bitwise, run_jobs

pytestmark = pytest.mark.multiproc

WORLD = 4
MiB = 1 << 20


def replicated_state(seed: int, big_mib: int = 40) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(big_mib * MiB // 4, generator=g),  # 40 MiB: three checksum blocks, cut between them
        "w": torch.randn(300, 70, generator=g).to(torch.bfloat16),
        "rows": torch.randn(1000, 64, generator=g),
        "step": 7,
        "meta": {"lr": 0.1, "names": ["a", "b"]},
    }


def _blank(state: dict, *, rows_dtype=torch.float32) -> dict:
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in state.items()}
    out["rows"] = torch.zeros(state["rows"].shape, dtype=rows_dtype)
    out["step"], out["meta"] = 0, {"lr": 0.0, "names": []}
    return out


def _load(state: dict, path: str, cfg, **kwargs):
    reader = S3StorageReader(path, config=cfg, cooperative=True, **kwargs)
    dcp.load(state, storage_reader=reader)
    return reader.last_stats


def _outcome(fn) -> tuple:
    """(this rank's own error type, the unwrapped error's type, failed ranks) of a failing load."""
    try:
        fn()
    except CheckpointException as e:
        me = dist.get_rank()
        own = e.failures[me][0] if isinstance(e.failures[me], tuple) else e.failures[me]
        return type(own).__name__, type(unwrap_error(e)).__name__, sorted(e.failures)
    return None


def _worker(rank: int, world: int, uri: str, cfg, proxied) -> dict:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    os.environ["GROUP_RANK"] = str(rank // 2)  # two simulated nodes of two ranks
    out: dict = {}
    expected = replicated_state(1)

    # 1. DDP: every rank loads everything; a small window makes many rounds.
    state = _blank(expected, rows_dtype=torch.float64)  # rows through the bounce path (another dtype)
    stats = _load(state, f"{uri}/ddp", cfg, exchange_window_bytes=2 * MiB)
    for k in ("big", "w"):
        _assert_bitwise(state[k], expected[k], k)
    _assert_bitwise(state["rows"], expected["rows"].double(), "rows")
    assert state["step"] == 7 and state["meta"] == expected["meta"]
    out["ddp"] = stats

    plain = S3StorageReader(f"{uri}/ddp", config=cfg)
    dcp.load(_blank(expected), storage_reader=plain)
    out["plain"] = plain.last_stats

    # 2. Saved as 4 row shards; loaded as 2 replicas × 2 column shards (and as 4 column shards).
    full = torch.randn(256, 96, generator=torch.Generator().manual_seed(2))
    vec = torch.arange(64, dtype=torch.float64)
    mesh = init_device_mesh("cpu", (world,))
    dcp.save({"m": distribute_tensor(full, mesh, [Shard(0)]), "v": distribute_tensor(vec, mesh, [Shard(0)])},
             storage_writer=S3StorageWriter(f"{uri}/dt", config=cfg))
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
    for name, m, placements in (("hsdp", mesh2, [Replicate(), Shard(1)]), ("cols", mesh, [Shard(1)])):
        dest = {"m": distribute_tensor(torch.zeros_like(full), m, placements),
                "v": distribute_tensor(torch.zeros_like(vec), m, [Replicate()] * len(placements))}
        out[name] = _load(dest, f"{uri}/dt", cfg)
        _assert_bitwise(dest["m"].full_tensor(), full, f"{name} m")
        _assert_bitwise(dest["v"].full_tensor(), vec, f"{name} v")

    # 2b. Partial overlaps inside checksum blocks: "big" (40 MiB, blocks of 16) as 4 row shards
    # of 10 MiB: ranks 0-1 share block 0, ranks 1-3 block 1; each block read once, verified.
    rows = {"big": distribute_tensor(torch.zeros_like(expected["big"]), mesh, [Shard(0)])}
    out["blocks"] = _load(rows, f"{uri}/ddp", cfg)
    _assert_bitwise(rows["big"].full_tensor(), expected["big"], "big in row shards")

    # 3. An incremental checkpoint: the unchanged items are references into the base.
    small = replicated_state(1, big_mib=4)
    inc = _blank(small)
    out["incremental"] = _load(inc, f"{uri}/inc", cfg)
    changed = replicated_state(1, big_mib=4)
    changed["w"] = changed["w"] + 1
    for k in ("big", "w", "rows"):
        _assert_bitwise(inc[k], changed[k], f"incremental {k}")

    # 4. A corrupt object: the rank that reads it finds it, every rank fails.
    out["corrupt"] = _outcome(lambda: _load(_blank(small), f"{uri}/bad", cfg))
    # 5. Every GET of a data object fails on rank 1 only (through the fault proxy).
    out["fault"] = _outcome(lambda: _load(_blank(expected), f"{uri}/ddp", proxied if rank == 1 else cfg))
    # 6. A failure after the exchange, on one rank: rank 2 refuses a pickled object the others accept.
    out["pickle"] = _outcome(lambda: _load({"when": None}, f"{uri}/pickled", cfg, allow_pickle=rank != 2))
    # the group is still good: a load after the failures works
    again = _blank(small)
    out["after"] = _load(again, f"{uri}/inc", cfg)
    _assert_bitwise(again["big"], small["big"], "after")

    # 7. A local error on rank 1 only before any message of a round is posted (building its
    # point-to-point messages), in a group whose collectives time out after 20 s: every rank
    # hears of it at that round's flags; before, the others waited for rank 1's messages until
    # the group timed out, and failed with the backend's timeout instead of PeerReadError.
    short = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=20))
    dest = {"big": distribute_tensor(torch.zeros_like(expected["big"]), mesh, [Shard(0)])}  # as in 2b: p2p
    reader = S3StorageReader(f"{uri}/ddp", config=cfg, cooperative=True, process_group=short)
    real = dist.P2POp
    if rank == 1:
        dist.P2POp = _refuse_p2p
    try:
        dcp.load(dest, storage_reader=reader, process_group=short)
        out["local"] = ("no error", reader.last_stats)
    except CheckpointException as e:
        own = e.failures[rank][0] if isinstance(e.failures[rank], tuple) else e.failures[rank]
        out["local"] = (type(own).__name__, getattr(own, "failed_ranks", None), str(own), sorted(e.failures))
    finally:
        dist.P2POp = real

    # 8. Two ranks, one per node, restore "dt" as 2 column shards (each needs part of every
    # stored row shard), in a process group of their own; the others take no part.
    members = [0, 2]
    pair = dist.new_group(members)  # every rank creates it; only its members use it
    if rank in members:
        dest = {"m": distribute_tensor(torch.zeros_like(full), DeviceMesh.from_group(pair, "cpu"), [Shard(1)])}
        reader = S3StorageReader(f"{uri}/dt", config=cfg, cooperative=True, process_group=pair)
        dcp.load(dest, storage_reader=reader, process_group=pair)
        _assert_bitwise(dest["m"].full_tensor(), full, "m on two ranks of their own")
        out["pair"] = reader.last_stats
    return out


def _refuse_p2p(*args, **kwargs):
    raise RuntimeError("injected: no point-to-point message on this rank")


def test_cooperative_reads_on_four_ranks_of_two_nodes(s3_server, bucket, s3_config, boto3_client, tmp_path):
    from fault_proxy import FaultProxy, Rule

    uri = f"s3://{bucket}/coop"
    state = replicated_state(1)
    dcp.save(state, storage_writer=S3StorageWriter(f"{uri}/ddp", config=s3_config), no_dist=True)
    small = replicated_state(1, big_mib=4)
    cfg64 = s3_config.replace(checksum="crc64nvme")
    dcp.save(small, storage_writer=S3StorageWriter(f"{uri}/base", config=cfg64), no_dist=True)
    changed = replicated_state(1, big_mib=4)
    changed["w"] = changed["w"] + 1
    dcp.save(changed, storage_writer=S3StorageWriter(f"{uri}/inc", config=cfg64, incremental_from=f"{uri}/base"),
             no_dist=True)
    dcp.save(small, storage_writer=S3StorageWriter(f"{uri}/bad", config=s3_config), no_dist=True)
    dcp.save({"when": datetime.date(2026, 1, 2)}, storage_writer=S3StorageWriter(f"{uri}/pickled", config=s3_config),
             no_dist=True)
    key = next(o["Key"] for o in boto3_client.list_objects_v2(Bucket=bucket, Prefix="coop/bad/")["Contents"]
               if o["Key"].endswith(".distcp"))
    body = bytearray(boto3_client.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[len(body) // 2] ^= 0x40  # one bit, inside "big"
    boto3_client.put_object(Bucket=bucket, Key=key, Body=bytes(body))

    u = urlsplit(s3_server.endpoint_url)
    with FaultProxy(u.hostname, u.port, seed=3) as proxy:
        proxy.add_rule(Rule("error", method="GET", path_regex=r"/coop/ddp/.*\.distcp", status=403,
                            code="AccessDenied"))
        proxied = s3_config.replace(endpoint_url=proxy.endpoint_url, max_retries=1)
        job = Job("coop", _worker, WORLD, (uri, s3_config, proxied))
        run_jobs(tmp_path, job, timeout=150)
        assert proxy.rules[0].fired >= 1

    stored = sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
    for rank, out in enumerate(job.results):
        ddp = out["ddp"]
        assert ddp.mode == "cooperative" and ddp.ranks == WORLD and ddp.rounds >= 4
        assert ddp.unique_bytes > stored  # and the two bytes items
        assert ddp.job_s3_bytes == ddp.unique_bytes  # every stored byte from S3 once
        assert ddp.job_peer_bytes == (WORLD - 1) * ddp.unique_bytes  # and to each other rank once
        assert ddp.slowest_rank_s >= ddp.seconds > 0
        assert out["plain"].mode == "plain" and out["plain"].s3_bytes == ddp.unique_bytes  # each rank: all
        for name in ("hsdp", "cols", "incremental", "after"):
            assert out[name].job_s3_bytes == out[name].unique_bytes, (name, out[name])
        assert out["hsdp"].job_peer_bytes > 0 and out["incremental"].rounds > 0
        blocks = out["blocks"]  # the whole item once; peers get the shared blocks: 16 MiB to rank 1, 2 x 16 of block 1
        assert blocks.unique_bytes == blocks.job_s3_bytes == 40 * MiB and blocks.job_peer_bytes == 48 * MiB, blocks
        assert out["corrupt"] is not None and out["corrupt"][1:] == ("IntegrityError", [0, 1, 2, 3]), out["corrupt"]
        assert out["fault"] is not None and out["fault"][1:] == ("AccessDeniedError", [0, 1, 2, 3]), out["fault"]
        assert out["fault"][0] == ("AccessDeniedError" if rank == 1 else "PeerReadError")
        assert out["pickle"] == ("UnsafePickleError" if rank == 2 else "PeerReadError", "UnsafePickleError",
                                 [0, 1, 2, 3]), out["pickle"]
        mine = ("RuntimeError", None, "injected: no point-to-point message on this rank") if rank == 1 else \
            ("PeerReadError", [1], "cooperative load: rank(s) [1] failed (see their errors); rank "
             f"{rank} stopped too")
        assert out.get("local") == (*mine, [0, 1, 2, 3]), out.get("local")
    owners = [out["corrupt"][0] for out in job.results]
    assert owners.count("IntegrityError") == 1 and owners.count("PeerReadError") == WORLD - 1
    assert ["pair" in out for out in job.results] == [True, False, True, False]
    for out in (job.results[0], job.results[2]):
        pair = out["pair"]
        assert pair.mode == "cooperative" and pair.ranks == 2, pair
        assert pair.job_s3_bytes == pair.unique_bytes and pair.job_peer_bytes > 0, pair  # once, then shared


def test_one_process_reads_plainly_and_reports_its_figures(uri, s3_config):
    import s3dcp

    state = {"w": torch.arange(1000, dtype=torch.float32), "n": 3}
    s3dcp.save(state, uri, config=s3_config)
    dest = {"w": torch.zeros(1000), "n": 0}
    s3dcp.load(dest, uri, config=s3_config, cooperative=True)
    assert torch.equal(dest["w"], state["w"]) and dest["n"] == 3
    stats = s3dcp.last_load_stats()
    assert stats.mode == "plain" and stats.peer_bytes == 0 and stats.rounds == 0
    assert stats.s3_bytes == stats.unique_bytes == stats.job_s3_bytes >= 4000
