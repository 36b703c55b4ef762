"""Multi-rank DCP save/load through s3dcp with real processes (gloo on CPU) and a real S3 server.

Every scenario starts its ranks with ``multiprocessing`` (forkserver, torch preloaded); each
rank runs a module-level worker under ``init_process_group("gloo", tcp://127.0.0.1:<port>)``
and does its checks itself (plain ``assert``). A rank's outcome (its return value, or its traceback) is
written to a file that the test reads back: a failing rank fails the test with that rank's
traceback. When a rank dies, the others get a short grace period and are then killed, and a
whole run is bounded by a deadline, so a hung collective fails the test instead of hanging CI.

Starting torch processes is slow, so each scenario shares one group of ranks and does
several checks in it; independent worlds of one scenario run concurrently, synchronised through
marker files (see :func:`_await_marker`).
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import signal
import socket
import time
import traceback
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

from s3dcp import S3Config, S3StorageReader, S3StorageWriter

pytestmark = pytest.mark.multiproc

RUN_TIMEOUT_S = 150.0  # one run_jobs call, start to finish (slow machines, busy CI)
FAILURE_GRACE_S = 10.0  # after one rank fails, how long the others get to report theirs
PG_TIMEOUT_S = 60.0  # gloo collectives; the run deadline usually fires first
MARKER_TIMEOUT_S = 120.0


# ================================================================================ launcher
@dataclass
class Job:
    """One world: ``world`` ranks running ``fn(rank, world, *args)`` in one process group."""

    name: str
    fn: Callable[..., Any]
    world: int
    args: tuple = ()
    results: list = field(default_factory=list)  # per rank, filled by run_jobs


# Ranks are forked from a forkserver that has imported torch once (~3 s of CPU per rank
# otherwise). The server never touches torch.distributed, threads or S3 clients, so the fork is
# clean; each rank still gets its own process group and CRT client.
_PRELOAD = ["torch", "torch.distributed.checkpoint", "torch.distributed.tensor", "torch.distributed.fsdp",
            "s3dcp"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # takes effect if this starts the server
    return ctx


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn, name: str, rank: int, world: int, port: int, outdir: str, args: tuple) -> None:
    """Child entry point: set up the process group, run ``fn``, record the outcome."""
    out = Path(outdir) / f"{name}-rank{rank}.pkl"
    # The rank's own stdout/stderr (native crashes, gloo aborts, faulthandler dumps) go to a log
    # that a failure report quotes; SIGUSR1 dumps every thread's stack (sent before a kill).
    log = open(Path(outdir) / f"{name}-rank{rank}.log", "w")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    torch.set_num_threads(1)  # many ranks share 2 cores
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
            timeout=timedelta(seconds=PG_TIMEOUT_S),
        )
        result = fn(rank, world, *args)
        payload = ("ok", result)
    except BaseException:
        payload = ("error", traceback.format_exc())
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - the real outcome is already recorded
                pass
    tmp = out.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(payload))
    tmp.rename(out)
    if payload[0] == "error":
        raise SystemExit(1)


def run_jobs(outdir: Path, *jobs: Job, timeout: float = RUN_TIMEOUT_S) -> None:
    """Run every job's ranks concurrently; fill ``job.results``; fail with every rank's traceback."""
    ctx = _context()
    outdir.mkdir(parents=True, exist_ok=True)
    procs: list[tuple[Job, int, Any]] = []
    killed: dict[str, str] = {}
    try:
        for job in jobs:
            port = _free_port()
            for rank in range(job.world):
                p = ctx.Process(target=_rank_main, name=f"{job.name}-rank{rank}",
                                args=(job.fn, job.name, rank, job.world, port, str(outdir), job.args))
                p.start()
                procs.append((job, rank, p))
        _supervise([p for _, _, p in procs], timeout, killed)
    finally:  # also on KeyboardInterrupt or a failed start: leave no rank behind
        for _, _, p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)

    problems = []
    for job, rank, p in procs:
        out = outdir / f"{job.name}-rank{rank}.pkl"
        if out.exists():
            status, value = pickle.loads(out.read_bytes())
        else:
            status = "missing"
            value = killed.get(p.name, f"exited with code {p.exitcode} without reporting")
        if status == "ok":
            job.results.append(value)
        else:
            job.results.append(None)
            problems.append(f"---- {job.name} rank {rank}/{job.world}: {status}\n{value}"
                            + _log_tail(outdir / f"{job.name}-rank{rank}.log"))
    if problems:
        pytest.fail(f"{len(problems)} rank(s) failed:\n" + "\n".join(problems), pytrace=False)


def _supervise(procs: list, timeout: float, killed: dict[str, str]) -> None:
    """Wait for every rank; once one fails, or at the deadline, kill the rest (after a stack dump)."""
    deadline = time.monotonic() + timeout
    first_failure = None
    while True:
        alive = [p for p in procs if p.is_alive()]
        if not alive:
            return
        now = time.monotonic()
        if first_failure is None and any(p.exitcode not in (None, 0) for p in procs):
            first_failure = now
        if now > deadline:
            why = f"timed out after {timeout:.0f} s"
        elif first_failure is not None and now > first_failure + FAILURE_GRACE_S:
            why = f"killed {FAILURE_GRACE_S:.0f} s after another rank failed"
        else:
            time.sleep(0.1)
            continue
        for p in alive:  # the stuck ranks' stacks into their logs, then kill
            killed[p.name] = why
            try:
                os.kill(p.pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        time.sleep(1.0)
        for p in alive:
            p.kill()
        return


def _log_tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return ""
    return f"\n  [{path.name}, last {len(text)} lines]\n" + "\n".join(text) if text else ""


def _mark(outdir: str, name: str) -> None:
    Path(outdir, f"{name}.done").touch()


def _await_marker(outdir: str, name: str, timeout: float = MARKER_TIMEOUT_S) -> None:
    """Wait until another (concurrent) world has called ``_mark(outdir, name)``."""
    path = Path(outdir, f"{name}.done")
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout:.0f} s")
        time.sleep(0.05)


# ================================================================================ helpers
def _save(state_dict: dict, uri: str, cfg: S3Config) -> S3StorageWriter:
    writer = S3StorageWriter(uri, config=cfg)
    dcp.save(state_dict, storage_writer=writer)
    return writer


def _load(state_dict: dict, uri: str, cfg: S3Config) -> S3StorageReader:
    reader = S3StorageReader(uri, config=cfg)
    dcp.load(state_dict, storage_reader=reader)
    return reader


def _assert_bitwise(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if not torch.equal(actual, expected):
        diff = (actual != expected).nonzero()
        raise AssertionError(f"{what}: {diff.shape[0]} of {actual.numel()} elements differ, "
                             f"first at {diff[0].tolist()}")


def _assert_tree_equal(a: Any, b: Any, path: str = "") -> None:
    """Exact equality of nested dicts/lists of tensors (DTensors compared shard by shard)."""
    from torch.distributed.tensor import DTensor

    if isinstance(a, DTensor) or isinstance(b, DTensor):
        assert isinstance(a, DTensor) and isinstance(b, DTensor), f"{path}: {type(a)} vs {type(b)}"
        assert a.placements == b.placements, f"{path}: {a.placements} vs {b.placements}"
        assert a.shape == b.shape, f"{path}: {a.shape} vs {b.shape}"
        _assert_bitwise(a.to_local(), b.to_local(), path)
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{path}: tensor vs {type(b)}"
        _assert_bitwise(a, b, path)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{path}: keys {list(a)} vs {list(b)}"
        for k in a:
            _assert_tree_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{path}: {a!r} vs {b!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_tree_equal(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def _blank(tree: Any) -> Any:
    """A load destination shaped like ``tree``: zero tensors, ``None`` for other leaves
    (DCP flattens nested dicts, so the nesting must stay)."""
    if isinstance(tree, dict):
        return {k: _blank(v) for k, v in tree.items()}
    return torch.zeros_like(tree) if isinstance(tree, torch.Tensor) else None


def _new_bucket(s3_server) -> str:
    name = f"mp-{uuid.uuid4().hex[:12]}"
    s3_server.create_bucket(name)
    return name


# ================================================================================ 1 + 5: plain tensors, dedup, object ownership
_PLAIN_NUMEL = 300_000  # 1.2 MB float32: with a 1 MiB object target every rank packs >1 object


def _plain_state(rank: int) -> dict:
    g = torch.Generator().manual_seed(1000 + rank)
    shared = torch.Generator().manual_seed(7)
    return {
        f"rank{rank}.a": torch.randn(_PLAIN_NUMEL, generator=g),
        f"rank{rank}.b": torch.randint(0, 2**31, (_PLAIN_NUMEL,), generator=g, dtype=torch.int32),
        f"rank{rank}.c": torch.randn(17, 3, generator=g).to(torch.bfloat16),
        f"rank{rank}.info": [rank, f"r{rank}"],  # a bytes (pickled) item
        "shared": torch.randn(64, 33, generator=shared),  # the same key and value on every rank
        "shared_scalar": torch.tensor(3.25),
        "config": {"lr": 0.5, "steps": [1, 2, 3]},  # replicated bytes items (flattened: config.lr, ...)
    }


def _plain_worker(rank: int, world: int, uri: str, cfg: S3Config) -> dict:
    """Several independent checks in one spawn; each one's outcome is reported to its own test
    (a failed check leaves the ranks in step: every DCP call has returned on all of them)."""
    outcome: dict[str, Any] = {}

    def check(name: str, fn: Callable[[], Any]) -> None:
        try:
            outcome[name] = ("ok", fn())
        except Exception:  # noqa: BLE001 - reported by the test that owns the check
            outcome[name] = ("error", traceback.format_exc())

    def plain():
        original = _plain_state(rank)
        writer = _save(original, uri, cfg)
        dest = _blank(original)
        _load(dest, uri, cfg)
        _assert_tree_equal(dest, original, "loaded")
        return {"objects": writer.last_stats.objects, "bytes": writer.last_stats.bytes}

    def overwrite():
        # overwrite=True over a committed 2-rank checkpoint: the second save wins, and the
        # coordinator deletes the first save's data objects of every rank (the test checks).
        original = _plain_state(rank)
        _save(_blank(original), f"{uri}-ow", cfg)
        dcp.save(original, storage_writer=S3StorageWriter(f"{uri}-ow", config=cfg, overwrite=True))
        dest = _blank(original)
        _load(dest, f"{uri}-ow", cfg)
        _assert_tree_equal(dest, original, "loaded after overwrite")

    def async_save(name: str, budget: int | None):
        # Once async_save returns the training loop may change the state in place; the
        # checkpoint must hold the values at the call.
        state = {k: v for k, v in _plain_state(rank).items() if isinstance(v, torch.Tensor)}
        snapshot = {k: v.clone() for k, v in state.items()}
        writer = S3StorageWriter(f"{uri}-{name}", config=cfg.replace(staging_budget_bytes=budget))
        future = dcp.async_save(state, storage_writer=writer)
        for v in state.values():
            v.add_(1)
        future.result(timeout=60)
        dest = _blank(snapshot)
        _load(dest, f"{uri}-{name}", cfg)
        _assert_tree_equal(dest, snapshot, f"loaded after {name}")

    def back_to_back():
        # Three async_saves without waiting in between: back-pressure must hold each one until
        # the previous save has fully ended (commit collectives included); otherwise two
        # threads run collectives on one process group at once and the ranks deadlock.
        state = {k: v for k, v in _plain_state(rank).items() if isinstance(v, torch.Tensor)}
        futures, snapshots = [], []
        for i in range(3):
            snapshots.append({k: v.clone() for k, v in state.items()})
            # Asking for two in flight: with two ranks s3dcp must still keep one (see staging).
            futures.append(dcp.async_save(state, storage_writer=S3StorageWriter(
                f"{uri}-b2b{i}", config=cfg.replace(max_inflight_checkpoints=2))))
            for v in state.values():
                v.add_(1)
        for f in futures:
            f.result(timeout=60)
        for i, snapshot in enumerate(snapshots):
            dest = _blank(snapshot)
            _load(dest, f"{uri}-b2b{i}", cfg)
            _assert_tree_equal(dest, snapshot, f"back-to-back save {i}")

    check("plain", plain)
    check("overwrite", overwrite)
    check("back-to-back", back_to_back)
    check("async", lambda: async_save("async", None))
    # A staging budget below the state, and below one tensor (1.2 MB > 1 MiB): the rest is
    # copied in rounds, or into a temporary copy, while earlier objects upload.
    check("async-budget", lambda: async_save("async-budget", 1024 * 1024))
    return outcome


def _outcome(results: list, name: str) -> list:
    """The per-rank values of check ``name`` of :func:`_plain_worker`; fails on any rank's error."""
    errors = [f"---- rank {r}:\n{res[name][1]}" for r, res in enumerate(results) if res[name][0] != "ok"]
    if errors:
        pytest.fail(f"{name} failed:\n" + "\n".join(errors), pytrace=False)
    return [res[name][1] for res in results]


