"""Where each object's bytes come from: a staging slab's file as it is, or items copied once into
a slab (saving/uploads.py). Every case loads back bitwise; ``last_stats.copied_bytes`` says how
many bytes write_data copied."""

import dataclasses

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner

import s3dcp
from s3dcp import HostBufferPool, S3StorageReader, S3StorageWriter
from s3dcp.config import MiB


@pytest.fixture
def config(s3_server):
    return s3_server.s3_config(part_size_bytes=5 * MiB, object_size_target_bytes=6 * MiB)


def _state(seed=0):
    gen = torch.Generator().manual_seed(seed)
    state = {f"w{i}": torch.randn(512 * 1024 + 3 * i, generator=gen) for i in range(5)}  # ~2 MiB each
    state["big"] = torch.randn(2 * MiB + 7, generator=gen)  # 8 MiB: larger than an object's target
    state["bf16"] = torch.randn(1001, generator=gen).to(torch.bfloat16)
    state["step"] = 5
    return state


def _tensor_bytes(state, names=None):
    return sum(v.nbytes for k, v in state.items() if isinstance(v, torch.Tensor) and (names is None or k in names))


def _load(uri, config, like):
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in like.items()}
    dcp.load(out, storage_reader=S3StorageReader(uri, config=config))
    return out


def _assert_same(expected, actual, names=None):
    for k, v in expected.items():
        if names is not None and k not in names:
            continue
        assert torch.equal(actual[k], v) if isinstance(v, torch.Tensor) else actual[k] == v, k


def _sizes(boto3_client, bucket, prefix):
    return sorted(o["Size"] for o in boto3_client.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]
                  if not o["Key"].endswith(".metadata"))


def test_an_async_save_sends_each_slab_as_its_object_without_copying(bucket, config, boto3_client):
    state = _state()
    writer = S3StorageWriter(f"s3://{bucket}/a", config=config, pool=HostBufferPool())
    dcp.async_save(state, storage_writer=writer).result(timeout=120)
    stats = writer.last_stats
    # only the serialized step (a few hundred bytes) is copied, into the free room of a slab
    assert 0 < stats.copied_bytes < 4096, stats
    sizes = _sizes(boto3_client, bucket, "a/")
    # 6 MiB objects: w0+w1, w2+w3, w4+bf16 (+ the step's bytes); the 8 MiB tensor alone
    assert len(sizes) == stats.objects == 4, sizes
    assert sizes[-1] == state["big"].nbytes and sizes[-2] <= config.object_size_target_bytes
    _assert_same(state, _load(f"s3://{bucket}/a", config, state))


def test_a_synchronous_save_copies_each_byte_once_into_memory_it_reuses(bucket, config):
    state = _state(1)
    pool = HostBufferPool()
    allocations = []
    for i in range(3):
        writer = S3StorageWriter(f"s3://{bucket}/s{i}", config=config, pool=pool)
        dcp.save(state, storage_writer=writer)
        # every tensor once, but the last object's (bf16, the step: under 1 MiB, one PUT from memory)
        assert writer.last_stats.copied_bytes == _tensor_bytes(state) - state["bf16"].nbytes, writer.last_stats
        allocations.append(pool.allocations)
        assert pool.in_use == 0  # every composed object's memory came back when its upload ended
        _assert_same(state, _load(f"s3://{bucket}/s{i}", config, state))
    assert allocations[0] > 0 and allocations[1] == allocations[2] == allocations[0], allocations


class _GivesSomeToAnotherRank(DefaultSavePlanner):
    """As DCP's deduplication does with replicated tensors: this rank writes only some of its
    staged tensors."""

    keep = ("w0", "w3", "big", "step")

    def create_local_plan(self):
        plan = super().create_local_plan()
        return dataclasses.replace(plan, items=[i for i in plan.items if i.index.fqn in self.keep])


def test_a_slab_most_of_whose_bytes_this_rank_does_not_write_is_copied_not_sent(bucket, config):
    state = _state(2)
    writer = S3StorageWriter(f"s3://{bucket}/d", config=config, pool=HostBufferPool())
    dcp.async_save(state, storage_writer=writer, planner=_GivesSomeToAnotherRank()).result(timeout=120)
    # "big" fills its slab and w0 starts its own: each sent from its slab (the object ends where
    # the last item written ends); w3 sits after w2, which this rank does not write: copied
    stats = writer.last_stats
    assert state["w3"].nbytes <= stats.copied_bytes < state["w3"].nbytes + 4096, stats
    assert stats.bytes < _tensor_bytes(state, ("w0", "w3", "big")) + 8192  # nobody else's bytes uploaded
    out = _load(f"s3://{bucket}/d", config, {k: state[k] for k in _GivesSomeToAnotherRank.keep})
    _assert_same(state, out, _GivesSomeToAnotherRank.keep)


def test_an_incremental_save_copies_only_what_changed(bucket, config):
    state = _state(3)
    s3dcp.save(state, f"s3://{bucket}/run/step-1", config=config)
    state["w0"].add_(1)  # the first bytes of its slab: sent from the slab
    state["w3"].add_(1)  # after an unchanged tensor in its slab: copied
    writer = S3StorageWriter(f"s3://{bucket}/run/step-2", config=config, pool=HostBufferPool(),
                             incremental_from=f"s3://{bucket}/run/step-1")
    dcp.async_save(state, storage_writer=writer).result(timeout=120)
    stats = writer.last_stats
    changed = state["w0"].nbytes + state["w3"].nbytes
    inherited_tensors = _tensor_bytes(state) - changed  # and the unchanged step's few serialized bytes
    assert inherited_tensors < stats.inherited_bytes < inherited_tensors + 4096, stats
    assert stats.copied_bytes == state["w3"].nbytes and stats.bytes == changed, stats
    _assert_same(state, _load(f"s3://{bucket}/run/step-2", config, state))


