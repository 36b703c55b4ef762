"""dcp.async_save through S3StorageWriter's staging: the training loop may change its tensors
as soon as async_save returns; the pool is reused; memory is bounded; errors reach the future."""

import os
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from s3dcp import HostBufferPool, S3StorageReader, S3StorageWriter
from s3dcp.config import MiB
from s3dcp.saving.staging import shared_pool


def _state(seed=0, n=8, rows=256):
    gen = torch.Generator().manual_seed(seed)
    state = {f"layer{i}.weight": torch.randn(rows, 1024, generator=gen) for i in range(n)}
    state["layer0.bias"] = torch.randn(1024, generator=gen).to(torch.bfloat16)
    state["transposed"] = torch.randn(64, 32, generator=gen).t()
    state["step"] = 11
    state["extra"] = {"lr": 0.1, "history": [1, 2, 3]}
    return state


def _snapshot(state):
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def _load(uri, config, like):
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in like.items()}
    out["step"] = 0
    out["extra"] = {"lr": 0.0, "history": [0, 0, 0]}
    dcp.load(out, storage_reader=S3StorageReader(uri, config=config))
    return out


def _assert_same(expected, actual):
    for k, v in expected.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(actual[k], v), k
        else:
            assert actual[k] == v, k


def _train_step(state):
    """What a training loop does right after async_save returns: change everything in place."""
    for v in state.values():
        if isinstance(v, torch.Tensor):
            v.add_(1)
    state["step"] += 1
    state["extra"]["history"].append(99)