@pytest.fixture(scope="module")
def plain_checkpoint(s3_server, tmp_path_factory):
    """One 2-rank run of :func:`_plain_worker`: ``(uri, config, per-rank outcomes)``."""
    uri = f"s3://{_new_bucket(s3_server)}/plain"
    cfg = s3_server.s3_config(object_size_target_bytes=1024 * 1024)
    job = Job("plain", _plain_worker, 2, (uri, cfg))
    run_jobs(tmp_path_factory.mktemp("plain"), job)
    return uri, cfg, job.results


def test_two_ranks_plain_save_load_dedups_replicated(plain_checkpoint):
    uri, cfg, results = plain_checkpoint
    stats = _outcome(results, "plain")  # each rank loaded everything back, bitwise
    md = S3StorageReader(uri, config=cfg).fetch_metadata()

    fqns = [index.fqn for index in md.storage_data]
    for key in ("shared", "shared_scalar", "config.lr", "config.steps"):  # replicated: written once
        assert fqns.count(key) == 1, f"{key} stored {fqns.count(key)} times"
    for rank in range(2):  # rank-specific: each written once, by its own rank
        for suffix in ("a", "b", "c", "info"):
            fqn = f"rank{rank}.{suffix}"
            entries = [(i, loc) for i, loc in md.storage_data.items() if i.fqn == fqn]
            assert len(entries) == 1, f"{fqn} stored {len(entries)} times"
            assert entries[0][1].object_name.startswith(f"__{rank}_"), (fqn, entries[0][1].object_name)
    assert set(md.state_dict_metadata) == set(fqns)
    # The ranks' own accounting matches the metadata: every stored byte was uploaded exactly once.
    assert sum(s["bytes"] for s in stats) == sum(loc.length for loc in md.storage_data.values())


