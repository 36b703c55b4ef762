"""Failure behaviour against the real server, through the fault proxy (tests/fault_proxy.py).

Every test says what the fault did to the save or load (retried through, or failed with which
error, how fast) and then looks at what is left in the bucket with boto3 straight at the server
(never through the proxy): a committed checkpoint is exactly its metadata and the objects it
references, a failed save leaves no ``.metadata`` and no multipart uploads (or, when the
process died, leftovers that ``s3dcp.gc`` removes), and no earlier data is ever lost.
"""

from __future__ import annotations

import collections
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from fault_proxy import FaultProxy, Rule
from s3dcp import HostBufferPool, S3Config, S3StorageReader, S3StorageWriter, gc
from s3dcp.s3.client import S3Client
from s3dcp.config import MiB
from s3dcp.errors import (
    AccessDeniedError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConfigError,
    IncompleteCheckpointError,
    NoSuchBucketError,
    S3ConnectionError,
    S3Error,
    ThrottlingError,
)
from s3dcp.testing import SeaweedServer
from s3dcp.saving.writer import METADATA_NAME

# Retries that give up quickly, for the faults that never go away.
FAST_RETRIES = dict(max_retries=2, retry_backoff_base_ms=10, retry_max_backoff_s=1)


# ---------------------------------------------------------------------------- helpers
def _config(server: SeaweedServer, endpoint_url: str | None = None, **overrides) -> S3Config:
    """Small parts and objects, so a few MiB make several objects and multipart uploads."""
    fields = dict(part_size_bytes=5 * MiB, object_size_target_bytes=4 * MiB)
    if endpoint_url is not None:
        fields["endpoint_url"] = endpoint_url
    fields.update(overrides)
    return server.s3_config(**fields)


def _proxy(server: SeaweedServer, seed: int = 0) -> FaultProxy:
    u = urlsplit(server.endpoint_url)
    return FaultProxy(u.hostname, u.port, seed=seed)


@pytest.fixture
def proxy(s3_server):
    with _proxy(s3_server, seed=1234) as p:
        yield p


def _state(seed: int = 0, *, small: int = 6, large_elems: int = 3 * MiB, value: float | None = None) -> dict:
    """``small`` tensors of 1 MiB (packed four to an object) and one large one (12 MiB by
    default: its own object, three 5 MiB parts), plus non-tensor values."""
    gen = torch.Generator().manual_seed(seed)

    def make(n):
        return torch.full((n,), value) if value is not None else torch.randn(n, generator=gen)

    state = {f"layer{i}.weight": make(256 * 1024) for i in range(small)}
    if large_elems:
        state["embedding"] = make(large_elems)
    state["step"] = seed
    return state


def _blank(state: dict) -> dict:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1 for k, v in state.items()}


def _assert_same(expected: dict, actual: dict) -> None:
    assert set(expected) == set(actual)
    for k, v in expected.items():
        if isinstance(v, torch.Tensor):
            assert actual[k].dtype == v.dtype and actual[k].shape == v.shape, k
            assert torch.equal(actual[k].view(torch.uint8), v.view(torch.uint8)), k  # bitwise
        else:
            assert actual[k] == v, k


def _save(state: dict, uri: str, config: S3Config, **kw) -> None:
    dcp.save(state, storage_writer=S3StorageWriter(uri, config=config, **kw))


def _load(like: dict, uri: str, config: S3Config) -> dict:
    out = _blank(like)
    dcp.load(out, storage_reader=S3StorageReader(uri, config=config))
    return out


def _root(exc: BaseException) -> BaseException:
    """DCP wraps a rank's failure in CheckpointException; return the original error."""
    failures = getattr(exc, "failures", None)
    return next(iter(failures.values()))[0] if failures else exc


def _keys(boto3_client, bucket: str, prefix: str) -> list[str]:
    resp = boto3_client.list_objects_v2(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for o in resp.get("Contents", []))


def _uploads(boto3_client, bucket: str, prefix: str = "") -> list[dict]:
    return boto3_client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", [])


def _assert_committed_cleanly(boto3_client, bucket: str, prefix: str, config: S3Config) -> None:
    """What a committed checkpoint leaves: its metadata and the objects it references, nothing
    else, and no unfinished multipart upload."""
    uri = f"s3://{bucket}/{prefix}"
    md = S3StorageReader(uri, config=config).fetch_metadata()
    referenced = {f"{prefix}/{loc.object_name}" for loc in md.storage_data.values()}
    assert _keys(boto3_client, bucket, f"{prefix}/") == sorted(referenced | {f"{prefix}/{METADATA_NAME}"})
    assert _uploads(boto3_client, bucket, f"{prefix}/") == []


