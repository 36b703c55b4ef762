"""Two nodes on one machine (tests/multinode.py): a state saved on 8 ranks is restored
cooperatively on 8 (2 replicas × 4 shards, and every rank everything) and on 4 of them
(resharded, in a process group of their own), bitwise, with every stored byte read from S3 once per job.

In the full set (``scripts/test --full``, CI): 8 ranks on 2 cores take half a minute. The quick
set proves the same on 4 ranks of two simulated nodes, a process group of two of them included
(tests/loading/test_cooperative.py), and torchrun's two-node launch in tests/lifecycle/test_tiers.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from multinode import run_two_nodes

pytestmark = [pytest.mark.multiproc, pytest.mark.full]

JOB = Path(__file__).with_name("two_node_job.py")


def test_save_on_8_restore_on_8_and_on_4_as_two_nodes(s3_server, bucket, tmp_path):
    uri = f"s3://{bucket}/two-nodes"
    eight = run_two_nodes(JOB, [uri], outdir=tmp_path, nproc_per_node=4, env=s3_server.env())
    assert [r["env"]["node"] for r in eight] == [0] * 4 + [1] * 4  # torchrun's GROUP_RANK, as on two hosts
    assert [r["env"]["local_rank"] for r in eight] == [0, 1, 2, 3] * 2
    for r in eight:
        for name in ("hsdp", "ddp"):
            s = r[name]
            assert s["mode"] == "cooperative" and s["ranks"] == 8 and s["rounds"] >= 1, (name, s)
            assert s["job_s3_bytes"] == s["unique_bytes"], (name, s)  # each stored byte from S3 once
        assert r["ddp"]["job_peer_bytes"] == 7 * r["ddp"]["unique_bytes"]
        assert r["ddp_plain"]["s3_bytes"] == r["ddp"]["unique_bytes"]  # plain: every rank reads it all
    assert sum(r["hsdp"]["s3_bytes"] for r in eight) == eight[0]["hsdp"]["unique_bytes"]
    # both nodes read from S3 (their NICs), in both layouts
    for name in ("hsdp", "ddp"):
        assert all(sum(r[name]["s3_bytes"] for r in eight if r["env"]["node"] == n) > 0 for n in (0, 1))

    four = [r for r in eight if "resharded" in r]
    assert [(r["env"]["node"], r["env"]["local_rank"]) for r in four] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in four:
        s = r["resharded"]
        assert s["ranks"] == 4 and s["job_s3_bytes"] == s["unique_bytes"], s
