"""Lifetimes in the client: a finished request keeps none of the caller's buffers, deadlines,
slots or native clients; nothing blocks a CRT thread; credentials follow the environment."""

import gc
import os
import threading
import time
import weakref

import pytest
import torch

import s3dcp
from s3dcp.s3 import native as native_mod
from s3dcp.s3 import request as request_mod
from s3dcp.s3.client import S3Client
from s3dcp.config import MiB, S3Config
from s3dcp.errors import AccessDeniedError, NoSuchBucketError
from s3dcp.s3.streams import deadlines
from s3dcp.format.tensors import byte_view

PART = 5 * MiB


def _gone(ref: weakref.ref, timeout_s: float = 10.0) -> bool:
    """Whether ``ref``'s object is freed within ``timeout_s``: the CRT lets go of a request's
    callbacks on its own thread shortly after the request's future completes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        gc.collect()
        if ref() is None:
            return True
        time.sleep(0.02)
    return False


@pytest.fixture
def client(s3_server):
    c = S3Client(s3_server.s3_config(part_size_bytes=PART))
    yield c
    c.close()


@pytest.mark.parametrize("nbytes", [1 * MiB, 3 * PART + 123], ids=["single", "multipart"])
def test_put_lets_go_of_the_source_buffer(client, bucket, nbytes):
    source = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    ref = weakref.ref(source)
    client.put(bucket, "k", [byte_view(source)]).result()
    del source
    assert _gone(ref), "a finished PUT still holds its source buffer"


@pytest.mark.parametrize("nbytes", [1 * MiB, 3 * PART + 123], ids=["single", "ranged"])
def test_get_lets_go_of_the_destination_buffer(client, bucket, nbytes):
    data = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    client.put(bucket, "k", [byte_view(data)]).result()
    dest = torch.empty(nbytes, dtype=torch.uint8)
    ref = weakref.ref(dest)
    client.get_range_into(bucket, "k", 0, byte_view(dest)).result()
    assert torch.equal(dest, data)
    del dest
    assert _gone(ref), "a finished GET still holds its destination buffer"


def test_failed_request_lets_go_of_buffers_and_keeps_its_error(client, bucket):
    source = torch.zeros(2 * PART, dtype=torch.uint8)
    dest = torch.zeros(1024, dtype=torch.uint8)
    refs = weakref.ref(source), weakref.ref(dest)
    put = client.put(f"{bucket}-missing", "k", [byte_view(source)])
    get = client.get_range_into(bucket, "no-such-key", 0, byte_view(dest))
    with pytest.raises(NoSuchBucketError):
        put.result()
    with pytest.raises(s3dcp.NoSuchKeyError):
        get.result()
    del source, dest
    # the futures (and the errors they hold) stay alive here, on purpose
    assert all(_gone(r) for r in refs), "a failed request's future holds the caller's buffers"
    assert isinstance(put.exception(), NoSuchBucketError)


def test_aborted_requests_let_go_of_buffers_deadlines_and_their_call(s3_server, bucket):
    """Aborting — a multipart PUT in flight, a PUT still queued, a GET — frees what each held
    (caller buffers, deadline, the request's own record) though their futures stay alive, and
    the native client's slots come back. Over repeated cycles nothing accumulates."""
    from dataclasses import replace

    from s3dcp.s3.request import abort_and_wait
    from s3dcp.errors import RequestAbortedError

    client = S3Client(replace(s3_server.s3_config(part_size_bytes=PART), max_concurrency=1))
    data = torch.randint(0, 255, (3 * PART,), dtype=torch.uint8)
    client.put(bucket, "src", [byte_view(data)]).result()
    futures, refs = [], []
    for _ in range(5):
        upload = torch.zeros(6 * PART, dtype=torch.uint8)
        queued = torch.zeros(1024, dtype=torch.uint8)
        dest = torch.empty(3 * PART, dtype=torch.uint8)
        refs += [weakref.ref(upload), weakref.ref(queued), weakref.ref(dest)]
        batch = [client.put(bucket, "big", [byte_view(upload)]), client.put(bucket, "small", [byte_view(queued)]),
                 client.get_range_into(bucket, "src", 0, byte_view(dest))]
        abort_and_wait(batch)
        futures += batch
        del upload, queued, dest, batch
    assert any(isinstance(f.exception(), RequestAbortedError) for f in futures)
    assert all(_gone(r) for r in refs), "an aborted request holds the caller's buffers"
    assert all(f._call is None for f in futures)  # no future keeps its request's record alive
    assert _request_deadlines() == 0
    native = client._use.native
    assert native.in_flight == 0 and not native._queue
    client.close()


def _request_deadlines() -> int:
    """Live deadline entries of requests (other entries: idle native clients' linger timers)."""
    with deadlines()._cond:
        return sum(1 for _, _, e in deadlines()._heap
                   if e.callback is not None and type(getattr(e.callback, "__self__", None)).__name__ == "_Call")


def test_finished_requests_leave_no_deadlines(client, bucket):
    futures = [client.put(bucket, f"k{i}", b"x" * 100) for i in range(20)]
    for f in futures:
        f.result()
    for f in [client.get(bucket, "k0") for _ in range(5)] + [client.get(bucket, "gone") for _ in range(3)]:
        f.exception()
    assert _request_deadlines() == 0


def test_a_request_that_ends_before_its_start_returns_keeps_nothing():
    """The CRT may finish a request on its own thread before make_request returns to the
    submitting thread: the deadline must still be cancelled and the request not kept."""

    class Request:
        pass

    class Native:
        crt = object()
        slots_freed = 0

        def finished(self):
            self.slots_freed += 1

    def start(_crt, on_done):
        request = Request()
        on_done(error=None)  # the CRT thread wins the race
        return request

    before = _request_deadlines()
    call = request_mod._Call("GetObject", "b", "k", start, lambda: "value", [], timeout_s=600.0)
    native = Native()
    assert call.start(native)
    assert call.future.result(timeout=1) == "value"
    assert _request_deadlines() == before
    assert call._request is None and native.slots_freed == 1


def test_a_deadline_that_passes_before_make_request_returns_still_cancels():
    class Request:
        cancelled = False

        def cancel(self):
            self.cancelled = True

    class Native:
        crt = object()

        def finished(self):
            pass

    request = Request()
    call = None

    def start(_crt, _on_done):
        call._expire()  # the deadline thread wins the race: nothing is stored to cancel yet
        return request

    call = request_mod._Call("GetObject", "b", "k", start, lambda: None, [], timeout_s=600.0)
    assert call.start(Native())
    assert request.cancelled, "the request outlived its deadline"
    call._on_done(error=RuntimeError("cancelled"))  # what the CRT reports for a cancelled request
    with pytest.raises(s3dcp.S3ConnectionError, match="timed out"):
        call.future.result(timeout=1)


def test_callbacks_never_block_crt_threads(s3_server, bucket):
    """One slot, a paginated listing (each page is started from the previous page's CRT
    callback) and puts from this thread competing for it: all must finish. A blocking
    admission would park a CRT event-loop thread waiting for a slot that only that thread
    can free."""
    c = S3Client(s3_server.s3_config(max_concurrency=1))
    try:
        for i in range(12):
            c.put(bucket, f"p/{i:02d}", b"y").result()
        listings = [c.list(bucket, "p/", page_size=1) for _ in range(3)]
        puts = [c.put(bucket, f"q/{i}", b"z" * 1000) for i in range(30)]
        heads = [c.head(bucket, f"missing-{i}") for i in range(5)]  # HEAD 404 chains a HeadBucket
        for f in listings:
            objects, _ = f.result(timeout=60)
            assert [o.key for o in objects] == [f"p/{i:02d}" for i in range(12)]
        for f in puts:
            f.result(timeout=60)
        for f in heads:
            with pytest.raises(s3dcp.NoSuchKeyError):
                f.result(timeout=60)
    finally:
        c.close()


def test_max_concurrency_is_per_process_not_per_client(s3_server, bucket):
    config = s3_server.s3_config(max_concurrency=2)
    a, b = S3Client(config), S3Client(config)
    try:
        assert a._native() is b._native()
        native = a._native()
        seen = []
        stop = threading.Event()

        def sample():
            while not stop.is_set():
                seen.append(native.in_flight)
                time.sleep(0.001)

        sampler = threading.Thread(target=sample)
        sampler.start()
        futures = [c.put(bucket, f"c/{i}", b"w" * 200_000) for i in range(20) for c in (a, b)]
        for f in futures:
            f.result()
        stop.set()
        sampler.join()
        assert max(seen) <= 2
        assert native.in_flight == 0
    finally:
        a.close()
        b.close()


def test_native_client_released_when_unused(s3_server, bucket, monkeypatch):
    monkeypatch.setattr(native_mod, "_IDLE_LINGER_S", 0.05)
    config = s3_server.s3_config(max_concurrency=3)  # a config no other test's clients share
    c = S3Client(config)
    c.put(bucket, "n", b"1").result()
    crt_done = c._native().crt.shutdown_event
    c.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not crt_done.is_set():
        time.sleep(0.02)
    assert crt_done.is_set(), "an unused native CRT client was never shut down"
    c.put(bucket, "n2", b"2").result()  # a closed S3Client takes a native client again
    c.close()


def test_dropped_client_releases_its_native_client(s3_server, bucket, monkeypatch):
    monkeypatch.setattr(native_mod, "_IDLE_LINGER_S", 0.05)
    c = S3Client(s3_server.s3_config(max_concurrency=5))
    c.put(bucket, "d", b"1").result()
    crt_done = c._native().crt.shutdown_event
    del c
    gc.collect()
    assert crt_done.wait(10), "an S3Client dropped without close() kept its native client"


def test_s3dcp_close_releases_every_native_client(s3_server, bucket):
    c = S3Client(s3_server.s3_config(max_concurrency=6))
    c.put(bucket, "e", b"1").result()
    crt_done = c._native().crt.shutdown_event
    s3dcp.close()
    assert native_mod.native_clients() == 0
    assert crt_done.wait(10)
    assert c.get(bucket, "e").result() == b"1"  # still usable: it takes a fresh one
    c.close()


def test_idle_native_clients_are_capped(s3_server, bucket):
    """A config per load (as with rotated credentials) must not hold a CRT client, its threads
    and sockets, per load made in the last linger period: the oldest idle ones go at once."""
    events = []
    for i in range(native_mod._MAX_IDLE + 3):
        c = S3Client(s3_server.s3_config(request_timeout_s=900.0 + i))
        c.put(bucket, f"cap{i}", b"1").result()
        events.append(c._native().crt.shutdown_event)
        c.close()
    idle = [n for n in native_mod._NATIVE.values() if n.users == 0 and n.key[1].request_timeout_s >= 900.0]
    assert len(idle) == native_mod._MAX_IDLE
    assert all(e.wait(10) for e in events[:-native_mod._MAX_IDLE]), "a surplus idle client was kept"
    assert not any(e.is_set() for e in events[-native_mod._MAX_IDLE:]), "the newest idle ones must linger"


def _crt_threads_and_sockets() -> tuple[int, int]:
    """The CRT's event-loop threads and this process's sockets (other threads, such as the CRT's
    host resolver or a test's, come and go on their own)."""
    import os

    loops = 0
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/comm") as f:
            loops += f.read().startswith("AwsEventLoop")
    sockets = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            sockets += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return loops, sockets


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_close_waits_for_native_threads_and_sockets(s3_server, bucket):
    s3dcp.close(wait_s=10)
    before = _crt_threads_and_sockets()
    in_use = S3Client(s3_server.s3_config(max_concurrency=7))
    in_use.put(bucket, "w", b"1").result()
    idle = S3Client(s3_server.s3_config(max_concurrency=8))
    idle.put(bucket, "w2", b"1").result()
    idle.close()
    assert native_mod.close_native_clients(idle_only=True, wait_s=10) == 1
    assert native_mod.native_clients() == 1  # the one an S3Client still holds
    s3dcp.close(wait_s=10)
    assert _crt_threads_and_sockets() == before
    in_use.close()


def test_a_client_dropped_under_the_registry_lock_does_not_deadlock(s3_server, bucket):
    """A finalizer runs wherever its object dies, e.g. in a garbage collection that starts at an
    allocation inside _acquire_native's critical section (the CI once hung so): the release it
    triggers must not need that lock on that thread."""
    holder = [S3Client(s3_server.s3_config(max_concurrency=9))]
    holder[0].put(bucket, "fin", b"1").result()
    native = holder[0]._native()
    finished = threading.Event()

    def drop_under_the_lock():
        with native_mod._NATIVE_LOCK:
            holder.clear()
            gc.collect()
        finished.set()

    threading.Thread(target=drop_under_the_lock, daemon=True).start()
    assert finished.wait(10), "the dropped client's finalizer deadlocked on the registry lock"
    deadline = time.monotonic() + 10
    while native.users and time.monotonic() < deadline:
        time.sleep(0.01)
    assert native.users == 0, "the dropped client never let go of its native client"


def test_credentials_follow_the_environment(s3_server, bucket, monkeypatch):
    good = s3_server.s3_config()
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", good.access_key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", good.secret_access_key)
    keyless = S3Config(endpoint_url=good.endpoint_url, region=good.region, max_retries=0)
    first = S3Client(keyless)
    first.put(bucket, "env", b"1").result()

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    second = S3Client(keyless)
    with pytest.raises(AccessDeniedError):
        second.get(bucket, "env").result()

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", good.secret_access_key)
    third = S3Client(keyless)
    assert third.get(bucket, "env").result() == b"1"
    for c in (first, second, third):
        c.close()


