"""Background staging (``S3Config(staging="background")``): async_save returns before the large
tensors are copied; a loop that waits for staging before it changes the state gets bitwise the
state of the call; one that does not gets TornCheckpointError, named, and nothing committed.

Mid-staging changes are made deterministic through the staging thread's seam
(``saving.background._seam``): the thread stops there ("copying": before its copies, "copied":
after them, before the check) while the test changes a tensor, then goes on."""

import threading
import time
import weakref

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

import s3dcp
from s3dcp import CheckpointManager, HostBufferPool, S3StorageReader, S3StorageWriter, TornCheckpointError
from s3dcp.config import MiB
from s3dcp.saving import background

from test_async import assert_forked_child_says_true


@pytest.fixture
def config(s3_server):
    return s3_server.s3_config(part_size_bytes=5 * MiB, object_size_target_bytes=4 * MiB, staging="background")


def _state(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {
        "model": {f"layer{i}.weight": torch.randn(256, 1024, generator=gen) for i in range(3)}
        | {"norm.running_mean": torch.randn(64, generator=gen), "layer0.bias": torch.randn(1024, generator=gen)},
        "optim": {"state": {0: {"step": torch.tensor(7.0), "exp_avg": torch.randn(300_000, generator=gen)}},
                  "param_groups": [{"lr": 0.1, "params": [0]}]},
        "epoch": 3,
    }


def _tensors(tree, prefix=""):
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out |= _tensors(v, f"{prefix}.{k}" if prefix else str(k))
        return out
    return {}


def _snapshot(state):
    return {k: v.clone() for k, v in _tensors(state).items()}


def _blank(state):
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: _blank(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_blank(v) for v in state]
    return state


def _assert_loads_as(uri, config, state, expected):
    out = _blank(state)
    dcp.load(out, storage_reader=S3StorageReader(uri, config=config))
    got = _tensors(out)
    assert set(got) == set(expected)
    for k, v in expected.items():
        assert torch.equal(got[k], v), k
    return out


class _Hold:
    """Stops the staging thread at ``phase`` until :meth:`go`; ``reached`` is set when it got there."""

    def __init__(self, monkeypatch, phase):
        self.reached, self._go, self.phase = threading.Event(), threading.Event(), phase
        monkeypatch.setattr(background, "_seam", self._seam)

    def _seam(self, phase):
        if phase == self.phase:
            self.reached.set()
            assert self._go.wait(60), "the test never let the staging thread go"

    def go(self):
        self._go.set()


def _keys(boto3_client, bucket, prefix):
    return sorted(o["Key"] for o in boto3_client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", []))


def test_async_save_returns_before_the_copy_and_saves_the_state_of_the_call(bucket, config, monkeypatch):
    hold = _Hold(monkeypatch, "copying")
    state = _state()
    expected = _snapshot(state)
    writer = S3StorageWriter(f"s3://{bucket}/a", config=config, pool=HostBufferPool())
    response = dcp.async_save(state, storage_writer=writer)
    assert isinstance(response, AsyncSaveResponse)
    assert hold.reached.wait(30)
    assert not response.staging_completion.done()  # returned while the large copies had not started
    hold.go()
    response.staging_completion.result(timeout=60)
    for v in _tensors(state).values():  # the loop's optimizer step, after waiting
        v.add_(1)
    response.upload_completion.result(timeout=120)
    _assert_loads_as(f"s3://{bucket}/a", config, state, expected)
    assert writer.last_stats.copied_bytes < 4096  # uploaded from the slabs, as a blocking stage's


def _two_slabs(seed=0):
    """Two 3 MB tensors, a slab (an object) each with 4 MiB objects, and a small one."""
    gen = torch.Generator().manual_seed(seed)
    return {"first": torch.randn(750_000, generator=gen), "second": torch.randn(750_000, generator=gen),
            "norm": torch.randn(64, generator=gen), "epoch": 3}


def _wait_for_keys(boto3_client, bucket, prefix, count, timeout_s=60):
    """The keys under ``prefix`` once there are ``count`` of them (an AssertionError after
    ``timeout_s``, which a test that cannot see them there fails on)."""
    deadline = time.monotonic() + timeout_s
    while len(keys := _keys(boto3_client, bucket, prefix)) < count:
        assert time.monotonic() < deadline, f"{prefix}: {keys} after {timeout_s} s"
        time.sleep(0.05)
    return keys


def test_an_object_goes_to_s3_as_soon_as_its_slab_is_in_while_the_next_is_still_copied(bucket, config, monkeypatch,
                                                                                       boto3_client):
    """DCP's save thread plans from the staged dict at once, and write_data sends each slab's
    object once the slab is in: the staging thread, held after the first slab, has not copied
    the second when the first object is already stored."""
    hold = _Hold(monkeypatch, "slab in")
    state = _two_slabs()
    expected = _snapshot(state)
    response = dcp.async_save(state, storage_writer=S3StorageWriter(f"s3://{bucket}/early", config=config))
    try:
        assert hold.reached.wait(30)
        keys = _wait_for_keys(boto3_client, bucket, "early/", 1)
        assert len(keys) == 1 and keys[0].endswith(".distcp"), keys  # the first slab's object, not the second
        assert not response.staging_completion.done()
    finally:
        hold.go()
    response.staging_completion.result(timeout=60)
    response.upload_completion.result(timeout=120)
    _assert_loads_as(f"s3://{bucket}/early", config, state, expected)


def test_the_save_thread_plans_only_once_async_save_is_returning(bucket, config, monkeypatch):
    """DCP's save thread has the staged dict at once, but its planning is Python that would
    hold the GIL against the training thread's last lines in async_save: its first writer call
    waits until async_save takes the staging Future's completion (slowed down here by 0.3 s)."""
    hold = _Hold(monkeypatch, "copying")  # landing would let the save thread go on too
    events = []
    taking = background.StagingFuture.add_done_callback

    def add_done_callback(self, fn):
        time.sleep(0.3)
        events.append("training thread done")
        taking(self, fn)

    monkeypatch.setattr(background.StagingFuture, "add_done_callback", add_done_callback)

    class Writer(S3StorageWriter):
        def set_up_storage_writer(self, *args, **kwargs):
            super().set_up_storage_writer(*args, **kwargs)
            events.append("save thread goes on")

    response = dcp.async_save(_two_slabs(), storage_writer=Writer(f"s3://{bucket}/handoff", config=config))
    try:
        assert hold.reached.wait(30)
    finally:
        hold.go()
    response.upload_completion.result(timeout=120)
    assert events == ["training thread done", "save thread goes on"]


def test_a_tensor_changed_after_its_slab_was_sent_fails_the_save_and_deletes_what_was_sent(bucket, config,
                                                                                          monkeypatch, boto3_client):
    """The first object is in S3 when the loop changes a tensor of the second slab, still to
    be copied: the save fails by name, nothing is committed, and the object sent is deleted."""
    hold = _Hold(monkeypatch, "slab in")
    state = _two_slabs()
    response = dcp.async_save(state, storage_writer=S3StorageWriter(f"s3://{bucket}/sent-torn", config=config))
    try:
        assert hold.reached.wait(30)
        _wait_for_keys(boto3_client, bucket, "sent-torn/", 1)
        state["second"].add_(1)
    finally:
        hold.go()
    response.staging_completion.result(timeout=60)
    with pytest.raises(BaseException) as info:
        response.upload_completion.result(timeout=120)
    error = s3dcp.unwrap_error(info.value)
    assert isinstance(error, TornCheckpointError) and error.names == ["second"], error
    assert _keys(boto3_client, bucket, "sent-torn/") == []


def _go_once_write_data_waits(monkeypatch, hold):
    """Let the staging thread (held before its copies) go once write_data waits for it: for the
    stage to land, or for a slab. Whatever write_data reads before that, it reads unstaged."""
    from s3dcp.saving.lease import Lease
    from s3dcp.saving.staging import StagingMixin

    landed, wait_in = StagingMixin._staging_landed, Lease.wait_in

    def staging_landed(lease):
        hold.go()
        landed(lease)

    def waits_in(self, tensor):
        hold.go()
        wait_in(self, tensor)

    monkeypatch.setattr(StagingMixin, "_staging_landed", staticmethod(staging_landed))
    monkeypatch.setattr(Lease, "wait_in", waits_in)


def test_an_object_refused_while_the_next_slab_is_copied_fails_the_save_and_leaves_nothing(bucket, config,
                                                                                           monkeypatch, boto3_client,
                                                                                           s3_server):
    """Through the fault proxy: the first slab's object is refused (403) while the staging
    thread is held before the second slab. The save fails with S3's refusal once the stage has
    landed, nothing is committed, and the second object, sent after, is deleted too."""
    from urllib.parse import urlsplit

    from fault_proxy import FaultProxy, Rule

    from s3dcp.errors import AccessDeniedError

    hold = _Hold(monkeypatch, "slab in")
    u = urlsplit(s3_server.endpoint_url)
    with FaultProxy(u.hostname, u.port) as proxy:
        proxy.add_rule(Rule("error", method="PUT", path_regex=r"/__0_0\.[0-9a-f]+\.distcp$", status=403,
                            code="AccessDenied"))
        writer = S3StorageWriter(f"s3://{bucket}/refused", config=config.replace(endpoint_url=proxy.endpoint_url))
        response = dcp.async_save(_two_slabs(), storage_writer=writer)
        try:
            assert hold.reached.wait(30)
            deadline = time.monotonic() + 60
            while not proxy.counts().get("error"):  # the first object's PUT, refused while the second is held
                assert time.monotonic() < deadline, proxy.counts()
                time.sleep(0.05)
        finally:
            hold.go()
        with pytest.raises(BaseException) as info:
            response.upload_completion.result(timeout=120)
        assert isinstance(s3dcp.unwrap_error(info.value), AccessDeniedError), info.value
        assert [r.target for r in proxy.requests if r.method == "PUT" and "__0_1." in r.target]  # the second went
    assert _keys(boto3_client, bucket, "refused/") == []
    assert boto3_client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_a_value_pickled_with_its_tensors_waits_for_them_to_be_in(bucket, config, monkeypatch):
    """DCP pickles a tuple whole (a BYTE_IO item), tensors and all: write_data resolves it only
    once the stage has landed, or it would pickle slabs still being filled."""
    hold = _Hold(monkeypatch, "copying")
    gen = torch.Generator().manual_seed(5)
    pair = (torch.randn(750_000, generator=gen), torch.randn(750_000, generator=gen))
    state = {"pair": pair, "w": torch.randn(750_000, generator=gen)}
    expected = {"pair": tuple(t.clone() for t in pair), "w": state["w"].clone()}
    _go_once_write_data_waits(monkeypatch, hold)
    response = dcp.async_save(state, storage_writer=S3StorageWriter(f"s3://{bucket}/tuple", config=config))
    response.upload_completion.result(timeout=120)
    out = {"pair": None, "w": torch.zeros_like(state["w"])}
    dcp.load(out, storage_reader=S3StorageReader(f"s3://{bucket}/tuple", config=config))
    assert torch.equal(out["w"], expected["w"])
    assert all(torch.equal(a, b) for a, b in zip(out["pair"], expected["pair"], strict=True))


def test_a_planner_of_its_own_resolves_items_only_once_the_stage_has_landed(bucket, config, monkeypatch):
    """Another planner may read a tensor's bytes while it resolves it (a copy or a cast does): write_data
    lets it resolve only once every copy is in."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    hold = _Hold(monkeypatch, "copying")
    seen = []

    class CopyingPlanner(DefaultSavePlanner):  # hands write_data copies: reads every tensor's bytes
        def resolve_data(self, write_item):
            seen.append(writer._lease.landed.is_set())
            data = super().resolve_data(write_item)
            return data.clone() if isinstance(data, torch.Tensor) else data

    state = _two_slabs()
    expected = _snapshot(state)
    writer = S3StorageWriter(f"s3://{bucket}/planner", config=config)
    _go_once_write_data_waits(monkeypatch, hold)
    response = dcp.async_save(state, storage_writer=writer, planner=CopyingPlanner())
    response.upload_completion.result(timeout=120)
    assert seen and all(seen)
    out = {k: torch.zeros_like(v) for k, v in expected.items()} | {"epoch": 0}
    dcp.load(out, storage_reader=S3StorageReader(f"s3://{bucket}/planner", config=config))
    assert all(torch.equal(out[k], v) for k, v in expected.items()) and out["epoch"] == 3


@pytest.mark.parametrize("change", ["add_", "data=", "set_", "resize_", "swap_tensors"])
@pytest.mark.parametrize("phase", ["copying", "copied"])
def test_a_tensor_changed_while_staging_fails_the_save_by_name_and_commits_nothing(bucket, config, monkeypatch,
                                                                                  boto3_client, change, phase):
    """Each way a tensor can change under a background copy, before or after its copy."""
    hold = _Hold(monkeypatch, phase)
    state = _state()
    w = state["model"]["layer1.weight"]
    changes = {
        "add_": lambda: w.add_(1),  # any in-place op: the version counter
        "data=": lambda: setattr(w, "data", torch.randn(256, 1024)),  # same version, other memory
        "set_": lambda: w.set_(torch.randn(256, 1024)),
        "resize_": lambda: w.resize_(128, 2048),
        "swap_tensors": lambda: torch.utils.swap_tensors(w, torch.randn(256, 1024)),
    }
    name = "model.layer1.weight"
    response = dcp.async_save(state, storage_writer=S3StorageWriter(f"s3://{bucket}/torn", config=config))
    assert hold.reached.wait(30)
    changes[change]()
    hold.go()
    response.staging_completion.result(timeout=60)  # staging itself ends; the save is what fails
    with pytest.raises(BaseException) as info:
        response.upload_completion.result(timeout=120)
    error = s3dcp.unwrap_error(info.value)
    assert isinstance(error, TornCheckpointError), error
    assert error.names == [name] and name in str(error) and "nothing was committed" in str(error)
    assert _keys(boto3_client, bucket, "torn/") == []  # no .metadata, and this rank uploaded nothing


def test_the_dict_changing_after_async_save_returned_leaves_the_checkpoint_as_it_was(bucket, config, monkeypatch):
    """Keys added, removed and replaced, non-tensor values changed: the staged dict and its
    other values were made before async_save returned."""
    hold = _Hold(monkeypatch, "copying")
    state = _state()
    expected = _snapshot(state)
    response = dcp.async_save(state, storage_writer=S3StorageWriter(f"s3://{bucket}/dict", config=config))
    assert hold.reached.wait(30)
    state["model"]["layer0.weight"] = torch.zeros(256, 1024)  # replaced: the old tensor is saved
    del state["model"]["layer2.weight"]
    state["model"]["new"] = torch.ones(3)
    state["optim"]["param_groups"][0]["lr"] = 99.0
    state["epoch"] = 4
    hold.go()
    response.upload_completion.result(timeout=120)
    like = _state()
    out = _assert_loads_as(f"s3://{bucket}/dict", config, like, expected)
    assert out["epoch"] == 3 and out["optim"]["param_groups"][0]["lr"] == 0.1


def test_what_a_forward_pass_writes_without_a_version_bump_is_copied_before_async_save_returns(bucket, config,
                                                                                            monkeypatch):
    """BatchNorm's forward updates its running statistics in its kernel, without a version
    bump; they are small, so they are copied before async_save returns, and the forward pass
    may run while the large tensors are copied."""
    hold = _Hold(monkeypatch, "copying")
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.BatchNorm1d(512))
    state = {"model": model.state_dict()}
    expected = _snapshot(state)
    version = model[1].running_mean._version
    response = dcp.async_save(state, storage_writer=S3StorageWriter(f"s3://{bucket}/bn", config=config))
    assert hold.reached.wait(30)
    model(torch.randn(8, 512))  # the next forward pass, while staging goes on
    assert model[1].running_mean._version == version and not torch.equal(model[1].running_mean,
                                                                          expected["model.1.running_mean"])
    hold.go()
    response.upload_completion.result(timeout=120)
    _assert_loads_as(f"s3://{bucket}/bn", config, state, expected)


@pytest.mark.parametrize("fused", [False, True])
def test_an_optimizer_step_that_did_not_wait_is_held_until_staging_completes(bucket, config, monkeypatch, fused):
    """The loop calls optimizer.step() right after the save, without waiting (the copy is slowed
    down through the seam): the step waits for staging, and the checkpoint is the state of the
    call — also for a fused optimizer, whose step bumps no version counter for a check to see."""
    monkeypatch.setattr(background, "_seam", lambda phase: time.sleep(0.3) if phase == "copying" else None)
    torch.manual_seed(0)
    model = torch.nn.Linear(512, 512)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused, foreach=None if fused else True)
    model(torch.randn(4, 512)).sum().backward()
    optim.step()
    state = {"model": model.state_dict(), "optim": optim.state_dict()}
    expected = _snapshot(state)
    response = dcp.async_save(state, storage_writer=S3StorageWriter(f"s3://{bucket}/held-{fused}", config=config))
    optim.step()  # no wait: held by the optimizer's step pre-hook until the copy has landed
    assert response.staging_completion.done()
    response.upload_completion.result(timeout=120)
    _assert_loads_as(f"s3://{bucket}/held-{fused}", config, state, expected)
    assert not torch.equal(model.weight, expected["model.weight"])  # the step did run, after the copy


def test_a_step_given_a_closure_runs_it_while_staging_copies_and_waits_before_it_writes(bucket, config,
                                                                                        monkeypatch):
    """optimizer.step(closure=...) (Lightning's automatic optimization): the forward and backward
    in the closure run while the stage still copies; the step's writes wait for the copy."""
    hold = _Hold(monkeypatch, "copying")
    torch.manual_seed(0)
    model = torch.nn.Linear(512, 512)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model.state_dict()}
    expected = _snapshot(state)
    response = dcp.async_save(state, storage_writer=S3StorageWriter(f"s3://{bucket}/closure", config=config))
    assert hold.reached.wait(30)
    ran = []

    def closure():
        optim.zero_grad()
        loss = model(torch.randn(4, 512)).sum()
        loss.backward()
        ran.append(response.staging_completion.done())
        hold.go()  # the copy goes on only once the closure has run: a wait before it would never end
        return loss

    stepping = threading.Thread(target=optim.step, kwargs={"closure": closure}, daemon=True)
    stepping.start()
    stepping.join(60)
    assert not stepping.is_alive() and ran == [False]  # the closure ran while staging copied
    assert response.staging_completion.done()
    response.upload_completion.result(timeout=120)
    _assert_loads_as(f"s3://{bucket}/closure", config, state, expected)
    assert not torch.equal(model.weight, expected["model.weight"])  # the step did run, after the copy


@pytest.mark.parametrize("failure", [ValueError("no queue"), MemoryError()])
def test_a_staging_thread_that_fails_to_start_stages_on_the_training_thread_and_holds_no_step(config, monkeypatch,
                                                                                              failure):
    """Any failure to hand the stage to the staging thread (not only Thread.start's RuntimeError):
    the stage runs on the caller's thread and lands, and no lease is left for the optimizer's
    step pre-hook to wait on for ever."""
    def submit(job):
        raise failure

    monkeypatch.setattr(background._WORKER, "submit", submit)
    state = {"w": torch.arange(MiB, dtype=torch.float32)}
    writer = S3StorageWriter("s3://bucket/no-thread", config=config, pool=HostBufferPool())
    staged = writer.stage(state).result(timeout=0)  # landed before stage() returned
    assert torch.equal(staged["w"], state["w"]) and writer._lease.error is None
    assert not background._IN_FLIGHT
    model = torch.nn.Linear(4, 4)
    model(torch.randn(2, 4)).sum().backward()
    stepped = threading.Thread(target=torch.optim.SGD(model.parameters(), lr=0.1).step, daemon=True)
    stepped.start()
    stepped.join(10)
    assert not stepped.is_alive()  # the step pre-hook found nothing to wait for
    writer._lease.release()


def test_a_loop_that_waits_for_staging_saves_bitwise_the_state_of_each_save(bucket, config):
    """A training loop (forward, backward, AdamW step) with the manager staging in the
    background and waiting before each optimizer step: every checkpoint is the state of its step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
    optim = torch.optim.AdamW(model.parameters(), lr=0.01, foreach=True)
    manager = CheckpointManager(f"s3://{bucket}/run", config=config, keep_last=None)
    expected = {}
    for step in range(1, 7):
        loss = model(torch.randn(32, 256)).square().mean()
        loss.backward()
        manager.wait_staged()  # the contract: staging is complete before the optimizer changes the state
        optim.step()
        optim.zero_grad()
        if step % 2 == 0:
            state = {"model": model.state_dict(), "optim": optim.state_dict()}
            expected[step] = _snapshot(state)
            future = manager.save(step, state)
            assert not future.staging_completion.done() or future.staging_completion.result() is None
    manager.close()
    for step, snapshot in expected.items():
        out = {"model": _blank(model.state_dict()), "optim": _blank(optim.state_dict())}
        manager.load(out, step=step)
        got = _tensors(out)
        assert all(torch.equal(got[k], v) for k, v in snapshot.items()), step


def test_a_manager_whose_loop_never_waits_keeps_no_stage_of_past_saves(bucket, config):
    """A loop that leaves the wait to the optimizer's hook never calls wait_staged(): the
    manager keeps none of the completed stages (a days-long job would pile them up)."""
    manager = CheckpointManager(f"s3://{bucket}/nowait", config=config, keep_last=2)
    state = _state()
    for step in range(1, 7):
        future = manager.save(step, state)
        future.staging_completion.result(timeout=60)
        future.result(timeout=120)
    assert len(manager._saves._staging) <= 1  # at most the last one, never all six
    manager.close()


def test_a_state_beyond_the_staging_budget_stages_as_blocking(bucket, config):
    state = _state()
    expected = _snapshot(state)
    cfg = config.replace(staging_budget_bytes=1 * MiB)
    future = dcp.async_save(state, storage_writer=S3StorageWriter(f"s3://{bucket}/budget", config=cfg))
    assert not isinstance(future, AsyncSaveResponse)  # DCP's Future: returned once every original is copied
    for v in _tensors(state).values():
        v.add_(1)
    future.result(timeout=120)
    _assert_loads_as(f"s3://{bucket}/budget", config, state, expected)


def test_the_staging_thread_and_the_arena_go_once_each_save_is_over(bucket, config):
    """Repeated background saves: one staging thread serves them all and keeps nothing of them,
    the pool allocates once, neither the sources nor the staged dicts are kept, and the slabs go
    once the pool lets go."""
    pool = HostBufferPool()
    state = _state()
    staged_refs, staging_threads = [], set()

    class Writer(S3StorageWriter):
        def stage(self, state_dict):
            future = super().stage(state_dict)
            future.add_done_callback(lambda f: staged_refs.append(weakref.ref(f.result())))
            return future

    for i in range(8):
        response = dcp.async_save(state, storage_writer=Writer(f"s3://{bucket}/cycle-{i}", config=config, pool=pool))
        response.staging_completion.result(timeout=60)
        response.upload_completion.result(timeout=120)
        staging_threads.update(t for t in threading.enumerate() if t.name == "s3dcp-staging")
    assert len(staging_threads) == 1  # one thread serves every stage; it holds none of them after it:
    source = weakref.ref(state["model"]["layer0.weight"])
    del state, response
    _wait_for(lambda: source() is None and all(r() is None for r in staged_refs) and pool.in_use == 0)
    assert pool.allocations == 1 and len(staged_refs) == 8
    slabs = [weakref.ref(slab) for arena in pool._free for slab in arena.slabs]
    assert slabs
    pool.clear()  # the arena's memory goes back to the system: nothing else holds its slabs
    _wait_for(lambda: all(r() is None for r in slabs))


def _wait_for(condition, timeout_s=10.0):
    import gc

    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "not released in time"
        gc.collect()
        time.sleep(0.05)


class _FakeCuda(torch.Tensor):
    """A CPU tensor that says it is on cuda:0: drives staging's CUDA branch without a GPU."""

    @property
    def is_cuda(self):
        return True

    @property
    def device(self):
        return torch.device("cuda", 0)


def test_cuda_copies_are_ordered_after_the_callers_work_and_before_its_next_kernels_cpu_stand_in(bucket, config,
                                                                                               monkeypatch):
    """The CUDA branch of background staging, with recording stand-ins for streams and events
    (no GPU here): small copies on the side stream after the caller's queued work, the caller's
    stream waiting for them before stage() returns; the large copies issued on the staging
    thread after an event of the caller's stream, slab by slab, each slab's synchronised as soon
    as it is in, and all before the check and before staging completes."""
    import contextlib

    from s3dcp.saving import copies as copies_module

    log = []

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            log.append(("wait_stream", self.name, other.name))

        def wait_event(self, event):
            log.append(("wait_event", self.name, event.id))

    class Event:
        made = 0

        def __init__(self):
            Event.made += 1
            self.id = Event.made

        def record(self, stream):
            log.append(("record", self.id, stream.name))

        def synchronize(self):
            log.append(("synchronize", self.id, threading.current_thread().name))

    current, streams = Stream("current"), [Stream("caller")]

    @contextlib.contextmanager
    def on_stream(stream):
        streams.append(stream)
        yield
        streams.pop()

    real_copy = torch._foreach_copy_

    def copy(dsts, srcs, non_blocking=False):
        log.append(("copy", streams[-1].name, sorted(s.nbytes for s in srcs), threading.current_thread().name))
        return real_copy(dsts, srcs, non_blocking=non_blocking)

    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: Stream("side"))
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "stream", on_stream)
    monkeypatch.setattr(torch, "_foreach_copy_", copy)
    monkeypatch.setattr(copies_module, "_STREAMS", {})
    hold = _Hold(monkeypatch, "copying")
    gen = torch.Generator().manual_seed(3)
    big, small, other = (torch.randn(n, generator=gen) for n in (750_000, 64, 750_000))  # 3 MB: a slab each
    state = {"w": torch.Tensor._make_subclass(_FakeCuda, big), "norm": torch.Tensor._make_subclass(_FakeCuda, small),
             "v": torch.Tensor._make_subclass(_FakeCuda, other)}
    pool = HostBufferPool(pin_memory=False)
    response = dcp.async_save(state, storage_writer=S3StorageWriter(f"s3://{bucket}/cuda", config=config, pool=pool))
    assert hold.reached.wait(30)
    main = threading.current_thread().name
    assert log == [("wait_stream", "side", "current"), ("copy", "side", [small.nbytes], main), ("record", 1, "side"),
                   ("wait_event", "current", 1),  # the caller's next kernels come after the small copies
                   ("record", 2, "current")]  # where the large copies start
    hold.go()
    response.staging_completion.result(timeout=60)
    staged_log = list(log)
    thread = "s3dcp-staging"
    assert staged_log[5:] == [("wait_event", "side", 2),  # the side stream once behind the caller's work
                              ("copy", "side", [big.nbytes], thread), ("record", 3, "side"),  # a slab...
                              ("copy", "side", [other.nbytes], thread), ("record", 4, "side"),  # ...then the next
                              ("synchronize", 3, thread), ("synchronize", 4, thread),  # each slab in: its object goes
                              ("synchronize", 1, thread), ("synchronize", 3, thread),
                              ("synchronize", 4, thread)]  # all landed before the check and completion
    response.upload_completion.result(timeout=120)
    out = {"w": torch.zeros_like(big), "norm": torch.zeros_like(small), "v": torch.zeros_like(other)}
    dcp.load(out, storage_reader=S3StorageReader(f"s3://{bucket}/cuda", config=config))
    assert torch.equal(out["w"], big) and torch.equal(out["norm"], small) and torch.equal(out["v"], other)


