"""What long-running jobs hit: save identity across reused writers, the commit checking what it
commits, gc judging a save as a whole, every way out of async_save giving the arena back, and
metadata errors that stay typed. Against the real server."""

from __future__ import annotations

import concurrent.futures
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan

from s3dcp import HostBufferPool, S3StorageReader, S3StorageWriter, gc
from s3dcp.s3.client import S3Client
from s3dcp.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConfigError,
    IncompleteCheckpointError,
    NoSuchBucketError,
    root_error,
)
from s3dcp.format.layout import METADATA_NAME, object_name, parse_object_name


def _state(seed: int, n: int = 4, cols: int = 128) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(64, cols, generator=gen) for i in range(n)}


def _blank(state: dict) -> dict:
    return {k: torch.zeros_like(v) for k, v in state.items()}


def _load(uri: str, config, like: dict) -> dict:
    out = _blank(like)
    dcp.load(out, storage_reader=S3StorageReader(uri, config=config))
    return out


def _names(boto3_client, bucket: str, prefix: str) -> set[str]:
    listed = boto3_client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/")
    return {o["Key"].removeprefix(prefix + "/") for o in listed.get("Contents", [])}


def _save_ids(names) -> set[str]:
    return {p.token for p in map(parse_object_name, names) if p is not None}


def _assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


# ------------------------------------------------------------------ one identity per save
def test_the_coordinator_gives_every_rank_one_fresh_identity_per_save(s3_config):
    writer = S3StorageWriter("s3://bucket/x", config=s3_config)
    first = writer.prepare_global_plan([SavePlan([]), SavePlan([]), SavePlan([])])
    second = writer.prepare_global_plan([SavePlan([]), SavePlan([]), SavePlan([])])
    assert [p.storage_data.rank for p in first] == [0, 1, 2]
    assert len({p.storage_data.save_id for p in first}) == 1
    assert first[0].storage_data.save_id != second[0].storage_data.save_id


def test_a_reused_writer_never_writes_a_committed_checkpoints_object_names(bucket, s3_config, boto3_client):
    uri = f"s3://{bucket}/ckpt"
    writer = S3StorageWriter(uri, config=s3_config, overwrite=True)
    one, two = _state(1), _state(2)
    dcp.save(one, storage_writer=writer)
    first = _names(boto3_client, bucket, "ckpt") - {METADATA_NAME}
    dcp.save(two, storage_writer=writer)
    second = _names(boto3_client, bucket, "ckpt") - {METADATA_NAME}
    assert not first & second, "the second save rewrote objects of the committed first one"
    assert len(_save_ids(first)) == len(_save_ids(second)) == 1
    _assert_equal(_load(uri, s3_config, two), two)


class _FailsBeforeCommit(S3StorageWriter):
    def finish(self, metadata, results):
        raise RuntimeError("injected: the commit never happens")


def test_a_failed_overwrite_leaves_the_committed_checkpoint_intact(bucket, s3_config, boto3_client):
    uri = f"s3://{bucket}/ckpt"
    one = _state(1)
    dcp.save(one, storage_writer=S3StorageWriter(uri, config=s3_config))
    committed = _names(boto3_client, bucket, "ckpt")
    with pytest.raises(CheckpointException):
        dcp.save(_state(2), storage_writer=_FailsBeforeCommit(uri, config=s3_config, overwrite=True))
    left = _names(boto3_client, bucket, "ckpt")
    assert committed <= left, "a failed overwrite touched the committed checkpoint"
    assert len(_save_ids(left - committed)) == 1  # only the failed save's own objects, for gc
    _assert_equal(_load(uri, s3_config, one), one)


def test_overwrite_deletes_only_the_replaced_checkpoints_objects(bucket, s3_config, boto3_client):
    uri = f"s3://{bucket}/ckpt"
    client = S3Client(s3_config)
    dcp.save(_state(1), storage_writer=S3StorageWriter(uri, config=s3_config))
    replaced = _names(boto3_client, bucket, "ckpt") - {METADATA_NAME}
    other = object_name(0, 0, "0123456789ab")  # a concurrent save's object in the same directory
    client.put(bucket, f"ckpt/{other}", b"not yours").result()
    two = _state(2)
    dcp.save(two, storage_writer=S3StorageWriter(uri, config=s3_config, overwrite=True))
    left = _names(boto3_client, bucket, "ckpt")
    assert not left & replaced
    assert other in left
    _assert_equal(_load(uri, s3_config, two), two)


