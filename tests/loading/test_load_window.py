"""Loads that cannot land in place: only the needed byte ranges are fetched (a column range
reads about its share of the item, widened to checksum blocks), bounce memory stays within
the window whatever the state's size, a slot is reused only after the copy out of it ends (the
CPU stand-in for the CUDA path's asynchronous host-to-device copies), and every bounced block
is verified. Against the real server, single process; the ReadItems of a resharded load are
built by hand (a column range of a stored full tensor is what DTensor Shard(1) asks for)."""

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from s3dcp import S3StorageReader, S3StorageWriter
from s3dcp.loading import bounce
from s3dcp.config import MiB
from s3dcp.errors import IntegrityError, NoSuchKeyError, root_error
from s3dcp.memory.pool import HostBufferPool

from rss import peak_rss_sampler

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


class _ColumnPlanner:
    """The two planner calls read_data makes, for hand-built ReadItems."""

    def __init__(self, dests: dict[str, torch.Tensor]) -> None:
        self.dests = dests
        self.committed: list[str] = []

    def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
        return self.dests[item.dest_index.fqn]

    def commit_tensor(self, item: ReadItem, tensor: torch.Tensor) -> None:
        assert tensor.data_ptr() == self.dests[item.dest_index.fqn].data_ptr()
        self.committed.append(item.dest_index.fqn)


def _read_columns(uri: str, cfg, names: list[str], rows: int, col: int, width: int, dtype=torch.float32,
                  **reader_args) -> tuple[S3StorageReader, dict[str, torch.Tensor]]:
    """Load columns ``[col, col + width)`` of each saved 2-D tensor ``names`` (saved whole)."""
    reader = S3StorageReader(uri, config=cfg, **reader_args)
    reader.set_up_storage_reader(reader.fetch_metadata(), True)
    dests = {n: torch.zeros(rows, width, dtype=dtype) for n in names}
    items = [ReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex(n), dest_offsets=torch.Size([0, 0]),
                      storage_index=MetadataIndex(n, torch.Size([0, 0])),
                      storage_offsets=torch.Size([0, col]), lengths=torch.Size([rows, width]))
             for n in names]
    planner = _ColumnPlanner(dests)
    reader.read_data(LoadPlan(items), planner).wait()
    assert sorted(planner.committed) == sorted(names)
    return reader, dests


def _save(state: dict, uri: str, cfg) -> None:
    dcp.save(state, storage_writer=S3StorageWriter(uri, config=cfg))


def test_a_column_range_reads_only_its_share(s3_server, bucket):
    """Rows of two 16 MiB checksum blocks: half the columns is half the bytes, verified. With
    rows inside one block every block holds wanted bytes, so the whole item is read (that is
    what block widening costs); without verification and with a small gap, only the wanted
    columns of every row."""
    cfg = s3_server.s3_config()
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(2, 8 * MiB, generator=gen)  # 64 MiB, rows of 32 MiB
    narrow = torch.randn(64, 64 * 1024, generator=gen)  # 16 MiB, rows of 256 KiB
    _save({"wide": wide, "narrow": narrow}, f"s3://{bucket}/full", cfg)

    for col in (0, 4 * MiB):
        reader, got = _read_columns(f"s3://{bucket}/full", cfg, ["wide"], 2, col, 4 * MiB)
        assert torch.equal(got["wide"], wide[:, col:col + 4 * MiB])
        assert reader.last_read_bytes == 32 * MiB  # 1/2 of the item: one block of each row

    cols = slice(16384, 32768)
    reader, got = _read_columns(f"s3://{bucket}/full", cfg, ["narrow"], 64, 16384, 16384)
    assert torch.equal(got["narrow"], narrow[:, cols])
    assert reader.last_read_bytes == 16 * MiB  # one checksum for the whole item: all of it

    small_gap = cfg.replace(coalesce_gap_bytes=4096)
    reader, got = _read_columns(f"s3://{bucket}/full", small_gap, ["narrow"], 64, 16384, 16384, verify=False)
    assert torch.equal(got["narrow"], narrow[:, cols])
    assert reader.last_read_bytes == 4 * MiB  # 1/4 of the item: the wanted columns only


