"""Stores without flexible checksums or conditional PUT (``S3Config.compat``), against the real
server behind the fault proxy's store emulation (``fault_proxy.store_rules``), which rejects
exactly what those stores reject: aws-chunked trailers and ``x-amz-checksum-*`` headers (400),
``If-None-Match`` on PUT (501), CreateMultipartUpload without ``Content-Length`` (411); the
``"gcs"`` emulation also honours ``x-goog-if-generation-match: 0``.

Each test says what reached the store (the proxy's request records) and checks what is left
in the bucket with boto3 straight at the server.
"""

from __future__ import annotations

import re
import threading
from dataclasses import replace
from urllib.parse import urlsplit

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from fault_proxy import FaultProxy, Rule, store_rules
from s3dcp import S3Config, S3StorageReader, S3StorageWriter
from s3dcp.config import COMPAT_MODES, MiB, detect_compat
from s3dcp.errors import CheckpointExistsError, ConfigError, PreconditionFailedError, S3Error
from s3dcp.s3.client import S3Client
from s3dcp.saving.writer import METADATA_NAME

FAST_RETRIES = dict(max_retries=1, retry_backoff_base_ms=10, retry_max_backoff_s=1)
CHECKSUM_HEADER = re.compile(r"^(x-amz-trailer|x-amz-checksum-.*|x-amz-sdk-checksum-algorithm)$", re.I)


@pytest.fixture(params=["gcs", "basic"])
def store(request, s3_server):
    """(compat mode, proxy emulating that store in front of the real server)."""
    u = urlsplit(s3_server.endpoint_url)
    with FaultProxy(u.hostname, u.port) as proxy:
        for rule in store_rules(request.param):
            proxy.add_rule(rule)
        yield request.param, proxy


def _config(server, proxy: FaultProxy, compat: str | None, **overrides) -> S3Config:
    """5 MiB parts and 4 MiB objects: the 12 MiB tensor is a three-part multipart upload."""
    fields = dict(part_size_bytes=5 * MiB, object_size_target_bytes=4 * MiB, compat=compat, **FAST_RETRIES)
    fields.update(overrides)
    return replace(server.s3_config(**fields), endpoint_url=proxy.endpoint_url)


def _state(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    state = {f"layer{i}.weight": torch.randn(256 * 1024, generator=gen) for i in range(6)}  # 1 MiB each
    state["embedding"] = torch.randn(3 * MiB, generator=gen)  # 12 MiB
    state["half"] = torch.randn(1000, generator=gen).to(torch.bfloat16)
    state["step"] = seed
    return state


def _load(like: dict, uri: str, config: S3Config) -> dict:
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1 for k, v in like.items()}
    dcp.load(out, storage_reader=S3StorageReader(uri, config=config))
    return out


def _assert_bitwise(expected: dict, actual: dict) -> None:
    assert set(expected) == set(actual)
    for k, v in expected.items():
        if isinstance(v, torch.Tensor):
            assert actual[k].dtype == v.dtype and actual[k].shape == v.shape, k
            assert torch.equal(actual[k].view(torch.uint8), v.view(torch.uint8)), k
        else:
            assert actual[k] == v, k


def _root(exc: BaseException) -> BaseException:
    failures = getattr(exc, "failures", None)
    return next(iter(failures.values()))[0] if failures else exc