def _stage_in_background_in_child(queue, config, state):
    torch.set_num_threads(1)  # torch's own OpenMP pool is not fork-safe (what DataLoader workers do too)
    writer = S3StorageWriter("s3://bucket/forked", config=config, pool=HostBufferPool())
    staged = writer.stage(state).result(timeout=30)  # the parent's staging thread is not the child's
    queue.put(torch.equal(staged["w"], state["w"]) and writer._lease.error is None)


def test_a_forked_child_stages_in_the_background_after_its_parent_did(config):
    """The staging thread is the process's: a child forked after its parent staged in the
    background starts one of its own (the parent's is not alive there), and copies its own state."""
    writer = S3StorageWriter("s3://bucket/parent", config=config, pool=HostBufferPool())
    writer.stage({"w": torch.randn(MiB)}).result(timeout=30)
    writer._lease.release()
    assert_forked_child_says_true(_stage_in_background_in_child, config, {"w": torch.arange(MiB, dtype=torch.float32)})


def _step_in_child(queue):
    torch.set_num_threads(1)
    model = torch.nn.Linear(4, 4)
    model(torch.randn(2, 4)).sum().backward()
    before = model.weight.detach().clone()
    torch.optim.SGD(model.parameters(), lr=0.1).step()  # the parent's stage in flight is not the child's
    queue.put(not torch.equal(model.weight, before) and not background._IN_FLIGHT)


