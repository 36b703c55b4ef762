"""Incremental checkpoints against the real server: references into a sibling base, loads
(1 and 2 ranks, a 2→1 reshard, async, through the manager), deletion by reference (retention,
rm, gc), an rm of the base racing the commit, materialize, corruption in a base, and bases that
are refused before any upload."""

from __future__ import annotations

import json
import logging
import threading
import time
from urllib.parse import urlsplit

import pytest
import torch
import torch.distributed.checkpoint as dcp

from s3dcp import CheckpointManager, S3StorageReader, S3StorageWriter, cli
from s3dcp.s3.client import S3Client
from s3dcp.errors import (
    CheckpointNotFoundError,
    ConfigError,
    IncompleteCheckpointError,
    IntegrityError,
    MetadataFormatError,
    root_error,
)
from s3dcp import gc
from s3dcp.format.references import encode_pending
from s3dcp.lifecycle import deletion
from s3dcp.lifecycle.materialize import materialize
from s3dcp.format.layout import PENDING_NAME
from s3dcp.lifecycle.manager import delete_checkpoint
from s3dcp.uri import object_key, parse_s3_uri

from fault_proxy import FaultProxy
from test_multiprocess import Job, _assert_bitwise, run_jobs

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "base.weight": torch.randn(512, 128, generator=g),  # 256 KiB, frozen
        "base.embed": torch.randn(300, 64, generator=g).to(torch.bfloat16),  # frozen
        "lora.a": torch.randn(8, 128, generator=g),  # trained
        "step": 1,
    }


def _blank(sd: dict) -> dict:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in sd.items()}


def _save(sd: dict, uri: str, client: S3Client, **kw) -> S3StorageWriter:
    writer = S3StorageWriter(uri, client=client, **kw)
    dcp.save(sd, storage_writer=writer, no_dist=True)
    return writer


def _load(sd: dict, uri: str, client: S3Client) -> dict:
    out = _blank(sd)
    dcp.load(out, storage_reader=S3StorageReader(uri, client=client), no_dist=True)
    return out


def _check(out: dict, sd: dict) -> None:
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            _assert_bitwise(out[k], v, k)
        else:
            assert out[k] == v, k


def _keys(boto3_client, bucket: str, prefix: str = "run/") -> list[str]:
    return sorted(o["Key"] for o in boto3_client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", []))


def _locations(uri: str, client: S3Client) -> dict[str, str]:
    md = S3StorageReader(uri, client=client).fetch_metadata()
    return {index.fqn: loc.object_name for index, loc in md.storage_data.items()}


def _metadata(uri: str, client: S3Client):
    return S3StorageReader(uri, client=client).fetch_metadata()


def _dangling(client: S3Client, boto3_client, bucket: str, run: str) -> list[str]:
    """Keys that a committed checkpoint under ``run`` references and that do not exist."""
    present = set(_keys(boto3_client, bucket, ""))
    missing = []
    for key in sorted(k for k in present if k.endswith("/.metadata")):
        uri = parse_s3_uri(f"s3://{bucket}/{key.rpartition('/')[0]}")
        if f"{uri}/".startswith(f"{run}/"):
            missing += [object_key(uri, n) for n in _locations(str(uri), client).values()
                        if object_key(uri, n) not in present]
    return missing


def _copy(sd: dict) -> dict:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in sd.items()}


def _wait(event: threading.Event, what: str) -> None:
    if not event.wait(60):
        raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(autouse=True)
def s3_env(monkeypatch, s3_server):
    """The CLI takes its endpoint and credentials from the environment, as users run it."""
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ENDPOINT_URL", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)


@pytest.fixture
def client(s3_config):
    return S3Client(s3_config)


@pytest.fixture
def chain(bucket, client):
    """step-1 (full, crc64nvme), step-2 (lora changed), step-3 (lora and a write through
    ``.data`` to base.weight): each incremental on the one before."""
    run = f"s3://{bucket}/run"
    sd = _state()
    states = {}
    _save(sd, f"{run}/step-1", client, item_checksum="crc64nvme")
    states[1] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in sd.items()}
    sd["lora.a"].add_(1.0)
    sd["step"] = 2
    w2 = _save(sd, f"{run}/step-2", client, incremental_from=f"{run}/step-1")
    states[2] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in sd.items()}
    version = sd["base.weight"]._version
    sd["base.weight"].data[7, 3] += 1.0  # through an alias: the version counter does not see it
    assert sd["base.weight"]._version == version
    sd["lora.a"].add_(1.0)
    sd["step"] = 3
    w3 = _save(sd, f"{run}/step-3", client, incremental_from=f"{run}/step-2")
    states[3] = sd
    return run, states, (w2, w3)