def test_an_unverified_row_range_lands_in_place(s3_server, bucket):
    """With nothing to verify (verify=False, or an item without checksum: safetensors files),
    a Shard(0)-like row range is one run of the item's bytes: fetched exactly and straight into
    the destination, no bounce window taken. Verified, it goes through the window."""
    cfg = s3_server.s3_config()
    rows = torch.randn(64, 1000, generator=torch.Generator().manual_seed(7))
    _save({"rows": rows}, f"s3://{bucket}/r", cfg)
    for verify, arenas in ((False, 0), (True, 1)):
        pool = HostBufferPool(pin_memory=False)
        reader = S3StorageReader(f"s3://{bucket}/r", config=cfg, verify=verify, pool=pool)
        reader.set_up_storage_reader(reader.fetch_metadata(), True)
        dest = torch.zeros(16, 1000)
        item = ReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex("rows"), dest_offsets=torch.Size([0, 0]),
                        storage_index=MetadataIndex("rows", torch.Size([0, 0])),
                        storage_offsets=torch.Size([32, 0]), lengths=torch.Size([16, 1000]))
        reader.read_data(LoadPlan([item]), _ColumnPlanner({"rows": dest})).wait()
        assert torch.equal(dest, rows[32:48]), verify
        assert pool.allocations == arenas, verify
        if not verify:
            assert reader.last_read_bytes == 16 * 1000 * 4