def test_finalizer_work_runs_on_its_thread_and_in_place_once_that_has_stopped():
    """Before exit, a finalizer only hands its work over; once the thread has stopped at exit
    (weakref's own exit hook runs the remaining finalizers after ours), the work runs in place
    instead of waiting in a queue nobody serves."""
    from s3dcp.s3.streams import _Finalizers

    finalizers = _Finalizers()
    ran: list[str] = []
    done = threading.Event()

    def work():
        ran.append(threading.current_thread().name)
        done.set()

    callback = finalizers.wrap(work)
    callback()
    assert done.wait(10) and ran == ["s3dcp-finalizers"]
    finalizers._finish()
    callback()
    assert ran == ["s3dcp-finalizers", threading.current_thread().name]


class _Dropped:
    """An object to collect in a forked child."""


def _in_forked_child(parent_client: list, ran: list, report) -> None:
    """Runs in a child forked by the test below; reports what the finalizers did."""
    import gc as child_gc

    from s3dcp.s3.streams import finalizer

    native = parent_client[0]._use.native
    users = native.users
    parent_client.clear()  # the parent's S3Client, and the object of the parent's finalizer, die here
    child_gc.collect()
    before_restart = list(ran)
    done = threading.Event()
    weakref.finalize(_Dropped(), finalizer(done.set))  # a registration starts the child's own thread
    done.wait(10)
    report.put((before_restart, list(ran), native.users == users and native.key in native_mod._NATIVE))