def _keys(boto3_client, bucket: str, prefix: str) -> list[str]:
    return sorted(o["Key"] for o in boto3_client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", []))


def _rejected(proxy: FaultProxy) -> list:
    """The requests the emulated store refused."""
    return [ev for ev in proxy.events if ev.action == "error"]


def _commit(proxy: FaultProxy):
    return [r for r in proxy.requests if r.method == "PUT" and r.target.endswith("/" + METADATA_NAME)]


def _when_fired(rule: Rule, action, stop: threading.Event) -> threading.Thread:
    """A thread that runs ``action`` once ``rule`` has been applied (or gives up when ``stop``
    is set)."""
    def run() -> None:
        while not stop.wait(0.02):
            if rule.fired:
                action()
                return

    thread = threading.Thread(target=run)
    thread.start()
    return thread


# ---------------------------------------------------------------------------- config
def test_compat_is_validated_and_named_in_the_error():
    for mode in (*COMPAT_MODES, None):
        assert S3Config(compat=mode).compat == mode
    with pytest.raises(ConfigError, match=r"compat='azure' must be None .* or one of \('s3', 'gcs', 'basic'\)"):
        S3Config(compat="azure")


@pytest.mark.parametrize("endpoint, expected", [
    ("https://storage.googleapis.com", "gcs"),
    ("storage.googleapis.com", "gcs"),  # no scheme: https
    ("https://STORAGE.googleapis.com:443", "gcs"),
    ("https://my-bucket.storage.googleapis.com", "gcs"),
    ("https://storage.googleapis.com.example.net", "s3"),
    ("https://notstorage.googleapis.com", "s3"),
    ("https://s3.eu-west-1.amazonaws.com", "s3"),
    ("http://127.0.0.1:9000", "s3"),
    ("https://minio.internal:9000", "s3"),  # a MinIO or Ceph host cannot be told by name
])
def test_compat_is_detected_from_the_endpoint_name_only(endpoint, expected, monkeypatch):
    monkeypatch.delenv("S3DCP_COMPAT", raising=False)  # S3Client resolves from os.environ
    # resolved() and S3Client() send nothing: the client is made lazily, on the first request
    config = S3Config(endpoint_url=endpoint, access_key_id="GOOG1E", secret_access_key="x")
    assert config.compat is None
    assert config.resolved({}).compat == expected
    assert detect_compat(config.resolved({}).endpoint_url) == expected
    assert S3Client(config).config.compat == expected


def test_an_explicit_compat_beats_detection():
    gcs = "https://storage.googleapis.com"
    assert S3Config(endpoint_url=gcs, compat="s3").resolved({}).compat == "s3"
    assert S3Config(endpoint_url=gcs, compat="basic").resolved({}).compat == "basic"
    assert S3Config(endpoint_url="http://127.0.0.1:9000", compat="gcs").resolved({}).compat == "gcs"


def test_compat_from_the_environment_sits_between_the_field_and_detection():
    gcs = "https://storage.googleapis.com"
    assert S3Config(endpoint_url="http://127.0.0.1:9000").resolved({"S3DCP_COMPAT": "basic"}).compat == "basic"
    assert S3Config(endpoint_url=gcs).resolved({"S3DCP_COMPAT": "s3"}).compat == "s3"
    assert S3Config(endpoint_url=gcs, compat="gcs").resolved({"S3DCP_COMPAT": "basic"}).compat == "gcs"
    assert S3Config(endpoint_url=gcs).resolved({"S3DCP_COMPAT": ""}).compat == "gcs"
    with pytest.raises(ConfigError, match=r"S3DCP_COMPAT='minio' must be one of"):
        S3Config(endpoint_url=gcs).resolved({"S3DCP_COMPAT": "minio"})


# ---------------------------------------------------------------------------- save and load
def test_save_and_load_in_compat_mode_through_the_emulated_store(s3_server, bucket, boto3_client, store):
    mode, proxy = store
    config = _config(s3_server, proxy, mode)
    uri = f"s3://{bucket}/ckpt"
    state = _state(1)
    dcp.save(state, storage_writer=S3StorageWriter(uri, config=config))
    _assert_bitwise(state, _load(state, uri, config))

    assert _rejected(proxy) == []
    requests = proxy.requests
    assert any("partNumber=" in r.target for r in requests), "the 12 MiB tensor must go in parts"
    assert not [r for r in requests for name, _ in r.headers if CHECKSUM_HEADER.match(name)]
    assert all(r.header("content-length") is not None for r in requests if r.target.endswith("?uploads"))
    (commit,) = _commit(proxy)
    assert commit.header("if-none-match") is None
    assert commit.header("x-goog-if-generation-match") == ("0" if mode == "gcs" else None)
    # no wire checksums, but every item has its checksum in the metadata (CRC64NVME, the default), verified on load
    md = S3StorageReader(uri, config=config).fetch_metadata()
    assert md.storage_data and all((loc.checksum or "").startswith("crc64nvme") for loc in md.storage_data.values())
    assert f"ckpt/{METADATA_NAME}" in _keys(boto3_client, bucket, "ckpt/")
    assert boto3_client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


@pytest.mark.parametrize("checksum", ["crc32c", None])
def test_the_default_mode_fails_with_a_clear_error_at_such_a_store(s3_server, bucket, boto3_client, store, checksum):
    """With trailer checksums the first upload is refused (400); without them (checksum=None)
    the data goes in but the If-None-Match commit is refused (501). Either way the error says
    what to set, and nothing is committed."""
    mode, proxy = store
    config = _config(s3_server, proxy, "s3", checksum=checksum)
    uri = f"s3://{bucket}/ckpt"
    with pytest.raises(CheckpointException) as e:
        dcp.save(_state(2), storage_writer=S3StorageWriter(uri, config=config))
    error = _root(e.value)
    assert isinstance(error, S3Error) and not isinstance(error, PreconditionFailedError), repr(error)
    assert (error.status, error.code) == ((400, "InvalidArgument") if checksum else (501, "NotImplemented"))
    assert 'compat="gcs"' in str(error) and 'compat="basic"' in str(error) and "compatibility.md" in str(error)
    assert {ev.status for ev in _rejected(proxy)} == ({400} if checksum else {501})
    assert f"ckpt/{METADATA_NAME}" not in _keys(boto3_client, bucket, "ckpt/")
    assert boto3_client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


# ---------------------------------------------------------------------------- create-only commit
def test_a_second_save_without_overwrite_fails_and_keeps_the_first(s3_server, bucket, store):
    mode, proxy = store
    config = _config(s3_server, proxy, mode)
    uri = f"s3://{bucket}/ckpt"
    first, second = _state(3), _state(4)
    dcp.save(first, storage_writer=S3StorageWriter(uri, config=config))
    with pytest.raises(CheckpointException) as e:
        dcp.save(second, storage_writer=S3StorageWriter(uri, config=config))
    assert isinstance(_root(e.value), CheckpointExistsError)
    _assert_bitwise(first, _load(first, uri, config))
    dcp.save(second, storage_writer=S3StorageWriter(uri, config=config, overwrite=True))
    _assert_bitwise(second, _load(second, uri, config))
    assert _rejected(proxy) == []


def test_a_commit_that_loses_the_race_fails_and_leaves_the_winner(s3_server, bucket, boto3_client, store):
    """Another writer's metadata lands while this save commits: on GCS after the check of the
    data objects (the LIST just before the commit), so the precondition of the PUT refuses it;
    with the checked PUT of "basic", between the PUT and its read-back, which sees it. Either
    way: CheckpointExistsError, and the other writer's object is what stays."""
    mode, proxy = store
    config = _config(s3_server, proxy, mode)
    key = f"ckpt/{METADATA_NAME}"
    # hold the request after which the other writer's object lands, long enough to put it
    if mode == "gcs":
        hold = Rule("delay", method="GET", query_has="list-type", delay_s=5, times=1)
    else:
        hold = Rule("delay", method="GET", path_regex=re.escape("/" + key) + "$", delay_s=5, times=1)
    proxy.clear_rules()  # rules are matched in order: the delay goes first
    proxy.add_rule(hold)
    for rule in store_rules(mode):
        proxy.add_rule(rule)
    other = b'{"written by": "another save"}'
    stop = threading.Event()
    landed = _when_fired(hold, lambda: boto3_client.put_object(Bucket=bucket, Key=key, Body=other), stop)
    try:
        with pytest.raises(CheckpointException) as e:
            dcp.save(_state(5), storage_writer=S3StorageWriter(f"s3://{bucket}/ckpt", config=config))
    finally:
        stop.set()
        landed.join()
    assert isinstance(_root(e.value), CheckpointExistsError), repr(_root(e.value))
    assert "another save committed this checkpoint first" in str(_root(e.value))
    assert boto3_client.get_object(Bucket=bucket, Key=key)["Body"].read() == other
    assert _rejected(proxy) == [] and hold.fired == 1


# ---------------------------------------------------------------------------- client operations
def test_create_only_put_and_multipart_copy_at_the_emulated_store(s3_server, bucket, boto3_client, store):
    mode, proxy = store
    client = S3Client(_config(s3_server, proxy, mode))
    try:
        assert client.put(bucket, "marker", b"first", if_none_match=True).result().size == 5
        with pytest.raises(PreconditionFailedError):
            client.put(bucket, "marker", b"second", if_none_match=True).result()
        assert boto3_client.get_object(Bucket=bucket, Key="marker")["Body"].read() == b"first"

        body = torch.randint(0, 256, (11 * MiB,), dtype=torch.uint8, generator=torch.Generator().manual_seed(6))
        client.put(bucket, "src", memoryview(body.numpy())).result()
        assert client.copy(bucket, "src", "dst", body.numel(), multipart_threshold_bytes=5 * MiB).result() == 11 * MiB
        assert boto3_client.get_object(Bucket=bucket, Key="dst")["Body"].read() == body.numpy().tobytes()
        (create,) = [r for r in proxy.requests if r.method == "POST" and r.target.endswith("/dst?uploads=")]
        assert create.header("content-length") == "0"  # GCS answers 411 without it
        assert _rejected(proxy) == []
    finally:
        client.close()


def test_a_checked_put_whose_request_cannot_start_fails_instead_of_hanging():
    from concurrent.futures import Future

    from s3dcp.errors import NoSuchKeyError
    from s3dcp.s3.compat import checked_put

    def cannot_start():
        raise RuntimeError("the request could not be made")

    absent: Future = Future()
    absent.set_exception(NoSuchKeyError("no such key", operation="HEAD", bucket="b", key="k"))
    for head, put in ((cannot_start, cannot_start), (lambda: absent, cannot_start)):  # at the HEAD, at the PUT
        done = checked_put(head, put, cannot_start, b"body", operation="PutObject", bucket="b", key="k")
        assert str(done.exception(timeout=5)) == "the request could not be made"
