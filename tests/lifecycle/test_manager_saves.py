"""CheckpointManager's saves as a user meets them back to back: which base an incremental save
uses while the previous save is still in flight, and the figures of the last save."""

from __future__ import annotations

import pytest
import torch

import s3dcp
from s3dcp import CheckpointManager, S3StorageReader
from s3dcp.s3.client import S3Client

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

FROZEN_BYTES = 1024 * 256 * 4  # 1 MiB of float32 that no step changes


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"frozen": torch.randn(1024, 256, generator=g), "trained": torch.randn(16, 16, generator=g)}


def _locations(uri: str, client: S3Client) -> dict[str, str]:
    md = S3StorageReader(uri, client=client).fetch_metadata()
    return {index.fqn: loc.object_name for index, loc in md.storage_data.items()}


def test_back_to_back_incremental_saves_use_the_save_in_flight_as_their_base(bucket, s3_config):
    """One save in flight (the default): the next incremental save waits for it and refers to
    it; it used to take the newest *committed* checkpoint and upload step 2 in full."""
    client = S3Client(s3_config)
    assert s3_config.max_inflight_checkpoints == 1
    manager = CheckpointManager(f"s3://{bucket}/run", client=client, keep_last=None, incremental=True,
                                name_format="step-{step}")
    sd = _state()
    stats, futures, bases = {}, {}, {}
    for step in (1, 2, 3):
        sd["trained"].add_(1.0)
        futures[step] = manager.save(step, sd)  # no wait between saves
        bases[step] = manager.last_writer.incremental_from
        if step > 1:  # the previous save had committed before this one chose its base
            assert futures[step - 1].done()
            stats[step - 1] = manager.last_save_stats
    futures[3].result(timeout=120)
    stats[3] = manager.last_save_stats
    manager.close()
    assert bases[1] is None and stats[1].inherited_bytes == 0 and stats[1].bytes >= FROZEN_BYTES
    for step in (2, 3):
        assert bases[step].prefix == f"run/step-{step - 1}"
        assert stats[step].inherited_bytes == FROZEN_BYTES, (step, stats[step])
        assert stats[step].bytes == 16 * 16 * 4, (step, stats[step])  # only what changed
    # references point at the object that holds the bytes (never at a reference)
    assert _locations(f"s3://{bucket}/run/step-3", client)["frozen"].startswith("../step-1/")


@pytest.mark.parametrize("async_mode", [True, False])
def test_the_manager_exposes_the_last_saves_figures_and_last_save_stats_sees_them(bucket, s3_config, async_mode):
    manager = CheckpointManager(f"s3://{bucket}/run", config=s3_config, async_mode=async_mode, incremental=True)
    assert manager.last_save_stats is None
    sd = _state()
    future = manager.save(1, sd)
    if future is not None:
        future.result(timeout=120)
    first = manager.last_save_stats
    assert first is not None and first.bytes >= FROZEN_BYTES and first.objects >= 1 and first.inherited_bytes == 0
    assert s3dcp.last_save_stats() is first  # it used to stay None after manager saves
    sd["trained"].add_(1.0)
    future = manager.save(2, sd)
    if future is not None:
        future.result(timeout=120)
    second = manager.last_save_stats
    assert second is not first and second.inherited_bytes == FROZEN_BYTES and second.inherited_items == 1
    assert s3dcp.last_save_stats() is second
    manager.close()