def test_each_rank_uploads_only_its_own_objects(plain_checkpoint, boto3_client):
    uri, cfg, results = plain_checkpoint
    stats = _outcome(results, "plain")
    bucket, prefix = uri.removeprefix("s3://").split("/", 1)
    listed = boto3_client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/")
    names = sorted(o["Key"].removeprefix(prefix + "/") for o in listed.get("Contents", []))
    assert not listed.get("IsTruncated")

    assert names.count(".metadata") == 1
    data = [n for n in names if n != ".metadata"]
    assert all(n.endswith(".distcp") for n in data), names
    by_rank = {r: [n for n in data if n.startswith(f"__{r}_")] for r in range(2)}
    assert sorted(by_rank[0] + by_rank[1]) == sorted(data), f"objects of no rank: {names}"
    for rank in range(2):
        # Two 1.2 MB tensors per rank and a 1 MiB object target: several objects each.
        assert len(by_rank[rank]) == stats[rank]["objects"] >= 2, (rank, by_rank, stats)
        tokens = {n.split(".")[1] for n in by_rank[rank]}
        assert len(tokens) == 1, f"rank {rank} objects from several saves: {by_rank[rank]}"
    # Every object is referenced by the metadata, and every reference exists.
    md = S3StorageReader(uri, config=cfg).fetch_metadata()
    assert {loc.object_name for loc in md.storage_data.values()} == set(data)