def _wait_for(condition, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


@pytest.fixture
def config(s3_server):
    return s3_server.s3_config(part_size_bytes=5 * MiB, object_size_target_bytes=4 * MiB)


def test_async_save_holds_the_values_of_the_moment_it_returned(bucket, config):
    state = _state()
    expected = _snapshot(state)
    expected["extra"] = {"lr": 0.1, "history": [1, 2, 3]}
    writer = S3StorageWriter(f"s3://{bucket}/a", config=config, pool=HostBufferPool())
    future = dcp.async_save(state, storage_writer=writer)
    _train_step(state)  # mutate immediately: the checkpoint must not see it
    future.result(timeout=120)
    _assert_same(expected, _load(f"s3://{bucket}/a", config, expected))
    stats = writer.last_stats
    assert stats.bytes > 8 * 256 * 1024 * 4 and stats.upload_s > 0 and stats.stage_s > 0


def test_ten_saves_reuse_one_pool_allocation(bucket, config):
    pool = HostBufferPool()
    state = _state(n=4)
    for step in range(10):
        expected = _snapshot(state)
        uri = f"s3://{bucket}/step-{step}"
        future = dcp.async_save(state, storage_writer=S3StorageWriter(uri, config=config, pool=pool))
        _train_step(state)
        future.result(timeout=120)
        if step in (0, 9):
            _assert_same({k: v for k, v in expected.items() if k != "extra"},
                         {k: v for k, v in _load(uri, config, expected).items() if k != "extra"})
    assert pool.allocations == 1  # a new writer per checkpoint, one arena for all of them
    _wait_for(lambda: pool.in_use == 0)  # given back once each save's thread has ended


def test_later_checkpoints_reuse_the_staged_tensors_where_the_shapes_match_and_keep_their_own_values(bucket,
                                                                                                      config):
    """The arena hands the next checkpoint the same staged tensor objects where a tensor of the
    same dtype and shape lands at the same place (no per-tensor view to make in the stall); a
    changed shape gets a tensor of its own; every checkpoint loads as the state it saved."""
    staged: list[dict] = []

    class Writer(S3StorageWriter):
        def stage(self, state_dict):
            result = super().stage(state_dict)
            staged.append({k: weakref.ref(v) for k, v in result.items() if isinstance(v, torch.Tensor)})
            return result

    pool = HostBufferPool()
    state = _state(n=4)
    saved = []
    for step in range(3):
        if step == 2:
            state["layer1.weight"] = torch.randn(128, 2048)  # same bytes, another shape
        expected = _snapshot(state)
        uri = f"s3://{bucket}/reuse-{step}"
        dcp.async_save(state, storage_writer=Writer(uri, config=config, pool=pool)).result(timeout=120)
        saved.append((uri, expected))
        _train_step(state)
    for uri, expected in saved:
        _assert_same({k: v for k, v in expected.items() if k != "extra"},
                     {k: v for k, v in _load(uri, config, expected).items() if k != "extra"})
    assert pool.allocations == 1
    assert all(staged[1][k]() is not None and staged[1][k]() is staged[0][k]() for k in staged[0])  # all reused
    changed = {k for k in staged[2] if staged[2][k]() is not staged[1][k]()}
    assert "layer1.weight" in changed and "layer0.weight" not in changed


def test_writers_share_the_process_wide_pool_by_default(bucket, config):
    state = _state(n=2)
    before = shared_pool().allocations
    for step in range(3):
        dcp.async_save(state, storage_writer=S3StorageWriter(f"s3://{bucket}/s{step}", config=config)).result(120)
    assert shared_pool().allocations - before <= 1


def test_warm_up_preallocates(bucket, config):
    pool = HostBufferPool()
    state = _state(n=2)
    writer = S3StorageWriter(f"s3://{bucket}/w", config=config, pool=pool)
    writer.warm_up(state)
    assert pool.allocations == 1
    dcp.async_save(state, storage_writer=writer).result(120)
    assert pool.allocations == 1


def test_the_save_thread_lets_the_training_thread_return_first(bucket, config):
    """The save's planning is pure Python: started while the training thread is still inside
    async_save, it would hold the GIL against it. The save's first writer call waits for the
    training thread to finish synchronize_staging (here: slowed down by 0.3 s)."""
    events = []

    class Writer(S3StorageWriter):
        def synchronize_staging(self):
            time.sleep(0.3)
            super().synchronize_staging()
            events.append("training thread done")

        def set_up_storage_writer(self, *args, **kwargs):
            super().set_up_storage_writer(*args, **kwargs)
            events.append("save thread goes on")

    state = _state(n=2)
    future = dcp.async_save(state, storage_writer=Writer(f"s3://{bucket}/handoff", config=config,
                                                         pool=HostBufferPool()))
    future.result(timeout=120)
    assert events == ["training thread done", "save thread goes on"]


def test_the_arena_and_the_staged_copy_go_back_when_the_save_thread_ends(bucket, config):
    """DCP's thread executor ends its thread right after the save: then, not at the next
    stage() on the training thread (inside its stall), the arena goes back to the pool and the
    staged copy's tensor objects are freed. Nothing here calls into the pool or the writer."""
    staged = []

    class Writer(S3StorageWriter):
        def stage(self, state_dict):
            result = super().stage(state_dict)
            staged.append(weakref.ref(result))
            return result

    pool = HostBufferPool()
    writer = Writer(f"s3://{bucket}/thread-end", config=config, pool=pool)
    future = dcp.async_save(_state(n=2), storage_writer=writer)
    future.result(timeout=120)
    lease = writer._lease
    # release() marks the lease released, then gives the arena back: wait for all of it
    _wait_for(lambda: staged[0]() is None and lease._released and pool._in_use == 0 and pool._free,
              timeout_s=5.0)


def test_a_failure_while_building_the_staged_tree_copies_nothing_and_gives_the_arena_back(bucket, config,
                                                                                          monkeypatch):
    """The bytes are copied only once the staged dict is built: a failure before that leaves the
    arena as it was and back in the pool, and the next stage gets the same arena."""
    from s3dcp.saving import statetree

    pool = HostBufferPool()
    writer = S3StorageWriter(f"s3://{bucket}/tree-fails", config=config, pool=pool)
    state = {"w": torch.ones(4 * MiB)}
    writer.warm_up(state)  # a zeroed arena, free in the pool

    def failing_copy_tree(value, stage_tensor):
        raise RuntimeError("cannot copy this state")

    copy_tree = statetree.copy_tree
    monkeypatch.setattr(statetree, "copy_tree", failing_copy_tree)
    with pytest.raises(RuntimeError, match="cannot copy this state"):
        writer.stage(state)
    assert pool._in_use == 0 and len(pool._free) == 1
    assert int(pool._free[0].buffer.count_nonzero()) == 0, "the failed stage copied into the arena"
    monkeypatch.setattr(statetree, "copy_tree", copy_tree)
    staged = writer.stage(state)
    writer.synchronize_staging()
    try:
        assert torch.equal(staged["w"], state["w"]) and pool.allocations == 1
    finally:
        writer._lease.release()


def test_staged_copies_of_tensors_that_require_grad_carry_no_autograd_history(bucket, config):
    state = {"w": torch.randn(64, 8, requires_grad=True), "t": torch.randn(8, 64, requires_grad=True).t()}
    writer = S3StorageWriter(f"s3://{bucket}/grad", config=config, pool=HostBufferPool())
    staged = writer.stage(state)
    writer.synchronize_staging()
    try:
        for name in state:
            assert not staged[name].requires_grad and staged[name].grad_fn is None, name
            assert torch.equal(staged[name], state[name].detach())
    finally:
        writer._lease.release()


def test_a_budget_smaller_than_the_state_saves_in_rounds(bucket, config):
    pool = HostBufferPool()
    cfg = config.replace(staging_budget_bytes=2 * MiB)  # the state is ~8 MiB
    state = _state(n=8)
    expected = _snapshot(state)
    expected["extra"] = {"lr": 0.1, "history": [1, 2, 3]}
    future = dcp.async_save(state, storage_writer=S3StorageWriter(f"s3://{bucket}/r", config=cfg, pool=pool))
    _train_step(state)  # async_save returned only after the last round was copied
    future.result(timeout=120)
    _assert_same(expected, _load(f"s3://{bucket}/r", cfg, expected))
    assert pool.bytes_allocated <= 8 * MiB  # one arena: the 2 MiB budget, rounded up to 8 MiB


def test_back_pressure_waits_for_the_previous_upload(bucket, config):
    pool = HostBufferPool()
    state = _state(n=2)
    w1 = S3StorageWriter(f"s3://{bucket}/1", config=config, pool=pool)
    first = dcp.async_save(state, storage_writer=w1)
    assert w1.last_stats.bytes == 0  # still uploading
    second = dcp.async_save(state, storage_writer=S3StorageWriter(f"s3://{bucket}/2", config=config, pool=pool))
    # The second staging could only start once the first upload was over and gave its arena back.
    assert w1.last_stats.bytes > 0
    first.result(timeout=120)
    second.result(timeout=120)
    assert pool.allocations == 1


def test_two_in_flight_when_allowed(bucket, config):
    pool = HostBufferPool()
    cfg = config.replace(max_inflight_checkpoints=2)
    state = _state(n=2)
    futures = [dcp.async_save(state, storage_writer=S3StorageWriter(f"s3://{bucket}/d{i}", config=cfg, pool=pool))
               for i in range(2)]
    for f in futures:
        f.result(timeout=120)
    assert pool.allocations == 2  # double buffering


def test_an_upload_failure_lands_on_the_future_and_the_next_save_works(s3_server, bucket, config):
    state = _state(n=2)
    pool = HostBufferPool()
    broken = config.replace(secret_access_key="wrong-secret")
    future = dcp.async_save(state, storage_writer=S3StorageWriter(f"s3://{bucket}/x", config=broken, pool=pool))
    with pytest.raises(CheckpointException) as e:  # DCP's, a BaseException
        future.result(timeout=120)
    assert "403" in str(e.value)
    _wait_for(lambda: pool.in_use == 0)  # the arena came back (from a save that failed in set-up)
    good = dcp.async_save(state, storage_writer=S3StorageWriter(f"s3://{bucket}/y", config=config, pool=pool))
    good.result(timeout=120)
    assert pool.allocations == 1
    # nothing committed for the failed one
    with pytest.raises(Exception, match="no checkpoint at"):
        S3StorageReader(f"s3://{bucket}/x", config=config).fetch_metadata()


def test_a_save_that_fails_before_writing_releases_the_training_loop(bucket, config):
    """Checkpoint already there: the save fails in set-up; async_save must not hang."""
    state = _state(n=2)
    pool = HostBufferPool()
    dcp.save(state, storage_writer=S3StorageWriter(f"s3://{bucket}/dup", config=config))
    cfg = config.replace(staging_budget_bytes=1 * MiB)  # rounds pending: the loop is held
    result = {}

    def run():
        result["future"] = dcp.async_save(
            state, storage_writer=S3StorageWriter(f"s3://{bucket}/dup", config=cfg, pool=pool))

    t = threading.Thread(target=run)
    t.start()
    t.join(timeout=60)
    assert not t.is_alive(), "async_save hung"
    with pytest.raises(CheckpointException, match="already holds a committed checkpoint"):
        result["future"].result(timeout=60)


def test_async_stager_argument_and_response_shape(bucket, config):
    state = _state(n=2)
    writer = S3StorageWriter(f"s3://{bucket}/st", config=config, pool=HostBufferPool())
    resp = dcp.async_save(state, storage_writer=writer, async_stager=writer)
    resp.result(timeout=120)
    out = _load(f"s3://{bucket}/st", config, state)
    assert torch.equal(out["layer1.weight"], state["layer1.weight"])


def test_process_executor_round_trip(s3_server, bucket):
    """DCP's process executor: the writer is pickled to a daemon process; staged tensors go
    there through shared memory. Run in a fresh interpreter (it needs a process group)."""
    env = {**os.environ, **s3_server.env()}
    job = Path(__file__).parents[1] / "process_executor_job.py"
    done = subprocess.run([sys.executable, str(job), f"s3://{bucket}/proc"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "process executor: OK" in done.stdout


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_staging_uses_pinned_memory_and_a_side_stream(bucket, config):
    pool = HostBufferPool()
    assert pool.pin_memory
    state = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in _state(n=2).items()}
    expected = {k: v.cpu() for k, v in state.items() if isinstance(v, torch.Tensor)}
    writer = S3StorageWriter(f"s3://{bucket}/gpu", config=config, pool=pool)
    future = dcp.async_save(state, storage_writer=writer)
    for v in state.values():
        if isinstance(v, torch.Tensor):
            v.add_(1)
    future.result(timeout=120)
    out = _load(f"s3://{bucket}/gpu", config, {k: v for k, v in expected.items()} | {"step": 0, "extra": {}})
    for k, v in expected.items():
        assert torch.equal(out[k], v), k


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_arenas_are_exactly_their_size_and_unpinned_when_released():
    """Arenas are registered host memory, not torch's caching pinned allocator (which rounds up
    to a power of two and never gives memory back)."""
    pool = HostBufferPool()
    before = torch.cuda.host_memory_stats().get("allocated_bytes.all.current", 0)
    size = 9 * MiB + 123  # rounds to 10 MiB in 1 MiB steps; torch's allocator would pin 16 MiB+
    arena = pool.acquire(size)
    assert arena.buffer.is_pinned() and arena.capacity == 10 * MiB
    assert torch.cuda.host_memory_stats().get("allocated_bytes.all.current", 0) == before
    buffer = arena.buffer
    pool.release(arena)
    pool.clear()
    assert not buffer.is_pinned(), "release_staging_memory left the arena pinned"


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_cuda_staging_waits_for_the_copies_of_every_device(bucket, config):
    """Sources on cuda:0 and cuda:1, with cuda:0 current: a copy from cuda:1 runs on cuda:1's
    streams, and the upload must not read the arena before it has landed."""
    gen = torch.Generator().manual_seed(11)
    state = {f"d{d}.{i}": torch.randn(32 * MiB, generator=gen).to(f"cuda:{d}") for d in (0, 1) for i in range(2)}
    expected = {k: v.cpu() for k, v in state.items()}
    torch.cuda.set_device(0)
    future = dcp.async_save(state, storage_writer=S3StorageWriter(f"s3://{bucket}/gpus", config=config,
                                                                  pool=HostBufferPool()))
    for v in state.values():
        v.zero_()
    future.result(timeout=120)
    out = {k: torch.zeros_like(v) for k, v in expected.items()}
    dcp.load(out, storage_reader=S3StorageReader(f"s3://{bucket}/gpus", config=config))
    for k, v in expected.items():
        assert torch.equal(out[k], v), k


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_budget_rounds_copy_after_the_work_queued_on_the_callers_stream(bucket, config):
    """async_save called inside ``torch.cuda.stream(s)`` right after queuing work on ``s``: the
    tensors beyond the staging budget, copied later on the save thread, hold that work's result."""
    from dataclasses import replace

    training = torch.cuda.Stream()
    state = {f"w{i}": torch.zeros(4 * MiB, device="cuda") for i in range(4)}  # 64 MiB, budget 16 MiB
    torch.cuda.synchronize()
    with torch.cuda.stream(training):
        torch.cuda._sleep(200_000_000)  # the GPU is busy on this stream for a while
        for v in state.values():
            v.fill_(3.0)
        future = dcp.async_save(state, storage_writer=S3StorageWriter(
            f"s3://{bucket}/rounds", config=replace(config, staging_budget_bytes=16 * MiB), pool=HostBufferPool()))
    future.result(timeout=120)
    out = {k: torch.zeros(4 * MiB) for k in state}
    dcp.load(out, storage_reader=S3StorageReader(f"s3://{bucket}/rounds", config=config))
    for k, v in out.items():
        assert torch.all(v == 3.0), k


def test_a_staged_dict_pickles_as_a_plain_dict_once_its_arena_is_unpinned(config):
    """DCP's process executor pickles the staged dict, which moves the arena's storage into
    shared memory: a pinned arena is unregistered first (here a CPU arena stands in, marked
    pinned), and the child gets a plain dict with the same values."""
    import pickle

    writer = S3StorageWriter("s3://bucket/pickled", config=config, pool=HostBufferPool())
    state = _state(n=2)
    staged = writer.stage(state)
    writer.synchronize_staging()
    arena = writer._lease.arena
    arena.pinned = True
    clone = pickle.loads(pickle.dumps(staged))
    assert type(clone) is dict and clone.keys() == state.keys()
    for k, v in state.items():
        assert torch.equal(clone[k], v) if isinstance(v, torch.Tensor) else clone[k] == v, k
    assert not arena.pinned
    writer._lease.release()


def test_a_slab_is_a_shared_memory_file_on_pages_of_its_own_gone_with_its_last_view():
    """A slab is a file the CRT reads by path (/proc/self/fd/N), mapped on pages of its own
    (CUDA registers whole pages: a slab sharing a page with another would fail the second
    registration). Its mapping and its descriptor go when the last tensor viewing it does."""
    import mmap
    import os

    from s3dcp.memory.slabs import Slab, file_of

    def mapped(address: int) -> bool:
        with open("/proc/self/maps") as maps:
            for line in maps:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                if lo <= address < hi:
                    return True
        return False

    size = 8 * MiB + 3 * mmap.PAGESIZE + 5
    slab = Slab(size, pinned=False)
    address, path = slab.address, slab.path
    assert address % mmap.PAGESIZE == 0 and slab.buffer.numel() == size and mapped(address)
    assert os.path.getsize(path) >= size  # the file the CRT opens by its path
    view = slab.buffer[size - 10:]
    view.fill_(7)
    with open(path, "rb") as f:  # what is written through the mapping is the file's content
        f.seek(size - 10)
        assert f.read(10) == b"\x07" * 10
    span = file_of(slab.buffer[100:200])
    assert span is not None and span.path == path and span.offset == 100
    del slab, span
    assert mapped(address) and os.path.exists(path)  # still mapped while a view lives
    del view
    assert not mapped(address) and not os.path.exists(path)


def _stage_in_child(queue, config, state):
    torch.set_num_threads(1)  # torch's own OpenMP pool is not fork-safe (what DataLoader workers do too)
    writer = S3StorageWriter("s3://bucket/forked", config=config, pool=HostBufferPool())
    staged = writer.stage(state)
    writer.synchronize_staging()
    queue.put(torch.equal(staged["w"], state["w"]))


def test_a_forked_child_stages_after_its_parent_did(config):
    """Staging in a child forked after its parent staged (and used torch's threads for it)
    copies the child's own state."""
    state = {"w": torch.randn(4 * MiB)}
    writer = S3StorageWriter("s3://bucket/parent", config=config, pool=HostBufferPool())
    writer.stage(state)
    writer.synchronize_staging()
    writer._lease.release()
    assert_forked_child_says_true(_stage_in_child, config, {"w": torch.arange(4 * MiB, dtype=torch.float32)})


def assert_forked_child_says_true(target, *args) -> None:
    """Fork a child running ``target(queue, *args)``; it must put True and exit 0 (within 30 s)."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=target, args=(queue, *args))
    child.start()
    try:
        assert queue.get(timeout=30) is True
    finally:
        child.join(timeout=10)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0


def test_staging_copies_every_tensor_to_its_place_and_leaves_the_gaps_between_them_untouched(config):
    """Odd sizes, dtypes and layouts (strided, lazy conjugate and negative views, a 0-dim and an
    empty tensor) each land exactly at their aligned place in the arena, with their values; the
    alignment gaps between them keep what was there."""
    from s3dcp.memory.pool import ALIGN_BYTES

    gen = torch.Generator().manual_seed(7)
    state = {
        "byte": torch.randint(0, 256, (1,), dtype=torch.uint8, generator=gen),
        "odd": torch.randint(0, 256, (7,), dtype=torch.uint8, generator=gen),
        "bf16": torch.randn(5 * MiB + 3, generator=gen).to(torch.bfloat16),
        "transposed": torch.randn(33, 65, generator=gen).t(),
        "conj": torch.randn(17, dtype=torch.complex64, generator=gen).conj(),
        "neg": torch._neg_view(torch.randn(9, dtype=torch.complex64, generator=gen).conj().resolve_conj()),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.empty(0, 4),
        "big": torch.randn(3 * MiB + 1, generator=gen),
    }
    pool = HostBufferPool()
    writer = S3StorageWriter("s3://bucket/places", config=config, pool=pool)
    writer.warm_up(state)  # zeroed
    staged = writer.stage(state)
    writer.synchronize_staging()
    try:
        arena = writer._lease.arena
        filled = [torch.zeros(slab.capacity, dtype=torch.bool) for slab in arena.slabs]
        for name, value in state.items():
            out = staged[name]
            assert torch.equal(out, value.resolve_conj().resolve_neg()), name
            assert out.is_contiguous() and not out.is_conj() and not out.is_neg(), name
            if out.nbytes:
                (index,) = [i for i, slab in enumerate(arena.slabs) if slab.holds(out)]
                offset = out.data_ptr() - arena.slabs[index].address
                assert offset % ALIGN_BYTES == 0, name
                assert not filled[index][offset:offset + out.nbytes].any(), f"{name} overlaps another tensor"
                filled[index][offset:offset + out.nbytes] = True
        for slab, mask in zip(arena.slabs, filled):
            assert int(slab.buffer[~mask].count_nonzero()) == 0, "bytes were written outside the tensors' places"
            used = int(mask.nonzero().max()) + 1 if mask.any() else 0
            # one object per slab: at most the object size target, unless one tensor is larger
            assert used <= config.object_size_target_bytes or int(mask.sum()) == used, used
    finally:
        writer._lease.release()
