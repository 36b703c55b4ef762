"""The same product against a second, independent S3 implementation: moto's server.

SeaweedFS runs the whole suite; here a focused set runs against moto (``moto[server]``, in a
child process on loopback), with every transport: multipart saves and loads (small parts to get
many), async saves, bf16 and 0-d tensors, incremental checkpoints with references, the
manager's retention, the command line (ls, inspect, verify, rm, gc), the compat modes, a
commit that loses a race, and ranged reads past an object's end.

Where the two servers differ, the test says what s3dcp does about it (docs/compatibility.md
names the differences).
"""

from __future__ import annotations

import copy
import json
import threading
import uuid

import pytest
import torch
import torch.distributed.checkpoint as dcp

import s3dcp
from s3dcp import CheckpointManager, S3StorageReader, S3StorageWriter
from s3dcp.config import TRANSPORTS, MiB
from s3dcp.errors import CheckpointExistsError, IntegrityError, PreconditionFailedError
from s3dcp.s3.client import S3Client

from cli.cli_run import run_cli
from moto_server import MotoServer


@pytest.fixture(scope="module")
def moto():
    with MotoServer() as server:
        yield server


@pytest.fixture(params=TRANSPORTS)
def transport(request):
    return request.param


@pytest.fixture
def mbucket(moto) -> str:
    name = f"m-{uuid.uuid4().hex[:12]}"
    moto.create_bucket(name)
    return name


@pytest.fixture
def mconfig(moto, transport):
    # 5 MiB parts and 12 MiB objects: every large object is a multipart upload of several parts
    return moto.s3_config(transport=transport, part_size_bytes=5 * MiB, object_size_target_bytes=12 * MiB,
                          download_part_size_bytes=5 * MiB)


def _state(seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(3 * MiB, generator=gen),  # 12 MiB: three 5 MiB parts
        "v": torch.randn(1024, 1024 + seed, generator=gen),
        "bf16": torch.randn(4097, generator=gen).to(torch.bfloat16),
        "scalar": torch.tensor(2.5 + seed),
        "step": 7 + seed,
        "extra": {"lrs": [0.1, 0.01]},
    }


def _blank(state: dict) -> dict:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else copy.deepcopy(v) for k, v in state.items()}


def _assert_same(expected: dict, actual: dict) -> None:
    for k, v in expected.items():
        if isinstance(v, torch.Tensor):
            assert actual[k].dtype == v.dtype and torch.equal(actual[k], v), k
        else:
            assert actual[k] == v, k


def test_sync_and_async_saves_load_bitwise(mbucket, mconfig, moto):
    state = _state()
    s3dcp.save(state, f"s3://{mbucket}/run/sync", config=mconfig)
    out = _blank(state)
    s3dcp.load(out, f"s3://{mbucket}/run/sync", config=mconfig)
    _assert_same(state, out)

    future = s3dcp.async_save(state, f"s3://{mbucket}/run/async", config=mconfig)
    future.result(timeout=120)
    out = _blank(state)
    dcp.load(out, storage_reader=S3StorageReader(f"s3://{mbucket}/run/async", config=mconfig))
    _assert_same(state, out)
    sizes = {o["Key"]: o["Size"] for o in moto.boto3_client().list_objects_v2(Bucket=mbucket)["Contents"]}
    assert max(sizes.values()) > 2 * mconfig.part_size_bytes  # really multipart
    assert moto.boto3_client().list_multipart_uploads(Bucket=mbucket).get("Uploads", []) == []


def test_incremental_references_and_manager_retention(mbucket, mconfig, moto):
    base = _state()
    with CheckpointManager(f"s3://{mbucket}/run", config=mconfig, keep_last=2, incremental=True) as manager:
        for step in (1, 2, 3):
            base["v"].add_(1)  # "w" and "bf16" stay: later steps reference them
            base["step"] = step
            manager.save(step, base)
        manager.wait()
        assert manager.latest() == 3
        out = _blank(base)
        assert manager.load(out) == 3
    _assert_same(base, out)
    assert [c.step for c in manager.list()] == [2, 3]
    keys = [o["Key"] for o in moto.boto3_client().list_objects_v2(Bucket=mbucket)["Contents"]]
    assert not any("/step-00000001/.metadata" in k for k in keys)
    # step 3's metadata names objects of an earlier step: the reference rule kept them
    md = moto.boto3_client().get_object(Bucket=mbucket, Key="run/step-00000003/.metadata")["Body"].read()
    assert b"../step-0000000" in md