def test_overwrite_leaves_only_the_new_objects_of_every_rank(plain_checkpoint, boto3_client):
    uri, cfg, results = plain_checkpoint
    _outcome(results, "overwrite")  # each rank loaded the second save's values
    bucket, prefix = uri.removeprefix("s3://").split("/", 1)
    listed = boto3_client.list_objects_v2(Bucket=bucket, Prefix=prefix + "-ow/")
    names = {o["Key"].removeprefix(prefix + "-ow/") for o in listed.get("Contents", [])}
    md = S3StorageReader(uri + "-ow", config=cfg).fetch_metadata()
    referenced = {loc.object_name for loc in md.storage_data.values()}
    assert names - {".metadata"} == referenced, f"left over: {sorted(names - referenced)}"
    for rank in range(2):  # each rank's objects: one save (its writer's token)
        mine = [n for n in referenced if n.startswith(f"__{rank}_")]
        assert mine and len({n.split(".")[1] for n in mine}) == 1, (rank, sorted(referenced))


@pytest.mark.parametrize("check", ["async", "async-budget", "back-to-back"])
def test_async_save_two_ranks_holds_the_values_at_the_call(plain_checkpoint, check):
    _outcome(plain_checkpoint[2], check)


# ================================================================================ 2: DTensor round trip
def _dtensor_full(seed: int = 42) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "row": torch.randn(10, 6, generator=g),  # Shard(0)
        "col": torch.randn(5, 11, generator=g),  # Shard(1), 11 columns: uneven
        "rep": torch.randn(7, 3, generator=g),  # Replicate
        "half": torch.randn(9, 4, generator=g).to(torch.bfloat16),  # Shard(0), uneven
        "ints": torch.arange(24, dtype=torch.int64).reshape(4, 6) * 10**12,  # Shard(1)
    }