def test_a_corrupt_block_fails_only_the_reads_that_fetch_it(s3_server, bucket, boto3_client):
    cfg = s3_server.s3_config()
    wide = torch.randn(2, 8 * MiB, generator=torch.Generator().manual_seed(1))
    _save({"wide": wide}, f"s3://{bucket}/c", cfg)
    meta = S3StorageReader(f"s3://{bucket}/c", config=cfg).fetch_metadata()
    loc = next(loc for idx, loc in meta.storage_data.items() if idx.fqn == "wide")
    key = f"c/{loc.object_name}"
    body = bytearray(boto3_client.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[loc.offset + 20 * MiB] ^= 0x01  # row 0, second block (columns 4M..8M)
    boto3_client.put_object(Bucket=bucket, Key=key, Body=bytes(body))

    _, got = _read_columns(f"s3://{bucket}/c", cfg, ["wide"], 2, 0, 4 * MiB)  # never fetches that block
    assert torch.equal(got["wide"], wide[:, :4 * MiB])
    with pytest.raises(IntegrityError, match=r"'wide'.*bytes 16777216-33554432"):
        _read_columns(f"s3://{bucket}/c", cfg, ["wide"], 2, 4 * MiB, 4 * MiB)


def test_bounce_memory_stays_within_the_window(s3_server, bucket):
    """A state loaded into another dtype bounces every byte; the RSS rise of the load stays
    under 2 x download_part_size_bytes x max_concurrency, far below the state's size (the old
    reader allocated a bounce buffer for every item up front)."""
    cfg = s3_server.s3_config().replace(download_part_size_bytes=8 * MiB, max_concurrency=8)
    gen = torch.Generator().manual_seed(2)
    state = {f"t{i}": torch.randn(2, 4 * MiB, generator=gen) for i in range(6)}  # 6 x 32 MiB fp32
    _save(state, f"s3://{bucket}/m", cfg)
    dest = {k: torch.zeros(v.shape, dtype=torch.float64) for k, v in state.items()}  # 384 MiB, faulted in
    del state
    bound = 2 * cfg.download_part_size_bytes * cfg.max_concurrency

    with peak_rss_sampler(0.002) as measured:
        dcp.load(dest, storage_reader=S3StorageReader(f"s3://{bucket}/m", config=cfg))
    rise = measured.extra
    assert rise <= bound, f"RSS rose {rise / MiB:.0f} MiB during the load (bound {bound / MiB:.0f} MiB)"
    gen = torch.Generator().manual_seed(2)
    for i in range(6):
        assert torch.equal(dest[f"t{i}"], torch.randn(2, 4 * MiB, generator=gen).double())


def test_slots_are_reused_only_after_their_asynchronous_copies_end(s3_server, bucket, monkeypatch):
    """The CUDA path's side-stream copies, stood in for by a copier that finishes each copy
    later on another thread: a slot refilled before its copy ran would corrupt the result."""
    copiers: list[bounce.ThreadCopier] = []

    def slow_copier(device):
        copiers.append(bounce.ThreadCopier(delay_s=0.02))
        return copiers[-1]

    monkeypatch.setattr(bounce, "copier_for", slow_copier)
    cfg = s3_server.s3_config().replace(download_part_size_bytes=5 * MiB, max_concurrency=1,
                                        coalesce_gap_bytes=0)
    gen = torch.Generator().manual_seed(3)
    state = {f"t{i}": torch.randn(1024, 300, generator=gen) for i in range(12)}  # 1.2 MB each
    state["big"] = torch.randn(3, 4 * MiB, generator=gen)  # 48 MiB: blocks of 16 MiB
    _save(state, f"s3://{bucket}/a", cfg)
    # The small items only: slots of 1.25 MiB, one item each, 12 items through 4 slots.
    dest = {k: torch.zeros(v.shape, dtype=torch.float64) for k, v in state.items() if k != "big"}
    dcp.load(dest, storage_reader=S3StorageReader(f"s3://{bucket}/a", config=cfg))
    for k, v in dest.items():
        assert torch.equal(v, state[k].double()), k
    assert copiers, "the stand-in copier was not used"

    # Columns of every row of "big" through the same slow copier, two slots.
    reader, got = _read_columns(f"s3://{bucket}/a", cfg, ["big"], 3, 1000, 3 * MiB, dtype=torch.float64)
    assert torch.equal(got["big"], state["big"][:, 1000:1000 + 3 * MiB].double())


def test_a_failed_get_ends_the_load_with_every_slot_back(s3_server, bucket, boto3_client):
    """An object gone mid-checkpoint: the load fails naming it, nothing is left running and the
    next load of a good checkpoint works."""
    cfg = s3_server.s3_config().replace(download_part_size_bytes=5 * MiB, max_concurrency=2)
    state = {f"t{i}": torch.randn(512, 1024, generator=torch.Generator().manual_seed(i)) for i in range(8)}
    _save(state, f"s3://{bucket}/ok", cfg)
    _save(state, f"s3://{bucket}/bad", cfg)
    objects = boto3_client.list_objects_v2(Bucket=bucket, Prefix="bad/")["Contents"]
    victim = next(o["Key"] for o in objects if o["Key"].endswith(".distcp"))
    boto3_client.delete_object(Bucket=bucket, Key=victim)
    dest = {k: torch.zeros(v.shape, dtype=torch.float16) for k, v in state.items()}
    pool = HostBufferPool(pin_memory=False)
    with pytest.raises(CheckpointException) as info:
        dcp.load(dest, storage_reader=S3StorageReader(f"s3://{bucket}/bad", config=cfg, pool=pool))
    error = root_error(info.value)
    assert isinstance(error, NoSuchKeyError) and victim in str(error)
    assert pool.allocations == 1 and pool.in_use == 0
    dcp.load(dest, storage_reader=S3StorageReader(f"s3://{bucket}/ok", config=cfg, pool=pool))
    assert pool.allocations == 2 and pool.in_use == 0  # plain host memory: freed after each load
    for k, v in state.items():
        assert torch.equal(dest[k], v.half()), k


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_destinations_load_through_pinned_slots(s3_server, bucket):
    """GPU destinations: whole items and a column range, cast on the way, through pinned slots
    and side-stream copies; the tensors are ready for work queued after the load."""
    cfg = s3_server.s3_config().replace(download_part_size_bytes=8 * MiB, max_concurrency=4)
    gen = torch.Generator().manual_seed(4)
    state = {"w": torch.randn(2, 8 * MiB, generator=gen), "b": torch.randn(1000, generator=gen)}
    _save(state, f"s3://{bucket}/g", cfg)
    pool = HostBufferPool()
    assert pool.pin_memory
    dest = {"w": torch.zeros(2, 8 * MiB, device="cuda"), "b": torch.zeros(1000, device="cuda", dtype=torch.float64)}
    dcp.load(dest, storage_reader=S3StorageReader(f"s3://{bucket}/g", config=cfg, pool=pool))
    assert torch.equal(dest["w"].cpu(), state["w"]) and torch.equal(dest["b"].cpu(), state["b"].double())
    assert pool.allocations == 1 and pool.in_use == 0 and pool.bytes_allocated > 0  # pinned: kept for the next load

    reader = S3StorageReader(f"s3://{bucket}/g", config=cfg, pool=pool)
    reader.set_up_storage_reader(reader.fetch_metadata(), True)
    cols = torch.zeros(2, 4 * MiB, device="cuda")
    item = ReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex("w"), dest_offsets=torch.Size([0, 0]),
                    storage_index=MetadataIndex("w", torch.Size([0, 0])), storage_offsets=torch.Size([0, 4 * MiB]),
                    lengths=torch.Size([2, 4 * MiB]))
    reader.read_data(LoadPlan([item]), _ColumnPlanner({"w": cols})).wait()
    assert torch.equal(cols.cpu(), state["w"][:, 4 * MiB:]) and reader.last_read_bytes == 32 * MiB
    assert pool.allocations == 1  # the pinned arena was reused