def test_the_command_line_lists_inspects_verifies_removes_and_collects(capsys, monkeypatch, mbucket, mconfig, moto):
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto.endpoint_url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", moto.access_key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", moto.secret_access_key)
    monkeypatch.setenv("AWS_REGION", moto.region)
    monkeypatch.setenv("S3DCP_TRANSPORT", mconfig.transport)
    s3dcp.save(_state(), f"s3://{mbucket}/run/step-1", config=mconfig)
    s3dcp.save(_state(1), f"s3://{mbucket}/run/step-2", config=mconfig)
    moto.boto3_client().put_object(Bucket=mbucket, Key="run/step-3/__0_0.aaaaaaaaaaaa.distcp", Body=b"x" * 10)

    code, out, _ = run_cli(capsys, "ls", f"s3://{mbucket}/run/", "--json")
    assert code == 0
    listed = {row["name"]: row["state"] for row in json.loads(out)}
    assert listed["step-1"] == listed["step-2"] == "committed" and listed["step-3"] == "incomplete", listed
    code, out, _ = run_cli(capsys, "inspect", f"s3://{mbucket}/run/step-2", "--json")
    assert code == 0 and {t["fqn"] for t in json.loads(out)["tensors"]} >= {"w", "v", "bf16", "scalar"}
    code, out, _ = run_cli(capsys, "verify", f"s3://{mbucket}/run/step-2")
    assert code == 0, out
    code, out, err = run_cli(capsys, "rm", f"s3://{mbucket}/run/step-1", "--yes")
    assert code == 0, err
    code, out, err = run_cli(capsys, "gc", f"s3://{mbucket}/run/", "--older-than", "0s")
    assert code == 0, err
    keys = [o["Key"] for o in moto.boto3_client().list_objects_v2(Bucket=mbucket).get("Contents", [])]
    assert all(k.startswith("run/step-2/") for k in keys), keys


@pytest.mark.parametrize("compat", ["s3", "basic"])
def test_a_second_save_is_refused_and_a_lost_commit_race_keeps_the_winner(mbucket, mconfig, moto, compat):
    """The create-only commit: moto honours If-None-Match on PUT (compat "s3"), and the checked
    PUT of compat "basic" works there too. A commit whose metadata another writer put first
    fails with CheckpointExistsError and leaves the other writer's object."""
    config = mconfig.replace(compat=compat)
    uri = f"s3://{mbucket}/ckpt"
    first = _state(3)
    s3dcp.save(first, uri, config=config)
    with pytest.raises(CheckpointExistsError):
        s3dcp.save(_state(4), uri, config=config)
    out = _blank(first)
    s3dcp.load(out, uri, config=config)
    _assert_same(first, out)

    other = b'{"written by": "another save"}'
    writer = S3StorageWriter(f"s3://{mbucket}/race", config=config)
    real_put = writer.client.put

    def put_after_the_other(bucket, key, data, **kwargs):
        if key.endswith("/.metadata"):  # the other writer's commit lands just before ours
            moto.boto3_client().put_object(Bucket=bucket, Key=key, Body=other)
        return real_put(bucket, key, data, **kwargs)

    writer.client.put = put_after_the_other
    with pytest.raises(BaseException) as e:
        dcp.save(_state(5), storage_writer=writer)
    error = s3dcp.unwrap_error(e.value)
    assert isinstance(error, CheckpointExistsError) and "another save committed this checkpoint first" in str(error)
    assert moto.boto3_client().get_object(Bucket=mbucket, Key="race/.metadata")["Body"].read() == other