def test_without_room_in_dev_shm_staging_is_ordinary_memory_and_saves_still_work(bucket, config, monkeypatch,
                                                                                  caplog):
    """A container's small /dev/shm: torch refuses the shared-memory file at once (it allocates
    the pages), the slab is ordinary memory, and the upload goes through a stream the CRT copies."""
    import s3dcp.memory.slabs as slabs

    def full(size):
        raise RuntimeError("unable to allocate shared memory(shm) for file </torch_1_2_0>: No space left on device (28)")

    monkeypatch.setattr(torch.UntypedStorage, "_new_using_fd_cpu", full, raising=False)
    monkeypatch.setattr(slabs, "_WARNED_NO_SHM", False)
    monkeypatch.setattr(slabs, "_LAST_WAS_FILE", [True])
    state = _state(4)
    pool = HostBufferPool()
    writers = [S3StorageWriter(f"s3://{bucket}/noshm", config=config, pool=pool),
               S3StorageWriter(f"s3://{bucket}/noshm-sync", config=config, pool=pool)]
    with caplog.at_level("WARNING", logger="s3dcp"):
        dcp.async_save(state, storage_writer=writers[0]).result(timeout=120)
        dcp.save(state, storage_writer=writers[1])
    assert any("give /dev/shm room" in r.getMessage() for r in caplog.records)
    # no file to send from: the staged (async) and the caller's (sync) tensors are sent from
    # their own memory, not copied again into more ordinary memory
    assert [w.last_stats.copied_bytes for w in writers] == [0, 0]
    pool.reclaim()
    slabs_made = [slab for arena in pool._free for slab in arena.slabs]
    assert slabs_made and all(slab.path is None for slab in slabs_made)
    _assert_same(state, _load(f"s3://{bucket}/noshm", config, state))
    _assert_same(state, _load(f"s3://{bucket}/noshm-sync", config, state))


def test_a_synchronous_save_under_a_staging_budget_copies_in_a_bounded_window(bucket, config):
    """staging_budget_bytes bounds what a synchronous save copies at once: an object is composed
    only once the ones in flight leave room, and their slabs are reused."""
    gen = torch.Generator().manual_seed(9)
    state = {f"t{i}": torch.randn(MiB, generator=gen) for i in range(6)}  # 6 x 4 MiB, one object each
    pool = HostBufferPool()
    cfg = dataclasses.replace(config, object_size_target_bytes=4 * MiB, staging_budget_bytes=8 * MiB)
    writer = S3StorageWriter(f"s3://{bucket}/window", config=cfg, pool=pool)
    dcp.save(state, storage_writer=writer)
    assert writer.last_stats.copied_bytes == _tensor_bytes(state) and writer.last_stats.objects == 6
    assert pool.allocations <= 3 and pool.bytes_allocated <= 3 * 5 * MiB, (pool.allocations, pool.bytes_allocated)
    _assert_same(state, _load(f"s3://{bucket}/window", cfg, state))


def test_an_upload_that_fails_to_start_gives_its_composed_objects_slab_back(bucket, config):
    """A synchronous save's tensors are composed into pooled slabs; when the request cannot even
    start (here: put_file raises at once, as a full local_dir's write would), the slab returns
    to the pool instead of being held for ever."""
    pool = HostBufferPool()
    writer = S3StorageWriter(f"s3://{bucket}/nostart", config=config, pool=pool)

    def refused(*args, **kwargs):
        raise OSError(28, "No space left on device")

    writer.client.put_file = refused
    with pytest.raises(BaseException) as e:
        dcp.save(_state(5), storage_writer=writer)
    assert "No space left on device" in str(s3dcp.unwrap_error(e.value))
    pool.reclaim()
    assert pool.allocations >= 1 and len(pool._free) == pool.allocations and pool.in_use == 0


def test_defaultstagers_shared_memory_is_uploaded_from_its_files_without_copying_it_again(bucket, config,
                                                                                          boto3_client):
    """DCP's DefaultStager with shared memory stages each tensor into a shared-memory file of its
    own: a large one is its own object, sent from that file; the small ones travel together
    (one object, not one per tensor)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    gen = torch.Generator().manual_seed(5)
    state = {"big": torch.randn(3 * MiB, generator=gen), "step": 5}
    state |= {f"small{i}": torch.randn(100 + i, generator=gen) for i in range(20)}
    expected = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=True, use_async_staging=True,
                                          use_non_blocking_copy=False))
    writer = S3StorageWriter(f"s3://{bucket}/ds", config=config)
    try:
        response = dcp.async_save(state, storage_writer=writer, async_stager=stager)
        response.staging_completion.result(timeout=60)
        state["big"].add_(1)  # DefaultStager's copy is complete: the loop may go on
        response.upload_completion.result(timeout=120)
    finally:
        stager.close()
    assert writer.last_stats.copied_bytes == 0, writer.last_stats
    small_bytes = sum(v.nbytes for k, v in expected.items() if k.startswith("small"))
    sizes = _sizes(boto3_client, bucket, "ds/")
    assert len(sizes) == 2 and sizes[1] == expected["big"].nbytes and small_bytes <= sizes[0] < small_bytes + 4096
    _assert_same(expected, _load(f"s3://{bucket}/ds", config, expected))