def test_plan_caching_still_gets_fresh_object_names(bucket, s3_config, boto3_client):
    """DCP's plan cache hands ranks the plan (and so the save id) of an earlier save; the
    writer must not reuse that id's object names."""
    uri = f"s3://{bucket}/ckpt"
    seen: list[set[str]] = []
    state = _state(3)
    for i in range(3):
        state = {k: v + i for k, v in _state(3).items()}
        dcp.save(state, storage_writer=S3StorageWriter(uri, config=s3_config, overwrite=True),
                 planner=DefaultSavePlanner(enable_plan_caching=True))
        seen.append(_names(boto3_client, bucket, "ckpt") - {METADATA_NAME})
    assert not seen[0] & seen[1] and not seen[1] & seen[2]
    _assert_equal(_load(uri, s3_config, state), state)


# ------------------------------------------------------------------ the commit checks
class _LosesAnObject(S3StorageWriter):
    """Someone deletes (or truncates) one of this save's objects between upload and commit."""

    truncate = False

    def finish(self, metadata, results):
        loc = results[0][0].storage_data
        key = self._uri.key(loc.object_name)
        if self.truncate:
            self.client.put(self._uri.bucket, key, b"short").result()
        else:
            self.client.delete(self._uri.bucket, [key]).result()
        super().finish(metadata, results)


@pytest.mark.parametrize("truncate", [False, True], ids=["deleted", "truncated"])
def test_the_commit_refuses_missing_or_short_objects(bucket, s3_config, boto3_client, truncate):
    uri = f"s3://{bucket}/ckpt"
    writer = _LosesAnObject(uri, config=s3_config)
    writer.truncate = truncate
    with pytest.raises(CheckpointException) as info:
        dcp.save(_state(1), storage_writer=writer)
    error = root_error(info.value)
    assert isinstance(error, IncompleteCheckpointError)
    assert ("wrong size" if truncate else "missing") in str(error) and ".distcp" in str(error)
    assert _names(boto3_client, bucket, "ckpt") == set()  # not committed, and its objects deleted
    with pytest.raises(CheckpointNotFoundError):
        S3StorageReader(uri, config=s3_config).fetch_metadata()


# ------------------------------------------------------------------ gc judges a save as a whole
def test_gc_spares_every_object_of_a_save_while_any_part_of_it_is_recent(bucket, s3_config, boto3_client):
    client = S3Client(s3_config)
    save_id = "aaaaaaaaaaaa"
    fast, slow = object_name(0, 0, save_id), object_name(1, 0, save_id)
    client.put(bucket, f"run/step-1/{fast}", b"finished long ago").result()
    time.sleep(2.5)
    client.put(bucket, f"run/step-1/{slow}", b"still uploading").result()
    # the fast rank's object is older than the threshold, the slow rank's is not: both stay
    report = gc(f"s3://{bucket}/run", older_than_s=1.5, client=client)
    assert report.deleted == []
    assert sorted(report.kept_recent) == [f"run/step-1/{fast}", f"run/step-1/{slow}"]
    assert gc(f"s3://{bucket}/run", older_than_s=1.5, client=client, now=time.time() + 60).deleted == \
        sorted([f"run/step-1/{fast}", f"run/step-1/{slow}"])


def test_gc_spares_a_save_whose_multipart_upload_is_recent(bucket, s3_config, boto3_client):
    client = S3Client(s3_config)
    save_id = "bbbbbbbbbbbb"
    done = object_name(0, 0, save_id)
    client.put(bucket, f"run/step-2/{done}", b"x").result()
    time.sleep(2.5)
    upload = boto3_client.create_multipart_upload(Bucket=bucket, Key=f"run/step-2/{object_name(1, 0, save_id)}")
    report = gc(f"s3://{bucket}/run", older_than_s=1.5, client=client)
    assert report.deleted == [] and report.aborted_uploads == []
    assert report.kept_recent == [f"run/step-2/{done}"]
    assert [u for _, u in report.kept_recent_uploads] == [upload["UploadId"]]


def test_upload_activity_is_the_newest_part(bucket, s3_config, boto3_client):
    client = S3Client(s3_config)
    key = "run/step-3/" + object_name(0, 0, "cccccccccccc")
    upload = boto3_client.create_multipart_upload(Bucket=bucket, Key=key)
    assert client.upload_activity(bucket, key, upload["UploadId"]).result() is None
    boto3_client.upload_part(Bucket=bucket, Key=key, UploadId=upload["UploadId"], PartNumber=1, Body=b"p" * 100)
    stamp = client.upload_activity(bucket, key, upload["UploadId"]).result()
    assert stamp is not None and abs(stamp - time.time()) < 120


# ------------------------------------------------------------------ every way out of async_save
@pytest.fixture
def pool():
    return HostBufferPool()