# ---------------------------------------------------------------------------- pure
def test_object_key_resolves_siblings_and_refuses_escapes():
    uri = parse_s3_uri("s3://b-1/run/step-2")
    assert object_key(uri, "__0_0.ab.distcp") == "run/step-2/__0_0.ab.distcp"
    assert object_key(uri, "../step-1/__0_0.ab.distcp") == "run/step-1/__0_0.ab.distcp"
    for bad in ("../../x/y", "a/b", "../step-1/../y", "..", "", "../step-1/", "../step-1/a/b", "/abs"):
        with pytest.raises(MetadataFormatError, match="refusing"):
            object_key(uri, bad)
    with pytest.raises(MetadataFormatError):  # a checkpoint at the bucket root has no siblings' parent
        object_key(parse_s3_uri("s3://b-1/step-2"), "../../x")


# ---------------------------------------------------------------------------- save and load
def test_unchanged_items_are_references_and_every_step_loads_bitwise(chain, client, bucket, boto3_client, capsys):
    run, states, (w2, w3) = chain
    for step, sd in states.items():
        _check(_load(sd, f"{run}/step-{step}", client), sd)
    loc2, loc3 = _locations(f"{run}/step-2", client), _locations(f"{run}/step-3", client)
    # step-2: the frozen tensors are references into step-1; lora and step are its own
    assert loc2["base.weight"].startswith("../step-1/") and loc2["base.embed"].startswith("../step-1/")
    assert "/" not in loc2["lora.a"] and "/" not in loc2["step"]
    # step-3: base.embed points at step-1 directly (never at step-2's reference); the write
    # through .data and lora were uploaded
    assert loc3["base.embed"] == loc2["base.embed"]
    assert "/" not in loc3["base.weight"] and "/" not in loc3["lora.a"]
    frozen = sum(states[1][k].numel() * states[1][k].element_size() for k in ("base.weight", "base.embed"))
    assert w2.last_stats.inherited_bytes == frozen and w2.last_stats.bytes < 8 * 1024
    assert w3.last_stats.inherited_bytes == 300 * 64 * 2  # only base.embed
    # no object was written into a base's directory by an incremental save
    assert len([k for k in _keys(boto3_client, bucket) if k.startswith("run/step-1/")]) == 2
    # inspect shows bytes written vs inherited, per base
    code, out = cli.main(["inspect", f"{run}/step-2", "--json"]), \
        capsys.readouterr().out
    assert code == 0
    report = json.loads(out)
    assert report["inherited"] == {"step-1": {"items": 2, "bytes": frozen}}
    assert report["written"]["items"] == 2


def test_async_incremental_save_holds_the_values_at_the_call(bucket, client):
    run = f"s3://{bucket}/run"
    sd = _state(3)
    _save(sd, f"{run}/step-1", client, item_checksum="crc64nvme")
    sd["lora.a"].add_(2.0)
    expected = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in sd.items()}
    writer = S3StorageWriter(f"{run}/step-2", client=client, incremental_from=f"{run}/step-1")
    response = dcp.async_save(sd, storage_writer=writer, no_dist=True)
    sd["base.weight"].mul_(3)  # after async_save returns, the caller may change its state
    sd["lora.a"].mul_(3)
    getattr(response, "upload_completion", response).result()
    _check(_load(expected, f"{run}/step-2", client), expected)
    assert _locations(f"{run}/step-2", client)["base.weight"].startswith("../step-1/")


def test_manager_async_incremental_does_not_wait_for_saves_in_flight(bucket, s3_config, monkeypatch):
    """max_inflight_checkpoints=2: a save while the previous one still commits returns at once,
    on the newest committed base; retention keeps that base until the save using it ends."""
    from dataclasses import replace

    client = S3Client(replace(s3_config, max_inflight_checkpoints=2))
    held = {1: threading.Event(), 2: threading.Event()}  # released by the test
    reached = {1: threading.Event(), 2: threading.Event()}
    real_finish = S3StorageWriter.finish

    def held_finish(self, metadata, results):  # the commit of steps 1 and 2 waits for the test
        step = int(self._uri.prefix.rpartition("-")[2])
        if step in held:
            reached[step].set()
            _wait(held[step], f"the test to let step {step} commit")
        return real_finish(self, metadata, results)

    monkeypatch.setattr(S3StorageWriter, "finish", held_finish)
    run = f"s3://{bucket}/run"
    sd = _state(12)
    manager = CheckpointManager(run, client=client, keep_last=1, incremental=True)  # async_mode by default
    try:
        manager.save(0, sd).result(timeout=60)
        sd["lora.a"].add_(1.0)
        f1 = manager.save(1, sd)
        _wait(reached[1], "step 1 to reach its commit")
        sd["lora.a"].add_(1.0)
        sd["step"] = 2
        expected = _copy(sd)
        box: dict = {}
        second = threading.Thread(target=lambda: box.setdefault("f2", manager.save(2, sd)), daemon=True)
        second.start()
        second.join(60)
        assert not second.is_alive(), "save(2) on the training thread waited for step 1's commit"
        assert not f1.done()
        assert manager.last_writer.incremental_from.prefix == "run/step-00000000"  # newest committed
        _wait(reached[2], "step 2 to reach its commit")
        held[1].set()
        f1.result(timeout=60)  # step 1's retention (keep_last=1) must keep step 0: step 2's base
        assert S3StorageReader(f"{run}/step-00000000", client=client).fetch_metadata() is not None
        held[2].set()
        box["f2"].result(timeout=60)
        assert [c.step for c in manager.list()] == [2]
        assert manager.last_writer.last_stats.inherited_bytes == 512 * 128 * 4 + 300 * 64 * 2
        manager.close()
    finally:
        for event in held.values():
            event.set()
        manager._saves.drain()
    _check(_load(expected, f"{run}/step-00000002", client), expected)
    assert _locations(f"{run}/step-00000002", client)["base.weight"].startswith("../step-00000000/")