def test_create_only_put_ranged_reads_and_reads_past_the_end(mbucket, mconfig):
    client = S3Client(mconfig)
    try:
        client.put(mbucket, "once", b"first", if_none_match=True).result()
        with pytest.raises(PreconditionFailedError):
            client.put(mbucket, "once", b"second", if_none_match=True).result()
        data = torch.randint(0, 256, (11 * MiB + 5,), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
        client.put(mbucket, "big", memoryview(data.numpy())).result()
        for offset, length in [(0, 1), (data.numel() - 1, 1), (5 * MiB - 3, 6), (7, data.numel() - 7)]:
            out = bytearray(length)
            client.get_range_into(mbucket, "big", offset, out).result()
            assert out == data.numpy().tobytes()[offset:offset + length], (offset, length)
        for offset, length in [(data.numel() - 4, 10), (data.numel() + 100, 10)]:  # runs off the end / starts past it
            with pytest.raises(IntegrityError, match="shorter than its metadata says"):
                client.get_range_into(mbucket, "big", offset, bytearray(length)).result()
    finally:
        client.close()


def test_concurrent_saves_of_two_ranks_worth_of_objects_do_not_mix(mbucket, mconfig):
    """Two saves at once from two threads (as two ranks' uploads would be): both load bitwise."""
    states = [_state(10), _state(11)]
    errors: list[BaseException] = []

    def save(i):
        try:
            s3dcp.save(states[i], f"s3://{mbucket}/par/{i}", config=mconfig)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=save, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for i in (0, 1):
        out = _blank(states[i])
        s3dcp.load(out, f"s3://{mbucket}/par/{i}", config=mconfig)
        _assert_same(states[i], out)


def _answer(call) -> str:
    from botocore.exceptions import ClientError

    try:
        call()
    except ClientError as e:
        return f"{e.response['ResponseMetadata']['HTTPStatusCode']} {e.response['Error'].get('Code')}"
    return "accepted"


def test_where_moto_and_seaweedfs_differ(moto, s3_server):
    import boto3
    from botocore.config import Config

    """What s3dcp relies on, asked of both servers with boto3 (docs/compatibility.md's table).
    They agree on the create-only PUT and Complete, If-Match, a range past the end, ListParts'
    pages and a small non-last part; moto checks neither a PUT's wire checksum nor who signed it."""
    answers = {}
    for name, server in (("seaweedfs", s3_server), ("moto", moto)):
        c, b = server.boto3_client(), f"d-{uuid.uuid4().hex[:12]}"
        server.create_bucket(b)
        c.put_object(Bucket=b, Key="k", Body=b"hello world")
        u = c.create_multipart_upload(Bucket=b, Key="mp")["UploadId"]
        for n in (1, 2, 3):
            c.upload_part(Bucket=b, Key="mp", UploadId=u, PartNumber=n, Body=b"a" * (5 * MiB if n < 3 else 10))
        page = c.list_parts(Bucket=b, Key="mp", UploadId=u, MaxParts=1)
        parts = [{"PartNumber": p["PartNumber"], "ETag": p["ETag"]}
                 for p in c.list_parts(Bucket=b, Key="mp", UploadId=u)["Parts"]]
        c.put_object(Bucket=b, Key="mp", Body=b"there first")
        stranger = boto3.client("s3", endpoint_url=server.endpoint_url, region_name=server.region,
                                aws_access_key_id="wrong", aws_secret_access_key="wrong",
                                config=Config(s3={"addressing_style": "path"}))
        answers[name] = {
            "create-only PUT over an object": _answer(lambda: c.put_object(Bucket=b, Key="k", Body=b"x", IfNoneMatch="*")),
            "create-only Complete over an object": _answer(lambda: c.complete_multipart_upload(
                Bucket=b, Key="mp", UploadId=u, MultipartUpload={"Parts": parts}, IfNoneMatch="*")),
            "GET If-Match another ETag": _answer(lambda: c.get_object(Bucket=b, Key="k", IfMatch='"0"')),
            "GET a range past the end": _answer(lambda: c.get_object(Bucket=b, Key="k", Range="bytes=100-200")),
            "ListParts pages": (page["IsTruncated"], [p["PartNumber"] for p in page["Parts"]]),
            "PUT with a wrong CRC32C": _answer(lambda: c.put_object(Bucket=b, Key="c", Body=b"hi", ChecksumCRC32C="AAAAAA==")),
            "PUT with a wrong CRC64NVME": _answer(lambda: c.put_object(Bucket=b, Key="c", Body=b"hi",
                                                                      ChecksumCRC64NVME="AAAAAAAAAAA=")),
            "wrong credentials": _answer(lambda: stranger.list_objects_v2(Bucket=b)),
        }
    same = {"create-only PUT over an object": "412 PreconditionFailed",
            "create-only Complete over an object": "412 PreconditionFailed",
            "GET If-Match another ETag": "412 PreconditionFailed", "GET a range past the end": "416 InvalidRange",
            "ListParts pages": (True, [1])}
    for name in answers:
        assert {k: answers[name][k] for k in same} == same, name
    assert answers["seaweedfs"]["PUT with a wrong CRC32C"] == answers["seaweedfs"]["PUT with a wrong CRC64NVME"] \
        == "400 BadDigest"
    assert answers["moto"]["PUT with a wrong CRC32C"] == answers["moto"]["PUT with a wrong CRC64NVME"] == "accepted"
    assert answers["seaweedfs"]["wrong credentials"] == "403 InvalidAccessKeyId"
    assert answers["moto"]["wrong credentials"] == "accepted"


def test_a_corrupt_object_fails_the_load_where_the_server_checks_no_wire_checksum(mbucket, mconfig, moto):
    """moto stores what it is sent without checking the wire checksum: the items' own checksums
    in the metadata are what catches a changed byte, by name."""
    state = _state()
    s3dcp.save(state, f"s3://{mbucket}/run", config=mconfig)
    c = moto.boto3_client()
    key = next(o["Key"] for o in c.list_objects_v2(Bucket=mbucket, Prefix="run/")["Contents"]
               if o["Key"].endswith(".distcp") and o["Size"] > 12 * MiB - 1)  # the object holding "w"
    body = bytearray(c.get_object(Bucket=mbucket, Key=key)["Body"].read())
    body[len(body) // 2] ^= 0xFF
    c.put_object(Bucket=mbucket, Key=key, Body=bytes(body))
    with pytest.raises(BaseException) as e:
        s3dcp.load(_blank(state), f"s3://{mbucket}/run", config=mconfig)
    error = s3dcp.unwrap_error(e.value)
    assert isinstance(error, IntegrityError) and "checksum mismatch" in str(error) and "'w'" in str(error), error