def _wait_idle(pool: HostBufferPool, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pool.in_use == 0:
            return True
        time.sleep(0.02)
    return False


def _async(state, writer, **kwargs):
    started = time.perf_counter()
    future = dcp.async_save(state, storage_writer=writer, **kwargs)
    return future, time.perf_counter() - started


@pytest.mark.parametrize("budget", [None, 1024 * 1024], ids=["whole", "budget"])
@pytest.mark.parametrize("where", ["reset", "planning", "upload", "commit"])
def test_every_failure_of_async_save_returns_and_gives_the_arena_back(bucket, s3_config, pool, where, budget):
    config = s3_config.replace(staging_budget_bytes=budget)
    uri = f"s3://{bucket}/ckpt"
    kwargs: dict = {}
    writer_cls = S3StorageWriter
    if where == "reset":  # DCP's first writer call fails: an invalid bucket name
        kwargs["checkpoint_id"] = "s3://Bad_Bucket/x"
        expected = ConfigError
    elif where == "planning":  # the coordinator refuses to overwrite a committed checkpoint
        dcp.save(_state(9), storage_writer=S3StorageWriter(uri, config=s3_config))
        expected = CheckpointExistsError
    elif where == "upload":
        uri = f"s3://{bucket}-missing/ckpt"
        expected = NoSuchBucketError
    else:
        writer_cls = _FailsBeforeCommit
        expected = RuntimeError
    state = _state(1, n=6, cols=1024)  # 1.5 MiB: over the budget, so rounds are needed
    future, returned_s = _async(state, writer_cls(uri, config=config, pool=pool), **kwargs)
    error = future.exception(timeout=60)  # DCP wraps it in CheckpointException, except from reset
    assert isinstance(root_error(error), expected), repr(error)
    assert _wait_idle(pool), f"a save that failed in {where} kept its staging arena"
    # and the next save works, in the same arena
    ok = _state(2, n=6, cols=1024)
    allocations = pool.allocations
    dcp.async_save(ok, storage_writer=S3StorageWriter(f"s3://{bucket}/next", config=config, pool=pool)).result(
        timeout=60)
    _assert_equal(_load(f"s3://{bucket}/next", s3_config, ok), ok)
    assert pool.allocations == allocations
    assert _wait_idle(pool)


def test_release_does_not_depend_on_the_save_thread_ending(bucket, s3_config, pool):
    """An executor that reuses one long-lived thread for every save (DCP's may, some day):
    the arena comes back when the save call returns, not when its thread ends."""
    executor = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    try:
        for i in range(3):
            state = _state(i)
            writer = S3StorageWriter(f"s3://{bucket}/t{i}", config=s3_config, pool=pool)
            staged = writer.stage(state)  # what dcp.async_save does on the training thread ...
            future = executor.submit(dcp.save, staged, storage_writer=writer)  # ... and in the background
            writer.synchronize_staging()
            del staged
            future.result(timeout=60)
            assert _wait_idle(pool, 10), f"save {i}: the arena was not given back while the thread lives"
            _assert_equal(_load(f"s3://{bucket}/t{i}", s3_config, state), state)
        assert pool.allocations == 1
    finally:
        executor.shutdown()


def test_a_writer_driven_by_hand_releases_at_the_end_of_write_data(s3_config, pool):
    writer = S3StorageWriter("s3://bucket/x", config=s3_config, pool=pool)
    writer.stage({"w": torch.ones(10)})
    lease = writer._lease
    writer._staging_end(writer._staging_begin())
    assert lease.over() and pool.in_use == 0


# ------------------------------------------------------------------ metadata errors stay typed
def test_a_missing_checkpoint_fails_typed_through_dcp(bucket, s3_config):
    with pytest.raises(CheckpointException) as info:
        dcp.load(_blank(_state(1)), storage_reader=S3StorageReader(f"s3://{bucket}/nothing", config=s3_config))
    assert isinstance(root_error(info.value), CheckpointNotFoundError)
    assert not any(isinstance(e, AssertionError) for e in _failures(info.value))


def test_read_metadata_has_no_rank_local_fallback():
    import inspect

    # DCP retries read_metadata(rank=r) on one rank only, and then skips collectives on that
    # rank alone, when the signature has a parameter named "kwargs".
    assert "kwargs" not in inspect.signature(S3StorageReader.read_metadata).parameters


def _failures(error: CheckpointException) -> list[BaseException]:
    out = []
    for value in error.failures.values():
        out.append(value[0] if isinstance(value, tuple) else value)
    return out


# ------------------------------------------------------------------ two ranks, a fault on one
def _two_rank_worker(rank: int, world: int, uri: str, cfg, proxied) -> dict:
    """ShardedTensor staging, one save identity across ranks, and metadata faults on rank 1
    only (its reads go through the fault proxy)."""
    from torch.distributed._shard.sharded_tensor import Shard, ShardMetadata, init_from_local_shards

    out: dict = {}

    def sharded(values):
        md = ShardMetadata([rank * 4, 0], [4, 8], f"rank:{rank}/cpu")
        return init_from_local_shards([Shard(values, md)], [8, 8])

    original = torch.arange(rank * 32, (rank + 1) * 32, dtype=torch.float32).reshape(4, 8)
    st = sharded(original.clone())
    future = dcp.async_save({"st": st, "plain": torch.full((3,), float(rank))},
                           storage_writer=S3StorageWriter(f"{uri}/sharded", config=cfg))
    st.local_shards()[0].tensor.add_(1000)  # the training loop goes on at once
    future.result(timeout=60)
    dest = sharded(torch.zeros(4, 8))
    dcp.load({"st": dest}, storage_reader=S3StorageReader(f"{uri}/sharded", config=cfg))
    assert torch.equal(dest.local_shards()[0].tensor, original), "sharded tensor round trip"

    mine = proxied if rank == 1 else cfg
    w = {"w": torch.zeros(16)}
    dcp.load(w, storage_reader=S3StorageReader(f"{uri}/transient", config=mine))
    out["transient"] = w["w"].tolist()
    try:
        dcp.load({"w": torch.zeros(16)}, storage_reader=S3StorageReader(f"{uri}/denied", config=mine))
        out["denied"] = None
    except CheckpointException as e:
        out["denied"] = (type(root_error(e)).__name__, sorted(e.failures))
    return out


def test_two_ranks_sharded_staging_and_a_metadata_fault_on_one_rank(s3_server, bucket, s3_config, tmp_path,
                                                                    boto3_client):
    from urllib.parse import urlsplit

    from fault_proxy import FaultProxy, Rule
    from test_multiprocess import Job, run_jobs

    uri = f"s3://{bucket}/two"
    w = {"w": torch.arange(16, dtype=torch.float32)}
    for name in ("transient", "denied"):
        dcp.save(w, storage_writer=S3StorageWriter(f"{uri}/{name}", config=s3_config))
    u = urlsplit(s3_server.endpoint_url)
    with FaultProxy(u.hostname, u.port, seed=7) as proxy:
        # rank 1: the metadata GET fails 3 times (more than the CRT's one retry), then works;
        # and access to the other checkpoint's metadata is denied for good
        proxy.add_rule(Rule("error", method="GET", path_regex=r"/two/transient/\.metadata", times=3))
        proxy.add_rule(Rule("error", method="GET", path_regex=r"/two/denied/\.metadata", status=403,
                            code="AccessDenied"))
        proxied = s3_config.replace(endpoint_url=proxy.endpoint_url, max_retries=1)
        job = Job("endurance", _two_rank_worker, 2, (uri, s3_config, proxied))
        run_jobs(tmp_path, job, timeout=120)
        assert proxy.rules[0].fired == 3
    for rank, result in enumerate(job.results):
        assert result["transient"] == w["w"].tolist(), rank
        # the same typed error on both ranks, naming rank 1 as the one that failed
        assert result["denied"] == ("AccessDeniedError", [1]), (rank, result["denied"])
    names = _names(boto3_client, bucket, "two/sharded") - {METADATA_NAME}
    assert len(_save_ids(names)) == 1 and {p.rank for p in map(parse_object_name, names)} == {0, 1}


# ------------------------------------------------------------------ staging copies (no server)
def test_staging_copies_every_kind_of_tensor_exactly(s3_config, pool):
    gen = torch.Generator().manual_seed(5)
    state = {
        "big": [torch.randn(3_000_000, generator=gen) for _ in range(3)],  # split into chunks across threads
        "small": {f"t{i}": torch.randn(i % 97 + 1, generator=gen) for i in range(600)},
        "transposed": torch.randn(300, 200, generator=gen).t(),
        "bf16": torch.randn(1001, generator=gen).to(torch.bfloat16),
        "bool": torch.rand(333, generator=gen) > 0.5,
        "complex": torch.randn(17, dtype=torch.complex64, generator=gen),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "int8": torch.randint(-128, 127, (4097,), dtype=torch.int8, generator=gen),
    }
    writer = S3StorageWriter("s3://bucket/x", config=s3_config, pool=pool)
    staged = writer.stage(state)
    writer.synchronize_staging()
    from s3dcp.saving import statetree

    pairs = list(zip(statetree.tensors(state), statetree.tensors(staged)))
    assert len(pairs) == 3 + 600 + 7
    for original, copy in pairs:
        assert copy.dtype == original.dtype and copy.shape == original.shape and copy.is_contiguous()
        assert torch.equal(copy, original)
        if original.numel():
            assert writer._lease.arena.owns(copy)
    writer._lease.release()