def test_finalizers_in_a_forked_child_wait_for_its_own_thread_and_leave_the_parents_clients_alone(
        s3_server, bucket):
    """In a child forked from a process using s3dcp, the finalizer thread is gone. Work handed
    over by finalizers there waits for the child's own thread (started by its next
    registration) instead of running wherever a collection started — that once started a
    thread inside a new thread's bootstrap and crashed the child. And an S3Client inherited
    from the parent, collected in the child, does not release the parent's native client."""
    import multiprocessing

    from s3dcp.s3.streams import finalizer

    client = S3Client(s3_server.s3_config())
    client.head_bucket(bucket).result()  # the native client exists
    ran: list[str] = []
    dropped = _Dropped()
    weakref.finalize(dropped, finalizer(lambda: ran.append(threading.current_thread().name)))
    holder = [client, dropped]
    del client, dropped
    ctx = multiprocessing.get_context("fork")
    report = ctx.Queue()
    child = ctx.Process(target=_in_forked_child, args=(holder, ran, report))
    child.start()
    try:
        before_restart, after, parents_native_untouched = report.get(timeout=30)
    finally:
        child.join(timeout=10)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0
    assert before_restart == [], "finalizer work ran in place, at the collection"
    assert after == ["s3dcp-finalizers"]
    assert parents_native_untouched
    assert ran == []  # the parent's own finalizer has not run: its object lives on here