def _dtensor_specs():
    from torch.distributed.tensor import Replicate, Shard

    return {"row": [Shard(0)], "col": [Shard(1)], "rep": [Replicate()], "half": [Shard(0)], "ints": [Shard(1)]}


def _distribute(full: dict, mesh, specs: dict, zeros: bool = False) -> dict:
    from torch.distributed.tensor import distribute_tensor

    # src_data_rank=None: every rank already holds the full value; no scatter needed.
    return {k: distribute_tensor(torch.zeros_like(full[k]) if zeros else full[k], mesh, specs[k],
                                 src_data_rank=None) for k in specs}


def _check_dtensors(loaded: dict, full: dict, mesh, specs: dict, what: str) -> None:
    expected = _distribute(full, mesh, specs)
    for k in specs:
        assert loaded[k].placements == tuple(specs[k]), f"{what} {k}: placements {loaded[k].placements}"
        _assert_bitwise(loaded[k].to_local(), expected[k].to_local(), f"{what} {k} (local shard)")
        _assert_bitwise(loaded[k].full_tensor(), full[k], f"{what} {k} (full)")


def _dtensor_worker(rank: int, world: int, bucket: str, cfg: S3Config) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    full = _dtensor_full()
    mesh = init_device_mesh("cpu", (world,))
    specs = _dtensor_specs()
    uri = f"s3://{bucket}/dtensor-{world}"
    _save(_distribute(full, mesh, specs), uri, cfg)
    dest = _distribute(full, mesh, specs, zeros=True)
    _load(dest, uri, cfg)
    _check_dtensors(dest, full, mesh, specs, "1-D mesh")

    # The same checkpoint loaded into other placements at the same world size.
    swapped = {"row": [Replicate()], "col": [Shard(0)], "rep": [Shard(1)], "half": [Shard(1)], "ints": [Shard(0)]}
    dest = _distribute(full, mesh, swapped, zeros=True)
    _load(dest, uri, cfg)
    _check_dtensors(dest, full, mesh, swapped, "1-D mesh, other placements")

    if world == 4:  # a 2-D mesh: chunks with offsets in both dims, and replicas of shards
        mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        specs2 = {"row": [Shard(0), Shard(1)], "col": [Replicate(), Shard(1)], "rep": [Replicate(), Replicate()],
                  "half": [Shard(1), Shard(0)], "ints": [Shard(0), Replicate()]}
        uri2 = f"s3://{bucket}/dtensor-2d"
        _save(_distribute(full, mesh2, specs2), uri2, cfg)
        dest = _distribute(full, mesh2, specs2, zeros=True)
        _load(dest, uri2, cfg)
        _check_dtensors(dest, full, mesh2, specs2, "2-D mesh")
        dest = _distribute(full, mesh, specs, zeros=True)  # 2-D saved, 1-D loaded
        _load(dest, uri2, cfg)
        _check_dtensors(dest, full, mesh, specs, "2-D saved, 1-D loaded")