def test_a_checkpoint_saved_with_the_defaults_is_a_base(bucket, client, caplog):
    """No item_checksum anywhere: the first save records CRC64NVME item checksums (the wire
    checksum stays CRC32C), so the next one inherits every unchanged item, without a warning."""
    run = f"s3://{bucket}/run"
    sd = _state(5)
    _save(sd, f"{run}/step-1", client)
    stored = _metadata(f"{run}/step-1", client).storage_data.values()
    assert all(loc.checksum.startswith("crc64nvme:") for loc in stored)
    sd["lora.a"].add_(1.0)
    sd["step"] = 2
    with caplog.at_level(logging.WARNING, logger="s3dcp"):
        writer = _save(sd, f"{run}/step-2", client, incremental_from=f"{run}/step-1")
    assert "item checksums" not in caplog.text
    frozen = sd["base.weight"].nbytes + sd["base.embed"].nbytes
    assert writer.last_stats.inherited_bytes == frozen and writer.last_stats.inherited_items == 2
    locations = _locations(f"{run}/step-2", client)
    assert locations["base.weight"].startswith("../step-1/") and locations["base.embed"].startswith("../step-1/")
    assert "/" not in locations["lora.a"] and "/" not in locations["step"]
    _check(_load(sd, f"{run}/step-2", client), sd)


def test_a_base_without_crc64_checksums_uploads_everything(bucket, client, caplog):
    """A checkpoint of an earlier s3dcp (CRC32C item checksums, its default then) still loads
    bit for bit, and as a base it is accepted with a warning and everything is uploaded."""
    run = f"s3://{bucket}/run"
    sd = _state(4)
    _save(sd, f"{run}/step-1", client, item_checksum="crc32c")  # 32 bits cannot decide
    assert all(loc.checksum.startswith("crc32c:") for loc in _metadata(f"{run}/step-1", client).storage_data.values())
    _check(_load(sd, f"{run}/step-1", client), sd)
    with caplog.at_level(logging.WARNING, logger="s3dcp"):
        writer = _save(sd, f"{run}/step-2", client, incremental_from=f"{run}/step-1")
    assert writer.last_stats.inherited_bytes == 0 and "no crc64nvme item checksums" in caplog.text
    assert all("/" not in name for name in _locations(f"{run}/step-2", client).values())
    _check(_load(sd, f"{run}/step-2", client), sd)


def _two_rank_worker(rank: int, world: int, bucket: str, cfg) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = _state(7)
    specs = {"base.weight": Shard(0), "base.embed": Shard(0), "lora.a": Replicate()}
    sd = {k: distribute_tensor(v, mesh, [specs[k]], src_data_rank=None) for k, v in full.items() if k != "step"}
    run = f"s3://{bucket}/run"
    dcp.save(sd, storage_writer=S3StorageWriter(f"{run}/step-1", config=cfg, item_checksum="crc64nvme"))
    sd["lora.a"].to_local().add_(1.0)
    if rank == 0:
        sd["base.embed"].to_local()[0, 0] += 1  # one element of rank 0's shard
    writer = S3StorageWriter(f"{run}/step-2", config=cfg, incremental_from=f"{run}/step-1")
    dcp.save(sd, storage_writer=writer)
    back = {k: distribute_tensor(torch.zeros_like(v), mesh, [specs[k]], src_data_rank=None) for k, v in full.items()
            if k != "step"}
    dcp.load(back, storage_reader=S3StorageReader(f"{run}/step-2", config=cfg))
    for k in back:
        _assert_bitwise(back[k].to_local(), sd[k].to_local(), f"rank {rank} {k}")
    return {"inherited": writer.last_stats.inherited_bytes, "uploaded": writer.last_stats.bytes,
            "full": {k: v.full_tensor() for k, v in sd.items()}}