def test_a_child_forked_while_its_parent_stages_takes_optimizer_steps(config, monkeypatch):
    """A child forked while a background stage of its parent is in flight inherits neither that
    stage nor the locks of the parent's threads: its optimizer steps do not wait for a copy that
    runs only in the parent."""
    hold = _Hold(monkeypatch, "copying")
    writer = S3StorageWriter("s3://bucket/parent-in-flight", config=config, pool=HostBufferPool())
    state = {"w": torch.arange(MiB, dtype=torch.float32)}
    future = writer.stage(state)
    try:
        assert hold.reached.wait(30)
        assert background._IN_FLIGHT  # the parent's stage is in flight when the child is forked
        assert_forked_child_says_true(_step_in_child)
    finally:
        hold.go()
    assert torch.equal(future.result(timeout=30)["w"], state["w"]) and writer._lease.error is None
    writer._lease.release()


def test_a_torn_save_by_a_writer_driven_outside_dcps_save_gives_its_arena_back(bucket, config, monkeypatch):
    """write_data raises the torn error before it returns; a lease attached to no DCP save call
    (the writer driven by hand) must still end there, or with max_inflight_checkpoints=1 the
    next stage() waits for its arena for ever."""
    from s3dcp.saving import lease as lease_module

    monkeypatch.setattr(lease_module._SaveCall, "of_caller", classmethod(lambda cls: None))
    hold = _Hold(monkeypatch, "copied")
    pool = HostBufferPool()
    state = _state()
    writer = S3StorageWriter(f"s3://{bucket}/by-hand", config=config, pool=pool)
    stage, kept = writer.stage, []
    writer.stage = lambda state_dict: kept.append(stage(state_dict)) or kept[-1]  # the staged dict stays alive
    response = dcp.async_save(state, storage_writer=writer)
    assert hold.reached.wait(30)
    state["model"]["layer1.weight"].add_(1)
    hold.go()
    with pytest.raises(BaseException) as info:
        response.upload_completion.result(timeout=60)
    assert isinstance(s3dcp.unwrap_error(info.value), TornCheckpointError), info.value
    assert not writer._lease.attached
    assert kept[0].result(timeout=0) is not None
    assert pool._in_use == 0  # given back at once, not when the staged dict is collected


def test_a_torn_copy_whose_names_cannot_be_given_is_still_the_error_naming_tensors_by_index():
    """names() fails (a staged tree it cannot walk): the check still returns the torn error,
    with the changed tensors named by their index, instead of raising names()' error."""
    from s3dcp.saving.guard import TornGuard

    sources = [torch.zeros(4), torch.zeros(4)]
    guard = TornGuard(sources, sources, [0, 1])
    sources[1].add_(1)

    def names():
        raise KeyError("no path")

    error = guard.check(names, "s3://bucket/ckpt")
    assert isinstance(error, TornCheckpointError)
    assert "s3://bucket/ckpt: #1 changed" in str(error) and error.names == []