@pytest.mark.parametrize("world", [2, 4])
def test_dtensor_save_load(world, s3_server, bucket, tmp_path):
    cfg = s3_server.s3_config()
    run_jobs(tmp_path, Job(f"dtensor{world}", _dtensor_worker, world, (bucket, cfg)))
    # Replicated DTensors are stored once, shards once per chunk.
    md = S3StorageReader(f"s3://{bucket}/dtensor-{world}", config=cfg).fetch_metadata()
    fqns = [i.fqn for i in md.storage_data]
    assert fqns.count("rep") == 1
    assert fqns.count("row") == world  # 10 rows split over 2 or 4 ranks: every rank has some


# ================================================================================ 3: resharding
_BIG_SHAPE = (4099, 2111)  # 34.6 MB float32: at world 1 and 2 each chunk is > 16 MiB, so it has
# per-block checksums, and a resharded load reads (and verifies) only some of its blocks.


def _reshard_full() -> dict[str, torch.Tensor]:
    """The 'rows' set: saved Shard(0); dim 0 uneven for every world size used."""
    g = torch.Generator().manual_seed(2024)
    return {
        "w": torch.randn(13, 7, generator=g),
        "v": torch.randn(29, generator=g),  # 1-D
        "h": torch.randn(11, 5, generator=g).to(torch.bfloat16),
        "few": torch.randn(3, 5, generator=g),  # fewer rows than 4 ranks: an empty shard at world 4
        "i": torch.randint(-2**40, 2**40, (9, 3), generator=g, dtype=torch.int64),
        "big": torch.randn(*_BIG_SHAPE, generator=g),
    }


def _reshard_cols() -> dict[str, torch.Tensor]:
    """The 'cols' set: saved Shard(1) at world 2, so every stored chunk is a column block."""
    g = torch.Generator().manual_seed(77)
    return {
        "c": torch.randn(6, 13, generator=g),
        "hc": torch.randn(5, 11, generator=g).to(torch.bfloat16),
        "c3": torch.randn(4, 9, 3, generator=g),  # 3-D: partial rows of 2-D slabs
    }


def _specs(names, *placements):
    return {k: list(placements) for k in names}