def _two_rank_manager_worker(rank: int, world: int, bucket: str, cfg) -> dict:
    """Async incremental saves through the manager (its default mode) on two ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    specs = {"base.weight": Shard(0), "base.embed": Shard(0), "lora.a": Replicate()}
    sd = {k: distribute_tensor(v, mesh, [specs[k]], src_data_rank=None) for k, v in _state(11).items() if k != "step"}
    manager = CheckpointManager(f"s3://{bucket}/mrun", config=cfg, keep_last=2, incremental=True)
    writers = []
    for step in (1, 2, 3):
        sd["lora.a"].to_local().add_(1.0)
        manager.save(step, sd)  # async: returns once staged; the next one may change sd at once
        writers.append(manager.last_writer)
    manager.wait()
    back = {k: distribute_tensor(torch.zeros_like(v.full_tensor()), mesh, [specs[k]], src_data_rank=None)
            for k, v in sd.items()}
    assert manager.load(back) == 3
    for k in back:
        _assert_bitwise(back[k].to_local(), sd[k].to_local(), f"rank {rank} {k}")
    return {"inherited": [w.last_stats.inherited_bytes for w in writers],
            "bases": [None if w.incremental_from is None else w.incremental_from.prefix for w in writers],
            "listed": [c.step for c in manager.list()]}


def test_two_ranks_round_trip_and_a_two_to_one_reshard(s3_server, bucket, client, tmp_path):
    job = Job("incremental", _two_rank_worker, 2, (bucket, s3_server.s3_config()))
    managed = Job("incremental-manager", _two_rank_manager_worker, 2, (bucket, s3_server.s3_config()))
    run_jobs(tmp_path, job, managed)
    # async incremental saves through the manager: each rank inherited its frozen shards from
    # the checkpoint before, retention kept two
    for r in managed.results:
        assert r["bases"] == [None, "mrun/step-00000001", "mrun/step-00000002"]
        assert r["inherited"] == [0] + [256 * 128 * 4 + 150 * 64 * 2] * 2
        assert r["listed"] == [2, 3]
    r0, r1 = job.results
    # each rank inherited its own unchanged shards; rank 0's changed embed shard was uploaded
    assert r0["inherited"] == 256 * 128 * 4 and r1["inherited"] == 256 * 128 * 4 + 150 * 64 * 2
    md = S3StorageReader(f"s3://{bucket}/run/step-2", client=client).fetch_metadata()
    refs = sorted((i.fqn, tuple(i.offset)) for i, loc in md.storage_data.items()
                  if loc.object_name.startswith("../step-1/"))
    assert refs == [("base.embed", (150, 0)), ("base.weight", (0, 0)), ("base.weight", (256, 0))]
    # 2 -> 1: one process loads the two-rank incremental checkpoint into plain tensors
    full = r0["full"]
    out = _load(full, f"s3://{bucket}/run/step-2", client)
    for k, v in full.items():
        _assert_bitwise(out[k], v, f"resharded {k}")


# ---------------------------------------------------------------------------- integrity
def test_a_flipped_byte_in_a_base_object_fails_the_incremental_load(chain, client, bucket, boto3_client):
    run, states, _ = chain
    name = _locations(f"{run}/step-3", client)["base.embed"]  # ../step-1/<object>
    key = object_key(parse_s3_uri(f"{run}/step-3"), name)
    md = S3StorageReader(f"{run}/step-1", client=client).fetch_metadata()
    loc = next(loc for index, loc in md.storage_data.items() if index.fqn == "base.embed")
    body = bytearray(boto3_client.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[loc.offset + 11] ^= 0x01
    boto3_client.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    with pytest.raises(BaseException) as info:
        _load(states[3], f"{run}/step-3", client)
    err = root_error(info.value)
    assert isinstance(err, IntegrityError), repr(info.value)
    assert f"s3://{bucket}/{key}" in str(err) and "'base.embed'" in str(err)


# ---------------------------------------------------------------------------- refused bases
def _uploads(proxy: FaultProxy) -> list[str]:
    """Requests the proxy forwarded that write an object: PUT (objects, parts) and
    CreateMultipartUpload (POST ?uploads)."""
    return [f"{r.method} {r.target}" for r in proxy.requests
            if r.method == "PUT" or (r.method == "POST" and "uploads" in urlsplit(r.target).query)]


def test_bad_bases_are_refused_before_any_upload(s3_server, bucket, client, boto3_client):
    run = f"s3://{bucket}/run"
    sd = _state(5)
    _save(sd, f"{run}/step-1", client, item_checksum="crc64nvme")
    _save(sd, f"s3://{bucket}/other/step-1", client, item_checksum="crc64nvme")
    boto3_client.put_object(Bucket=bucket, Key="run/step-9/__0_0.abcdef012345.distcp", Body=b"x" * 10)
    u = urlsplit(s3_server.endpoint_url)
    with FaultProxy(u.hostname, u.port) as proxy:  # records every request head the writer sends
        proxied = S3Client(s3_server.s3_config(endpoint_url=proxy.endpoint_url))
        # outside the parent prefix, another bucket, the target itself: refused at construction
        for base in (f"s3://{bucket}/other/step-1", f"s3://{bucket}/run/deeper/step-1",
                     f"s3://{bucket}-x/run/step-1", f"{run}/step-2", f"s3://{bucket}/run"):
            with pytest.raises(ConfigError, match="same directory"):
                S3StorageWriter(f"{run}/step-2", client=proxied, incremental_from=base)
        # ...and when the path comes from checkpoint_id
        with pytest.raises(BaseException) as info:
            dcp.save(sd, storage_writer=S3StorageWriter(client=proxied, incremental_from=f"s3://{bucket}/other/step-1"),
                     checkpoint_id=f"{run}/step-2", no_dist=True)
        assert isinstance(root_error(info.value), ConfigError)
        assert _uploads(proxy) == []
        # missing, and incomplete (data objects but no .metadata: a failed or running save)
        for base, error in ((f"{run}/step-8", CheckpointNotFoundError), (f"{run}/step-9", IncompleteCheckpointError)):
            proxy.reset_stats()
            with pytest.raises(BaseException) as info:
                _save(sd, f"{run}/step-2", proxied, incremental_from=base)
            err = root_error(info.value)
            assert isinstance(err, error) and f"incremental_from={base!r}" in str(err), repr(info.value)
            assert proxy.requests, "the refusal read the base through the proxy"
            assert _uploads(proxy) == [], f"refusing {base} wrote to the bucket"
        # the recorder does see the uploads of a save that goes ahead
        proxy.reset_stats()
        sd["lora.a"].add_(1.0)
        _save(sd, f"{run}/step-3", proxied, incremental_from=f"{run}/step-1")
        assert _uploads(proxy)
    assert not [k for k in _keys(boto3_client, bucket) if k.startswith("run/step-2/")]


class _BaseDeletedBeforeCommit(S3StorageWriter):
    """A writer whose base loses an object between the uploads and the commit (a cleanup run
    elsewhere)."""

    boto3 = None
    doomed_key = ""

    def finish(self, metadata, results):
        self.boto3.delete_object(Bucket=self._uri.bucket, Key=self.doomed_key)
        return super().finish(metadata, results)


def test_commit_refuses_a_reference_whose_object_vanished(bucket, client, boto3_client):
    run = f"s3://{bucket}/run"
    sd = _state(8)
    _save(sd, f"{run}/step-1", client, item_checksum="crc64nvme")
    base_key = next(k for k in _keys(boto3_client, bucket) if k.endswith(".distcp"))
    sd["lora.a"].add_(1.0)
    writer = _BaseDeletedBeforeCommit(f"{run}/step-2", client=client, incremental_from=f"{run}/step-1")
    writer.boto3, writer.doomed_key = boto3_client, base_key
    with pytest.raises(BaseException) as info:
        dcp.save(sd, storage_writer=writer, no_dist=True)
    err = root_error(info.value)
    assert isinstance(err, IncompleteCheckpointError) and "missing" in str(err)
    assert f"1 missing: s3://{bucket}/{base_key}" in str(err) and "../" not in str(err)  # full names
    # nothing committed, and the failed save removed only its own objects (and its marker)
    assert _keys(boto3_client, bucket) == ["run/step-1/.metadata"]


def test_commit_refuses_a_referenced_object_that_is_shorter_than_the_base_recorded(bucket, client, boto3_client):
    run = f"s3://{bucket}/run"
    sd = _state(8)
    _save(sd, f"{run}/step-1", client, item_checksum="crc64nvme")
    md = S3StorageReader(f"{run}/step-1", client=client).fetch_metadata()
    last = max(md.storage_data.items(), key=lambda kv: kv[1].offset + kv[1].length)
    assert last[0].fqn in ("lora.a", "step")  # the tail of the base's object is not referenced below
    key = object_key(parse_s3_uri(f"{run}/step-1"), last[1].object_name)
    body = boto3_client.get_object(Bucket=bucket, Key=key)["Body"].read()
    # replaced by something shorter that still holds every byte step-2 references
    boto3_client.put_object(Bucket=bucket, Key=key, Body=body[:last[1].offset])
    sd["lora.a"].add_(1.0)
    sd["step"] = 2
    with pytest.raises(BaseException) as info:
        _save(sd, f"{run}/step-2", client, incremental_from=f"{run}/step-1")
    err = root_error(info.value)
    assert isinstance(err, IncompleteCheckpointError), repr(info.value)
    assert f"s3://{bucket}/{key} ({last[1].offset} bytes, expected {len(body)})" in str(err)
    assert not [k for k in _keys(boto3_client, bucket) if k.startswith("run/step-2/")]


def test_dtype_or_shape_changes_with_identical_bytes_are_uploaded(bucket, client):
    run = f"s3://{bucket}/run"
    sd = _state(9)
    _save(sd, f"{run}/step-1", client, item_checksum="crc64nvme")
    # the same bytes as another dtype of the same width
    retyped = dict(sd, **{"base.weight": sd["base.weight"].view(torch.int32),
                          "base.embed": sd["base.embed"].view(torch.float16)})
    w2 = _save(retyped, f"{run}/step-2", client, incremental_from=f"{run}/step-1")
    # the same bytes in another shape
    reshaped = dict(sd, **{"base.weight": sd["base.weight"].reshape(256, 256)})
    w3 = _save(reshaped, f"{run}/step-3", client, incremental_from=f"{run}/step-1")
    loc2, loc3 = _locations(f"{run}/step-2", client), _locations(f"{run}/step-3", client)
    assert "/" not in loc2["base.weight"] and "/" not in loc2["base.embed"]
    assert loc2["lora.a"].startswith("../step-1/") and loc2["step"].startswith("../step-1/")  # unchanged
    assert w2.last_stats.inherited_items == 2 and w2.last_stats.bytes >= (512 * 128 * 4 + 300 * 64 * 2)
    assert "/" not in loc3["base.weight"] and loc3["base.embed"].startswith("../step-1/")
    assert w3.last_stats.inherited_items == 3 and w3.last_stats.bytes >= 512 * 128 * 4
    _check(_load(retyped, f"{run}/step-2", client), retyped)
    _check(_load(reshaped, f"{run}/step-3", client), reshaped)


# ---------------------------------------------------------------------------- rm racing the commit
class _PausingWriter(S3StorageWriter):
    """Calls ``pause(point)`` in its commit: at "finish" (before anything) and at "checked"
    (after its checks, just before the metadata PUT)."""

    pause = staticmethod(lambda point: None)

    def finish(self, metadata, results):
        self.pause("finish")
        return super().finish(metadata, results)

    def _check_objects(self, locations):
        super()._check_objects(locations)
        self.pause("checked")


@pytest.mark.parametrize("order", ["rm_reads_references_first", "rm_runs_after_the_check"])
def test_rm_of_the_base_during_a_commit_never_leaves_a_dangling_reference(order, bucket, client, boto3_client,
                                                                          monkeypatch):
    run = f"s3://{bucket}/run"
    sd = _state(10)
    _save(sd, f"{run}/step-1", client, item_checksum="crc64nvme")
    sd["lora.a"].add_(1.0)
    expected = _copy(sd)
    at = {name: threading.Event() for name in ("finish", "checked", "refs_read", "save_done", "rm_done")}
    outcome: dict = {}

    def pause(point):
        at[point].set()
        if order == "rm_reads_references_first" and point == "finish":
            _wait(at["refs_read"], "the rm to read the references")
        if order == "rm_runs_after_the_check" and point == "checked":
            _wait(at["rm_done"], "the rm to end")

    def save():
        writer = _PausingWriter(f"{run}/step-2", client=client, incremental_from=f"{run}/step-1")
        writer.pause = pause
        try:
            dcp.save(sd, storage_writer=writer, no_dist=True)
            outcome["save"] = "committed"
        except BaseException as e:  # noqa: BLE001 - judged below
            outcome["save"] = root_error(e)
        finally:
            at["save_done"].set()

    real_references = deletion.references

    def references_then_wait(*args, **kwargs):  # the rm has read the references, has not deleted yet
        refs = real_references(*args, **kwargs)
        at["refs_read"].set()
        _wait(at["save_done"], "the save to end")
        return refs

    def rm():
        outcome["rm"] = delete_checkpoint(client, parse_s3_uri(f"{run}/step-1"))
        at["rm_done"].set()

    saver = threading.Thread(target=save)
    saver.start()
    if order == "rm_reads_references_first":  # the rm deletes the base's metadata and reads before any marker
        _wait(at["finish"], "the save's commit")
        monkeypatch.setattr(deletion, "references", references_then_wait)
        remover = threading.Thread(target=rm)
        remover.start()
        remover.join(120)
        saver.join(120)
        assert _dangling(client, boto3_client, bucket, run) == []
        err = outcome["save"]
        assert isinstance(err, IncompleteCheckpointError) and "deleted during the save" in str(err), repr(err)
        assert f"s3://{bucket}/run/step-1/.metadata is gone" in str(err)
        assert _keys(boto3_client, bucket) == []  # the rm deleted the base, the save removed its objects
    else:  # the save has passed every check; the rm runs whole before the metadata PUT
        _wait(at["checked"], "the save's checks")
        rm()
        saver.join(120)
        assert _dangling(client, boto3_client, bucket, run) == []
        assert outcome["save"] == "committed", repr(outcome["save"])
        assert outcome["rm"].kept  # the marker made it keep what step-2 references
        _check(_load(expected, f"{run}/step-2", client), expected)
    assert not saver.is_alive()
    assert not [k for k in _keys(boto3_client, bucket) if k.endswith(PENDING_NAME)]


def test_a_base_replaced_during_the_save_is_refused_at_the_commit(bucket, client, boto3_client):
    run = f"s3://{bucket}/run"
    sd = _state(13)
    _save(sd, f"{run}/step-1", client, item_checksum="crc64nvme")

    def overwrite_the_base(point):
        if point == "finish":  # another job saves step-1 again (its old objects go)
            other = threading.Thread(target=_save, args=(_state(14), f"{run}/step-1", client),
                                     kwargs={"overwrite": True, "item_checksum": "crc64nvme"})
            other.start()
            other.join(60)

    writer = _PausingWriter(f"{run}/step-2", client=client, incremental_from=f"{run}/step-1")
    writer.pause = overwrite_the_base
    sd["lora.a"].add_(1.0)
    with pytest.raises(BaseException) as info:
        dcp.save(sd, storage_writer=writer, no_dist=True)
    err = root_error(info.value)
    assert isinstance(err, IncompleteCheckpointError) and "was replaced during the save" in str(err), repr(err)
    assert f"s3://{bucket}/run/step-1/.metadata has ETag" in str(err)
    assert [k for k in _keys(boto3_client, bucket) if not k.startswith("run/step-1/")] == []


def test_gc_deletes_stale_pending_markers_and_then_what_only_they_kept(chain, client, bucket, boto3_client):
    run, states, _ = chain
    # a save of step-4 died between its marker and its commit: the marker names step-2's own
    # objects (which step-3 does not use)
    names = sorted(f"../step-2/{n}" for n in set(_locations(f"{run}/step-2", client).values())
                   - set(_locations(f"{run}/step-3", client).values()))
    assert names and all(n.count("/") == 2 for n in names)
    boto3_client.put_object(Bucket=bucket, Key=f"run/step-4/{PENDING_NAME}",
                            Body=encode_pending("0123456789ab", f"{run}/step-2", names))
    delete_checkpoint(client, parse_s3_uri(f"{run}/step-2"))
    kept = [k for k in _keys(boto3_client, bucket, "run/step-2/")]
    assert kept, "a fresh marker counts as references"
    report = gc(run, older_than_s=3600, client=client)
    assert report.stale_markers == [] and not set(kept) & set(report.deleted)
    report = gc(run, older_than_s=0, client=client, now=4e9)  # much later: the marker is stale
    assert report.stale_markers == [f"run/step-4/{PENDING_NAME}"] and set(kept) <= set(report.deleted)
    assert _keys(boto3_client, bucket, "run/step-4/") == [] and _keys(boto3_client, bucket, "run/step-2/") == []
    _check(_load(states[3], f"{run}/step-3", client), states[3])


# ---------------------------------------------------------------------------- deletion by reference
def test_rm_of_a_base_keeps_what_others_reference_and_gc_never_deletes_it(chain, client, bucket, boto3_client,
                                                                           capsys):
    run, states, _ = chain
    before = [k for k in _keys(boto3_client, bucket) if k.startswith("run/step-1/")]
    code = cli.main(["rm", f"{run}/step-1", "--yes", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["kept_referenced"] == [k for k in before if not k.endswith(".metadata")]
    with pytest.raises(IncompleteCheckpointError):  # gone as a checkpoint (objects without metadata)...
        S3StorageReader(f"{run}/step-1", client=client).fetch_metadata()
    # ...not a checkpoint of the manager any more, but what step-2 and step-3 reference is still
    # there, and ls shows it (it is stored, and paid for) with who holds it
    assert [c.step for c in CheckpointManager(run, client=client, name_format="step-{step}").list()] == [2, 3]
    assert cli.main(["ls", run, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["name"], r["state"]) for r in rows] == [
        ("step-1", "kept_for_references"), ("step-2", "committed"), ("step-3", "committed")]
    assert rows[0]["held_by"] == [f"{run}/step-2", f"{run}/step-3"]
    # gc, however old everything looks, keeps referenced objects
    report = gc(run, older_than_s=0, client=client, now=4e9)
    assert not [k for k in report.deleted if k.startswith("run/step-1/")]
    for step in (2, 3):
        _check(_load(states[step], f"{run}/step-{step}", client), states[step])
    # step-2 goes: its own objects that step-3 does not use go; step-1's object stays (step-3 uses it)
    result = delete_checkpoint(client, parse_s3_uri(f"{run}/step-2"))
    assert len([k for k in _keys(boto3_client, bucket) if k.startswith("run/step-1/")]) == 1
    assert result.released == []
    # the last reference goes: step-1's object, written seconds ago, is kept (a save in progress
    # there would look the same: gc's age rule, issue 33) ...
    step1 = [k for k in _keys(boto3_client, bucket) if k.startswith("run/step-1/")]
    result = delete_checkpoint(client, parse_s3_uri(f"{run}/step-3"))
    assert result.released == [] and result.kept_recent == step1 and _keys(boto3_client, bucket) == step1
    # ... and released once past the rule: by gc, or by the delete itself when it is that old
    assert gc(run, client=client, now=time.time() + 7200).deleted == step1 and _keys(boto3_client, bucket) == []


def test_retention_keep_last_1_over_incremental_checkpoints(bucket, client, boto3_client):
    run = f"s3://{bucket}/run"
    sd = _state(6)
    with CheckpointManager(run, client=client, keep_last=1, async_mode=False, incremental=True) as manager:
        for step in range(1, 5):
            sd["lora.a"].add_(1.0)
            sd["step"] = step
            manager.save(step, sd)
            assert manager.last_writer.last_stats.inherited_bytes == (0 if step == 1 else 512 * 128 * 4 + 300 * 64 * 2)
        assert [c.step for c in manager.list()] == [4]
        out = _blank(sd)
        assert manager.load(out) == 4
    _check(out, sd)
    # what is left: step 4's own objects, and step 1's object that holds the frozen tensors
    keys = _keys(boto3_client, bucket)
    assert [k for k in keys if "step-00000004" not in k] == [
        k for k in keys if k.startswith("run/step-00000001/") and k.endswith(".distcp")]
    assert len([k for k in keys if "step-00000001" in k]) == 1
    assert len([k for k in keys if "step-00000002" in k or "step-00000003" in k]) == 0


def test_a_base_listing_older_than_a_deletion_never_picks_the_deleted_step(bucket, client, monkeypatch):
    """A base choice whose LIST began before retention deleted a step may still list that step
    as committed: the step stays "doomed" (never a base) until that LIST is over, and is
    forgotten after, so a long job's manager does not remember every step it ever deleted."""
    run = f"s3://{bucket}/run"
    sd = _state(7)
    manager = CheckpointManager(run, client=client, keep_last=None, async_mode=False, incremental=True)
    listed, resume = threading.Event(), threading.Event()
    real_list = CheckpointManager.list

    def slow_list(self):  # the base choice on the "chooser" thread lists, then pauses
        infos = real_list(self)
        if threading.current_thread().name == "chooser":
            listed.set()
            _wait(resume, "the test to let the base choice go on")
        return infos

    monkeypatch.setattr(CheckpointManager, "list", slow_list)
    with manager:
        for step in (0, 1):
            manager.save(step, sd)
        box: dict = {}
        chooser = threading.Thread(target=lambda: box.setdefault("base", manager._choose_base(3)), name="chooser")
        chooser.start()
        _wait(listed, "the base choice to list steps 0 and 1 as committed")
        manager.keep_last = 1
        manager.save(2, sd)  # retention deletes steps 0 and 1 while that listing is in flight
        assert [c.step for c in manager.list()] == [2]
        assert 0 in manager._doomed and 1 in manager._doomed  # that listing may still see them
        resume.set()
        chooser.join(60)
        assert box["base"] is None, f"step {box['base']} was chosen as a base after its deletion"
        assert len(manager._doomed) == 0  # no listing in flight: nothing left to remember
        manager._release_base(3)
        for step in range(3, 9):  # plain retention: each save deletes one step, remembers none
            manager.save(step, sd)
            assert len(manager._doomed) == 0
        assert [c.step for c in manager.list()] == [8]
        assert manager.last_writer.incremental_from.prefix == "run/step-00000007"