def _assert_nothing_left(boto3_client, bucket: str, prefix: str) -> None:
    assert _keys(boto3_client, bucket, f"{prefix}/") == []
    assert _uploads(boto3_client, bucket, f"{prefix}/") == []


def _refused_endpoint() -> str:
    """A loopback port nobody listens on (bound and closed: connections are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def _failing_save(state, uri, config, **kw) -> tuple[BaseException, float]:
    t0 = time.monotonic()
    with pytest.raises(CheckpointException) as e:
        _save(state, uri, config, **kw)
    return _root(e.value), time.monotonic() - t0


def _measured(what: str, seconds: float) -> None:
    """Print a measured time (shown with ``pytest -s``; the figures in the docs come from it)."""
    print(f"[measured] {what}: {seconds:.2f} s")


def _wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


# ---------------------------------------------------------------------------- 1. throttling, retried
@pytest.mark.timeout(120)
def test_twenty_percent_slowdown_is_retried_and_the_data_is_exact(s3_server, bucket, boto3_client, proxy):
    proxy.add_rule(Rule("error", probability=0.2, status=503, code="SlowDown"))  # every method
    config = _config(s3_server, proxy.endpoint_url)
    state = _state(1)
    t0 = time.monotonic()
    _save(state, f"s3://{bucket}/ckpt", config)
    _measured("20% SlowDown: save (succeeded) took", time.monotonic() - t0)
    save_faults = proxy.counts().get("error", 0)
    targets = [r.target for r in proxy.requests]
    assert any("partNumber=" in t for t in targets) and any(t.endswith("?uploads") for t in targets)  # multipart
    _assert_same(state, _load(state, f"s3://{bucket}/ckpt", config))  # through the same 20% faults
    load_faults = proxy.counts()["error"] - save_faults
    print(f"[faults] 503s injected: {save_faults} during the save, {load_faults} during the load")
    assert save_faults >= 2 and load_faults >= 1, proxy.counts()  # faults were injected (seeded)
    assert {e.status for e in proxy.events} == {503}
    _assert_committed_cleanly(boto3_client, bucket, "ckpt", config)
    assert len(_keys(boto3_client, bucket, "ckpt/")) >= 3  # several data objects


# ---------------------------------------------------------------------------- 2. resets, retried
@pytest.mark.timeout(120)
def test_connection_resets_mid_part_and_mid_response_are_retried(s3_server, bucket, boto3_client, proxy):
    proxy.add_rule(Rule("reset_request", method="PUT", query_has="partNumber", after_bytes=64 * 1024, times=2))
    # The commit PUT reaches the server but its answer is lost: the CRT sends it again, and
    # that retry fails its own If-None-Match. The save must still know it committed.
    proxy.add_rule(Rule("reset_response", method="PUT", path_regex=rf"/{re.escape(METADATA_NAME)}$", times=1))
    config = _config(s3_server, proxy.endpoint_url)
    state = _state(2)
    t0 = time.monotonic()
    _save(state, f"s3://{bucket}/ckpt", config)
    _measured("2 part resets + lost commit answer: save (succeeded) took", time.monotonic() - t0)
    assert proxy.counts() == {"reset_request": 2, "reset_response": 1}

    proxy.clear_rules()
    proxy.add_rule(Rule("reset_response", method="GET", path_regex=r"\.distcp$", after_bytes=64 * 1024, times=2))
    _assert_same(state, _load(state, f"s3://{bucket}/ckpt", config))
    assert proxy.counts() == {"reset_request": 2, "reset_response": 3}
    _assert_committed_cleanly(boto3_client, bucket, "ckpt", config)


@pytest.mark.timeout(120)
def test_a_lost_create_multipart_answer_leaves_an_upload_that_gc_aborts(s3_server, bucket, boto3_client, proxy):
    """The server started a multipart upload, the client never learnt its id and started
    another: the save succeeds, the orphan stays (nobody can know its id but a listing) until
    ``gc`` aborts it; the checkpoint is untouched."""
    proxy.add_rule(Rule("reset_response", method="POST", query_has="uploads", times=1))
    config = _config(s3_server, proxy.endpoint_url)
    state = _state(3, small=1)
    _save(state, f"s3://{bucket}/ckpt", config)
    assert proxy.counts() == {"reset_response": 1}
    orphans = _uploads(boto3_client, bucket, "ckpt/")
    assert len(orphans) == 1
    report = gc(f"s3://{bucket}/ckpt", older_than_s=0, now=time.time() + 10, config=config)
    assert report.deleted == [] and [u for _, u in report.aborted_uploads] == [orphans[0]["UploadId"]]
    _assert_committed_cleanly(boto3_client, bucket, "ckpt", config)
    _assert_same(state, _load(state, f"s3://{bucket}/ckpt", config))


# ---------------------------------------------------------------------------- 3. persistent throttling
@pytest.mark.timeout(60)
def test_persistent_slowdown_fails_fast_as_throttling_and_leaves_nothing(s3_server, bucket, boto3_client, proxy):
    proxy.add_rule(Rule("error", method="PUT"))
    proxy.add_rule(Rule("error", method="POST"))
    config = _config(s3_server, proxy.endpoint_url, **FAST_RETRIES)
    err, elapsed = _failing_save(_state(4), f"s3://{bucket}/ckpt", config)
    _measured("persistent 503 on every PUT/POST: save failed after", elapsed)
    assert isinstance(err, ThrottlingError), repr(err)
    assert "SlowDown" in str(err) and "throttl" in str(err) and "retries were exhausted" in str(err)
    assert elapsed < 10, elapsed
    # the request that failed was tried max_retries + 1 times (1 + 2 retries), none more; the
    # others were aborted once it had failed, maybe before their own retries ran out
    tries = collections.Counter(r.target for r in proxy.requests if r.method in ("PUT", "POST"))
    failed = [n for target, n in tries.items() if target.split("?")[0] == f"/{bucket}/{err.key}"]
    assert failed and max(failed) == 3 and max(tries.values()) == 3, (err.key, tries)
    _assert_nothing_left(boto3_client, bucket, "ckpt")


@pytest.mark.timeout(60)
def test_throttled_parts_abort_their_multipart_upload(s3_server, bucket, boto3_client, proxy):
    """The multipart upload is created, its parts are throttled for good: the CRT aborts it,
    and the writer deletes the objects that did upload."""
    proxy.add_rule(Rule("error", method="PUT", query_has="partNumber"))
    config = _config(s3_server, proxy.endpoint_url, **FAST_RETRIES)
    err, elapsed = _failing_save(_state(5), f"s3://{bucket}/ckpt", config)
    _measured("503 on every part upload: save failed after", elapsed)
    assert isinstance(err, ThrottlingError), repr(err)
    assert elapsed < 10, elapsed
    requests = proxy.requests
    assert any(r.method == "POST" and r.target.endswith("?uploads") for r in requests)  # the upload existed
    assert any(r.method == "DELETE" and "uploadId=" in r.target for r in requests)  # and was aborted
    assert any(r.method == "PUT" and "partNumber" not in r.target and r.fault is None
               for r in requests)  # small objects did upload...
    _assert_nothing_left(boto3_client, bucket, "ckpt")  # ...and were deleted again


# ---------------------------------------------------------------------------- 4. stalls, timed out
@pytest.mark.timeout(60)
def test_a_stalled_server_times_out_and_leaves_nothing(s3_server, bucket, boto3_client, proxy):
    config = _config(s3_server, proxy.endpoint_url, request_timeout_s=3)
    proxy.add_rule(Rule("stall"))
    err, elapsed = _failing_save(_state(6), f"s3://{bucket}/all", config)
    _measured("stall on every request: save failed after", elapsed)
    assert isinstance(err, S3ConnectionError) and "timed out" in str(err), repr(err)
    assert 2.9 <= elapsed < 10, elapsed
    _assert_nothing_left(boto3_client, bucket, "all")

    # only the parts stall: the timed-out (cancelled) upload is aborted, the rest deleted
    proxy.clear_rules()
    proxy.add_rule(Rule("stall", method="PUT", query_has="partNumber"))
    err, elapsed = _failing_save(_state(6), f"s3://{bucket}/parts", config)
    _measured("stall on every part upload: save failed after", elapsed)
    assert isinstance(err, S3ConnectionError) and "timed out after request_timeout_s=3" in str(err), repr(err)
    assert 2.9 <= elapsed < 10, elapsed
    assert any(r.method == "DELETE" and "uploadId=" in r.target for r in proxy.requests)
    _assert_nothing_left(boto3_client, bucket, "parts")


@pytest.mark.timeout(60)
def test_a_stalled_async_save_fails_its_future_without_blocking_training(s3_server, bucket, boto3_client, proxy):
    config = _config(s3_server, proxy.endpoint_url, request_timeout_s=3)
    pool = HostBufferPool()
    state = _state(7)
    proxy.add_rule(Rule("stall"))
    t0 = time.monotonic()
    future = dcp.async_save(state, storage_writer=S3StorageWriter(f"s3://{bucket}/ckpt", config=config, pool=pool))
    returned_s = time.monotonic() - t0
    assert returned_s < 2.5 and not future.done(), returned_s  # staging is local: no S3 round trip
    steps = 0
    while not future.done():  # the training loop goes on meanwhile
        state["layer0.weight"].add_(1)
        steps += 1
        assert time.monotonic() - t0 < 15, "the stalled save was never timed out"
        time.sleep(0.01)
    failed_after = time.monotonic() - t0
    _measured("async_save returned after", returned_s)
    _measured("stall on every request: async_save future failed after", failed_after)
    with pytest.raises(CheckpointException) as e:
        future.result()
    err = _root(e.value)
    assert isinstance(err, S3ConnectionError) and "timed out" in str(err), repr(err)
    assert 2.9 <= failed_after < 10 and steps > 10, (failed_after, steps)
    _assert_nothing_left(boto3_client, bucket, "ckpt")

    proxy.clear_rules()  # the server answers again: the next checkpoint to the same path works
    expected = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    future = dcp.async_save(state, storage_writer=S3StorageWriter(f"s3://{bucket}/ckpt", config=config, pool=pool))
    state["layer0.weight"].add_(1)
    future.result(timeout=60)
    _assert_same(expected, _load(expected, f"s3://{bucket}/ckpt", config))
    _assert_committed_cleanly(boto3_client, bucket, "ckpt", config)


# ---------------------------------------------------------------------------- 5. server dies
@pytest.mark.timeout(120)
def test_server_stopped_mid_save_fails_the_future_and_loses_no_data(tmp_path):
    data_dir = str(tmp_path / "weed")
    server = SeaweedServer(data_dir=data_dir, buckets=["crashy"])
    restarted = None
    try:
        server.start()
        with _proxy(server) as proxy:
            config = _config(server, proxy.endpoint_url, **FAST_RETRIES, request_timeout_s=30)
            earlier = _state(8, small=2, large_elems=0)
            _save(earlier, "s3://crashy/step-1", config)  # committed before the outage

            state = _state(9, small=8, large_elems=6 * MiB)  # 32 MiB: 2 objects of 4 MiB, one of 24 MiB
            # Slow uploads: every PUT (the commit too) waits 2 s, so the save cannot finish
            # (parts, then commit: over 4 s) in the ~1.3 s weed takes to go away.
            proxy.add_rule(Rule("delay", method="PUT", delay_s=2))
            pool = HostBufferPool()
            t0 = time.monotonic()
            future = dcp.async_save(state, storage_writer=S3StorageWriter("s3://crashy/step-2", config=config,
                                                                          pool=pool))
            assert time.monotonic() - t0 < 5 and not future.done()
            _wait_for(lambda: sum(r.method == "PUT" for r in proxy.requests) >= 3, 20, "uploads to start")
            # SIGTERM weed mid-upload, from another thread: stopping it can take seconds on a loaded
            # machine, and the training loop must keep stepping through all of it.
            stopper = threading.Thread(target=server.stop)
            stopped_at = time.monotonic()
            stopper.start()
            steps, longest_step, failed_after = 0, 0.0, None
            while failed_after is None or stopper.is_alive():
                step_start = time.monotonic()
                state["layer0.weight"].add_(1)
                steps += 1
                time.sleep(0.01)
                longest_step = max(longest_step, time.monotonic() - step_start)
                if failed_after is None and future.done():
                    failed_after = time.monotonic() - stopped_at
                assert time.monotonic() - stopped_at < 45, "the save did not notice the server was gone"
            stopper.join()
            _measured("server stopped mid-upload: future failed after the stop began by", failed_after)
            _measured("longest training step meanwhile", longest_step)
            with pytest.raises(CheckpointException) as e:
                future.result()
            assert isinstance(_root(e.value), S3ConnectionError), repr(_root(e.value))
            assert failed_after < 30 and steps > 10 and longest_step < 1, (failed_after, steps, longest_step)

        # same data dir, same keys: the server comes back (on new ports)
        restarted = SeaweedServer(data_dir=data_dir, access_key=server.access_key, secret_key=server.secret_key)
        restarted.start()
        direct = _config(restarted)
        b3 = restarted.boto3_client()
        _assert_same(earlier, _load(earlier, "s3://crashy/step-1", direct))  # nothing lost
        _assert_committed_cleanly(b3, "crashy", "step-1", direct)
        with pytest.raises((CheckpointNotFoundError, IncompleteCheckpointError)):
            S3StorageReader("s3://crashy/step-2", config=direct).fetch_metadata()  # never committed
        report = gc("s3://crashy", older_than_s=0, now=time.time() + 10, config=direct)  # what the outage left
        print(f"[left by the outage] objects: {report.deleted}, multipart uploads: {report.aborted_uploads}")
        _assert_nothing_left(b3, "crashy", "step-2")
        _assert_committed_cleanly(b3, "crashy", "step-1", direct)
        expected = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
        dcp.async_save(state, storage_writer=S3StorageWriter("s3://crashy/step-2", config=direct,
                                                             pool=pool)).result(timeout=60)
        _assert_same(expected, _load(expected, "s3://crashy/step-2", direct))
    finally:
        server.stop()
        if restarted is not None:
            restarted.stop()


# ---------------------------------------------------------------------------- 6. writer killed
@pytest.mark.timeout(120)
def test_a_killed_save_is_incomplete_and_gc_removes_it(s3_server, bucket, boto3_client, proxy):
    proxy.add_rule(Rule("delay", method="PUT", query_has="partNumber", delay_s=60))  # parts hang
    env = {**os.environ, **s3_server.env(), "AWS_ENDPOINT_URL_S3": proxy.endpoint_url}
    job = Path(__file__).with_name("crash_job.py")
    child = subprocess.Popen([sys.executable, str(job), f"s3://{bucket}/ckpt"], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def mid_save() -> bool:
            assert child.poll() is None, child.stdout.read()
            return (any(k.endswith(".distcp") for k in _keys(boto3_client, bucket, "ckpt/"))  # one object done
                    and _uploads(boto3_client, bucket, "ckpt/") != []  # another mid-multipart
                    and any("partNumber=" in r.target for r in proxy.requests))
        _wait_for(mid_save, 60, "the child to be mid-save")
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        child.stdout.close()
    assert child.returncode == -signal.SIGKILL
    proxy.stop()  # drop the held parts: nothing of the dead writer reaches the server any more

    config = _config(s3_server)
    data = [k for k in _keys(boto3_client, bucket, "ckpt/") if k.endswith(".distcp")]
    uploads = _uploads(boto3_client, bucket, "ckpt/")
    assert data and uploads and f"ckpt/{METADATA_NAME}" not in _keys(boto3_client, bucket, "ckpt/")
    with pytest.raises(IncompleteCheckpointError, match="is incomplete"):
        S3StorageReader(f"s3://{bucket}/ckpt", config=config).fetch_metadata()
    with pytest.raises(CheckpointException, match="is incomplete"):
        _load(_state(0, small=3, large_elems=0), f"s3://{bucket}/ckpt", config)

    report = gc(f"s3://{bucket}/ckpt", older_than_s=0, now=time.time() + 10, config=config)
    assert report.deleted == data
    assert sorted(u for _, u in report.aborted_uploads) == sorted(u["UploadId"] for u in uploads)
    _assert_nothing_left(boto3_client, bucket, "ckpt")
    with pytest.raises(CheckpointNotFoundError):
        S3StorageReader(f"s3://{bucket}/ckpt", config=config).fetch_metadata()


# ---------------------------------------------------------------------------- 6b. Ctrl-C
@pytest.mark.timeout(120)
@pytest.mark.parametrize("op", ["save", "load", "async_save"])
def test_ctrl_c_aborts_the_requests_in_flight(op, s3_server, bucket, boto3_client, proxy):
    """Ctrl-C while a save (or load, or the ``result()`` of an async save) waits for requests
    the server holds for 60 s: they are aborted, not waited for, so the KeyboardInterrupt
    reaches the caller at once; none is in flight any more when it does (a load's GETs write
    into its destinations and bounce buffers, a save's PUTs read the staged memory); a save
    leaves no object and no multipart upload behind. An async save used to raise at once and
    then upload on in the background (the interpreter waited for it at exit) and commit."""
    from interrupt_job import job_state

    uri = f"s3://{bucket}/ckpt"
    if op == "load":
        _save(job_state(), uri, _config(s3_server))
        proxy.add_rule(Rule("delay", method="GET", path_regex=r"\.distcp$", delay_s=60))
        held = lambda r: r.method == "GET" and r.target.endswith(".distcp")  # noqa: E731
    else:
        proxy.add_rule(Rule("delay", method="PUT", query_has="partNumber", delay_s=60))
        held = lambda r: r.method == "PUT" and "partNumber=" in r.target  # noqa: E731
    env = {**os.environ, **s3_server.env(), "AWS_ENDPOINT_URL_S3": proxy.endpoint_url}
    job = Path(__file__).with_name("interrupt_job.py")
    child = subprocess.Popen([sys.executable, str(job), op, uri], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def waiting() -> bool:
            assert child.poll() is None, child.stdout.read()
            return any(map(held, proxy.requests))
        _wait_for(waiting, 60, f"the child's {op} to wait for the held requests")
        time.sleep(0.5)  # every request of the save (load) has been issued by now
        interrupted = time.monotonic()
        child.send_signal(signal.SIGINT)
        output, _ = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    elapsed = time.monotonic() - interrupted
    _measured(f"Ctrl-C mid-{op}: the child was out after", elapsed)
    assert child.returncode == 0 and "interrupted; requests in flight: 0" in output, output
    assert elapsed < 30, elapsed  # waiting for the held requests would take 60 s
    if op != "load":
        _assert_nothing_left(boto3_client, bucket, "ckpt")


# ---------------------------------------------------------------------------- 7. reads that never get through
@pytest.mark.timeout(60)
def test_a_response_reset_on_every_attempt_fails_the_load_in_bounded_time(s3_server, bucket, boto3_client, proxy):
    state = _state(10, small=2)
    _save(state, f"s3://{bucket}/ckpt", _config(s3_server))
    proxy.add_rule(Rule("reset_response", method="GET", path_regex=r"\.distcp$", after_bytes=1024))
    config = _config(s3_server, proxy.endpoint_url, **FAST_RETRIES)
    t0 = time.monotonic()
    with pytest.raises(CheckpointException) as e:
        _load(state, f"s3://{bucket}/ckpt", config)
    elapsed = time.monotonic() - t0
    err = _root(e.value)
    _measured("GET response reset on every attempt: load failed after", elapsed)
    assert isinstance(err, S3ConnectionError) and ".distcp" in str(err), repr(err)
    assert elapsed < 10, elapsed
    assert proxy.counts()["reset_response"] >= 3  # tried 1 + max_retries times
    _assert_committed_cleanly(boto3_client, bucket, "ckpt", config)  # the checkpoint itself is fine
    _assert_same(state, _load(state, f"s3://{bucket}/ckpt", _config(s3_server)))


# ---------------------------------------------------------------------------- 8. secrets
class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def text(self) -> str:
        return "\n".join(self.format(r) + repr(r.args) for r in self.records)


def _describe(exc: BaseException) -> str:
    """Everything a user could see of an exception: str, repr, the traceback with its chain,
    and for DCP's CheckpointException the wrapped per-rank failures."""
    parts = [str(exc), repr(exc), "".join(traceback.format_exception(exc))]
    seen = set()
    stack = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        parts += [str(e), repr(e), repr(getattr(e, "__dict__", {}))]
        stack += [e.__cause__, e.__context__]
        for failure in (getattr(e, "failures", None) or {}).values():
            stack.append(failure[0] if isinstance(failure, tuple) else failure)
    return "\n".join(parts)


@pytest.mark.timeout(60)
def test_secrets_appear_in_no_log_error_or_repr(s3_server, bucket, capfd):
    secret = s3_server.secret_key
    wrong = "wrong-" + "9f3c" * 9
    handler = _Records()
    root_logger, s3dcp_logger = logging.getLogger(), logging.getLogger("s3dcp")
    levels = root_logger.level, s3dcp_logger.level
    root_logger.addHandler(handler)
    root_logger.setLevel(logging.DEBUG)
    s3dcp_logger.setLevel(logging.DEBUG)
    seen: list[str] = []
    try:
        config = _config(s3_server)
        state = _state(11, small=1)
        writer = S3StorageWriter(f"s3://{bucket}/ok", config=config)
        dcp.save(state, storage_writer=writer)
        reader = S3StorageReader(f"s3://{bucket}/ok", config=config)
        dcp.load(_blank(state), storage_reader=reader)
        client = S3Client(config)
        seen += [repr(config), str(config), repr(config.resolved()), repr(writer), repr(reader), repr(client),
                 repr(S3Config(access_key_id="AKIDEXAMPLE", secret_access_key=secret, session_token=secret))]

        bad = config.replace(secret_access_key=wrong)
        with pytest.raises(CheckpointException) as e:  # 403
            _save(state, f"s3://{bucket}/bad", bad)
        assert isinstance(_root(e.value), AccessDeniedError)
        seen.append(_describe(e.value))
        with pytest.raises(CheckpointException) as e:
            _load(state, f"s3://{bucket}/ok", bad)
        seen.append(_describe(e.value))
        with pytest.raises(AccessDeniedError) as e:
            gc(f"s3://{bucket}/ok", config=bad)
        seen.append(_describe(e.value))
        seen += [repr(bad), repr(S3Client(bad)), repr(S3StorageWriter(f"s3://{bucket}/bad", config=bad))]

        down = config.replace(endpoint_url=_refused_endpoint(), **FAST_RETRIES)
        with pytest.raises(CheckpointException) as e:  # nobody listening
            _save(state, f"s3://{bucket}/down", down)
        assert isinstance(_root(e.value), S3ConnectionError)
        seen.append(_describe(e.value))
        with pytest.raises(CheckpointException) as e:
            _load(state, f"s3://{bucket}/ok", down)
        seen.append(_describe(e.value))
    finally:
        root_logger.removeHandler(handler)
        root_logger.setLevel(levels[0])
        s3dcp_logger.setLevel(levels[1])
    out, err = capfd.readouterr()
    seen += [handler.text(), out, err]
    assert any(r.name == "s3dcp" and r.levelno == logging.DEBUG for r in handler.records)  # it did log
    text = "\n".join(seen)
    assert "403" in text and "AccessDenied" in text  # the errors are there, only the secrets are not
    assert secret not in text
    assert wrong not in text


# ---------------------------------------------------------------------------- 9. concurrent writers
@pytest.mark.timeout(60)
@pytest.mark.parametrize("trial", range(2))
def test_two_concurrent_saves_to_one_path_commit_exactly_one(s3_server, bucket, boto3_client, proxy, trial):
    # Hold each commit PUT a moment so both are in flight together: the server decides.
    proxy.add_rule(Rule("delay", method="PUT", path_regex=rf"/{re.escape(METADATA_NAME)}$", delay_s=0.5))
    config = _config(s3_server, proxy.endpoint_url)
    states = [_state(20 + i, small=5, large_elems=0, value=float(i + 1)) for i in range(2)]
    barrier = threading.Barrier(2)
    outcome: list = [None, None]

    def run(i: int) -> None:
        barrier.wait()
        try:
            _save(states[i], f"s3://{bucket}/ckpt", config)
            outcome[i] = "committed"
        except BaseException as e:  # noqa: BLE001 - CheckpointException is a BaseException
            outcome[i] = _root(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=45)
    assert outcome.count("committed") == 1, outcome
    winner = outcome.index("committed")
    loser = outcome[1 - winner]
    assert isinstance(loser, CheckpointExistsError), repr(loser)
    assert ("another save committed this checkpoint first" in str(loser)
            or "already holds a committed checkpoint" in str(loser)), str(loser)

    direct = _config(s3_server)
    loaded = _load(states[winner], f"s3://{bucket}/ckpt", direct)
    _assert_same(states[winner], loaded)  # every tensor from the one state, none from the other
    assert all(torch.all(v == winner + 1) for k, v in loaded.items() if isinstance(v, torch.Tensor))
    # The loser's objects (another token) are left unreferenced next to the commit; gc takes them.
    gc(f"s3://{bucket}/ckpt", older_than_s=0, now=time.time() + 10, config=direct)
    _assert_committed_cleanly(boto3_client, bucket, "ckpt", direct)
    _assert_same(states[winner], _load(states[winner], f"s3://{bucket}/ckpt", direct))


# ---------------------------------------------------------------------------- 10. bad input
@pytest.mark.timeout(60)
def test_an_endpoint_refusing_connections_is_a_connection_error(s3_server, bucket):
    config = _config(s3_server, _refused_endpoint(), **FAST_RETRIES)
    err, elapsed = _failing_save(_state(30, small=1, large_elems=0), f"s3://{bucket}/ckpt", config)
    _measured("refused endpoint: save failed after", elapsed)
    assert isinstance(err, S3ConnectionError), repr(err)
    assert "CONNECTION_REFUSED" in str(err) and "endpoint is reachable" in str(err)
    assert elapsed < 10, elapsed


@pytest.mark.timeout(60)
def test_no_credentials_at_all_is_a_clear_credentials_error(s3_server, bucket, tmp_path, monkeypatch):
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    (tmp_path / "config").write_text("")
    (tmp_path / "credentials").write_text("")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # the default chain must not ask IMDS
    config = S3Config(endpoint_url=s3_server.endpoint_url, region=s3_server.region, **FAST_RETRIES)
    err, elapsed = _failing_save(_state(31, small=1, large_elems=0), f"s3://{bucket}/ckpt", config)
    _measured("no credentials: save failed after", elapsed)
    assert isinstance(err, AccessDeniedError), repr(err)
    assert "credentials" in str(err) and "AWS_ACCESS_KEY_ID" in str(err)
    assert elapsed < 10, elapsed


def test_malformed_uris_are_config_errors(s3_server):
    config = _config(s3_server)
    cases = {
        "/local/path": "is not an S3 URI",
        "s3:/bucket/x": "is not an S3 URI",
        "s3://": "has no bucket",
        "s3://Not_A_Bucket/x": "not a valid bucket name",
        "s3://bucket/a//b": "empty path segment",
        "s3://bucket/a/../b": "'.' or '..' segment",
    }
    for cls in (S3StorageWriter, S3StorageReader):
        for uri, words in cases.items():
            with pytest.raises(ConfigError, match=words.replace(".", r"\.")):
                cls(uri, config=config)
            with pytest.raises(ConfigError, match=words.replace(".", r"\.")):
                cls(config=config).reset(uri)  # what checkpoint_id= to dcp.save/load does
        assert not cls.validate_checkpoint_id("s3://Not_A_Bucket/x")


@pytest.mark.timeout(60)
def test_a_missing_bucket_is_named_through_dcp(s3_server, boto3_client):
    config = _config(s3_server)
    err, _ = _failing_save(_state(32, small=1, large_elems=0), "s3://no-such-bucket-s3dcp/ckpt", config)
    assert isinstance(err, NoSuchBucketError), repr(err)
    assert "no-such-bucket-s3dcp" in str(err) and "create the bucket" in str(err)
    # DCP's load re-raises metadata failures as its own error, with our message in it
    with pytest.raises(CheckpointException, match="bucket does not exist.*create the bucket"):
        _load(_state(32, small=1, large_elems=0), "s3://no-such-bucket-s3dcp/ckpt", config)
    with pytest.raises(NoSuchBucketError, match="create the bucket"):
        S3StorageReader("s3://no-such-bucket-s3dcp/ckpt", config=config).fetch_metadata()
    names = [b["Name"] for b in boto3_client.list_buckets()["Buckets"]]
    assert "no-such-bucket-s3dcp" not in names  # never created by the attempt


# ------------------------------------------------------------------------------ headers passed through
def test_sse_and_expected_bucket_owner_reach_the_server(s3_server, bucket, proxy):
    """Server-side encryption on every upload request, the expected owner on every request
    (seen on the wire by the proxy), and the save still round-trips."""
    cfg = s3_server.s3_config(endpoint_url=proxy.endpoint_url, sse="AES256", part_size_bytes=5 * MiB,
                              object_size_target_bytes=4 * MiB)
    state = {"w": torch.randn(3 * MiB), "b": torch.randn(10)}  # 12 MiB: a multipart upload too
    dcp.save(state, storage_writer=S3StorageWriter(f"s3://{bucket}/sse", config=cfg))
    puts = [r for r in proxy.requests if r.method in ("PUT", "POST") and "partNumber" not in r.target
            and "uploadId" not in r.target]  # PutObject and CreateMultipartUpload
    assert puts and all(r.header("x-amz-server-side-encryption") == "AES256" for r in puts), \
        [(r.method, r.target) for r in puts]

    owner = "123456789012"
    seen = len(proxy.requests)
    cfg_owner = cfg.replace(sse=None, expected_bucket_owner=owner)
    S3StorageReader(f"s3://{bucket}/sse", config=cfg_owner).fetch_metadata()
    reads = proxy.requests[seen:]
    assert reads and all(r.header("x-amz-expected-bucket-owner") == owner for r in reads)

    # SSE-KMS: this server has no KMS, so the proxy answers the upload itself; the headers are
    # what matters here.
    proxy.add_rule(Rule(action="error", method="PUT", status=400, code="InvalidArgument"))
    seen = len(proxy.requests)
    kms = cfg.replace(sse="aws:kms", sse_kms_key_id="alias/ckpt", max_retries=0)
    with pytest.raises(S3Error):
        S3Client(kms).put(bucket, "kms-object", b"x" * 10).result()
    put = next(r for r in proxy.requests[seen:] if r.method == "PUT")
    assert put.header("x-amz-server-side-encryption") == "aws:kms"
    assert put.header("x-amz-server-side-encryption-aws-kms-key-id") == "alias/ckpt"