def _reshard_worker(rank: int, world: int, bucket: str, cfg: S3Config, outdir: str) -> None:
    """World 1, 2 and 4 run concurrently: each saves its checkpoints, then loads the others'."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    rows, cols = _reshard_full(), _reshard_cols()
    mesh = init_device_mesh("cpu", (world,))
    base = f"s3://{bucket}"

    def load_check(src: str, full: dict, specs: dict, what: str) -> S3StorageReader:
        dest = _distribute(full, mesh, specs, zeros=True)
        reader = _load(dest, f"{base}/{src}", cfg)
        expected = _distribute(full, mesh, specs)
        for k in specs:
            _assert_bitwise(dest[k].to_local(), expected[k].to_local(), f"{what}: {k} on rank {rank}/{world}")
            if k != "big":
                _assert_bitwise(dest[k].full_tensor(), full[k], f"{what}: {k} (full)")
        return reader

    _save(_distribute(rows, mesh, _specs(rows, Shard(0))), f"{base}/rows-w{world}", cfg)
    if world == 2:
        _save(_distribute(cols, mesh, _specs(cols, Shard(1))), f"{base}/cols-w2", cfg)
    dist.barrier()
    if rank == 0:
        _mark(outdir, f"saved-w{world}")

    if world == 2:
        _await_marker(outdir, "saved-w4")
        load_check("rows-w4", rows, _specs(rows, Shard(0)), "4->2 Shard(0)")
        load_check("rows-w4", rows, _specs(rows, Replicate()), "4->2 Replicate")
    elif world == 4:
        _await_marker(outdir, "saved-w2")
        _await_marker(outdir, "saved-w1")
        load_check("rows-w2", rows, _specs(rows, Shard(0)), "2->4 Shard(0)")
        reader = load_check("rows-w1", rows, _specs(rows, Shard(0)), "1->4 Shard(0)")
        if rank == 0:  # rows 0-1024 of the 34.6 MB stored "big": only its first 16 MiB block is fetched
            assert reader.last_read_bytes < 17 * 1024 * 1024, reader.last_read_bytes
        # Saved as rows, loaded as columns: every read takes a column range of stored rows.
        load_check("rows-w2", rows, _specs([k for k in rows if k != "v"], Shard(1)), "2->4 Shard(0)->Shard(1)")
        # Saved as columns: loaded as rows, and as a different column split (partial rows).
        load_check("cols-w2", cols, _specs(cols, Shard(0)), "2->4 Shard(1)->Shard(0)")
        load_check("cols-w2", cols, _specs(cols, Shard(1)), "2->4 Shard(1)->Shard(1)")
        load_check("cols-w2", cols, {"c": [Shard(0)], "hc": [Shard(1)], "c3": [Shard(2)]}, "2->4 mixed")


def test_resharding_matrix(s3_server, bucket, tmp_path):
    cfg = s3_server.s3_config()
    outdir = tmp_path / "run"
    run_jobs(outdir, *(Job(f"reshard-w{w}", _reshard_worker, w, (bucket, cfg, str(outdir))) for w in (1, 2, 4)))

    # World size 1, no process group at all: the DTensor checkpoints load into plain tensors.
    assert not dist.is_initialized()
    for src, full in (("rows-w2", _reshard_full()), ("rows-w4", _reshard_full()), ("cols-w2", _reshard_cols())):
        dest = {k: torch.zeros_like(v) for k, v in full.items()}
        _load(dest, f"s3://{bucket}/{src}", cfg)
        for k, v in full.items():
            _assert_bitwise(dest[k], v, f"{src} -> plain: {k}")

    # The block-checksummed chunks are really there (else the partial verification went untested).
    md = S3StorageReader(f"s3://{bucket}/rows-w2", config=cfg).fetch_metadata()
    big = [loc for i, loc in md.storage_data.items() if i.fqn == "big"]
    assert len(big) == 2 and all(loc.block_checksums for loc in big)


# ================================================================================ 4: FSDP2
def _fsdp_model(mesh, seed: int):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 33), torch.nn.ReLU(), torch.nn.Linear(33, 33), torch.nn.GELU(), torch.nn.Linear(33, 5),
    )
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    return model, optim


def _fsdp_step(model, optim, step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)  # each rank its own batch
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 5, generator=g)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


def _fsdp_worker(rank: int, world: int, uri: str, cfg: S3Config) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    model, optim = _fsdp_model(mesh, seed=0)
    for step in range(2):
        _fsdp_step(model, optim, step, rank)
    msd, osd = get_state_dict(model, optim)
    _save({"model": msd, "optim": osd}, uri, cfg)

    model2, optim2 = _fsdp_model(mesh, seed=1)  # other initial weights, no optimizer state yet
    assert not torch.equal(model2[0].weight.to_local(), model[0].weight.to_local())
    msd2, osd2 = get_state_dict(model2, optim2)
    _load({"model": msd2, "optim": osd2}, uri, cfg)
    set_state_dict(model2, optim2, model_state_dict=msd2, optim_state_dict=osd2)

    before, after = get_state_dict(model, optim), get_state_dict(model2, optim2)
    _assert_tree_equal(before[0], after[0], "model")
    _assert_tree_equal(before[1], after[1], "optim")
    assert after[1]["state"], "optimizer state is empty after load"

    loss1, loss2 = _fsdp_step(model, optim, 2, rank), _fsdp_step(model2, optim2, 2, rank)
    _assert_bitwise(loss2, loss1, "loss of the step after load")
    _assert_tree_equal(get_state_dict(model, optim), get_state_dict(model2, optim2), "after one more step")


def test_fsdp2_train_save_load_resume(s3_server, uri, tmp_path):
    run_jobs(tmp_path, Job("fsdp2", _fsdp_worker, 2, (uri, s3_server.s3_config())))