def test_materialize_then_deleting_every_base_leaves_it_loadable(chain, client, bucket, boto3_client, capsys):
    run, states, _ = chain
    code = cli.main(["materialize", f"{run}/step-3", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["items"] == 1 and report["copied_objects"] == 1
    assert all("/" not in name for name in _locations(f"{run}/step-3", client).values())
    kept = [delete_checkpoint(client, parse_s3_uri(f"{run}/step-{step}")).kept_recent for step in (1, 2)]
    # what only the bases used is kept while it is young (a save in progress there looks the same:
    # gc's age rule, issue 33) and released once it is older, by gc (or a later rm)
    assert kept[1] and all(not k.startswith("run/step-3/") for k in kept[1])
    assert sorted(gc(run, client=client, now=time.time() + 7200).deleted) == sorted(kept[1])
    assert all(k.startswith("run/step-3/") for k in _keys(boto3_client, bucket))
    _check(_load(states[3], f"{run}/step-3", client), states[3])
    # a second run has nothing to do
    assert materialize(f"{run}/step-3", client=client).items == 0
    # and it is a base like any other: its copies hold exactly what it uses (step-1's object also
    # held lora, which step-3 changed), so an incremental save on it commits
    sd = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in states[3].items()}
    sd["lora.a"].add_(1.0)
    _save(sd, f"{run}/step-4", client, incremental_from=f"{run}/step-3")
    _check(_load(sd, f"{run}/step-4", client), sd)


def test_server_side_copy_in_parts(s3_server, bucket, boto3_client):
    from dataclasses import replace

    client = S3Client(replace(s3_server.s3_config(), part_size_bytes=5 * 2**20))
    body = torch.randint(0, 256, (11 * 2**20 + 123,), dtype=torch.uint8).numpy().tobytes()
    boto3_client.put_object(Bucket=bucket, Key="src", Body=body)
    assert client.copy(bucket, "src", "dst", len(body), multipart_threshold_bytes=2**20).result() == len(body)
    assert boto3_client.get_object(Bucket=bucket, Key="dst")["Body"].read() == body
    assert client.copy(bucket, "src", "dst2", len(body)).result() == len(body)  # one CopyObject
    assert boto3_client.get_object(Bucket=bucket, Key="dst2")["Body"].read() == body
    assert not boto3_client.list_multipart_uploads(Bucket=bucket).get("Uploads")
