"""Restart from the nearest copy, on two simulated nodes × 2 ranks (tests/multinode.py), bitwise:
steps 10 (local + S3) and 20 (local only); a restart resumes at 20 with no S3 data read; a node's
local_dir lost: 20 from the peer replicas, or 10 from S3 without them; a corrupt local file: that
part from the next tier; a copy's .metadata garbled: another node's; a rank killed while writing
its copy: that step never selected; a resharded load (4 saved, 2 restore everything) from local
copies and peers, else S3."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from multinode import NodesFailed, run_two_nodes

pytestmark = pytest.mark.multiproc

JOB = Path(__file__).with_name("tiers_job.py")


def _run(tmp_path, phase, uri, root, replicas, *extra, nproc=2, name=None):
    return run_two_nodes(JOB, [phase, uri, str(root), str(replicas), *extra], outdir=tmp_path / (name or phase),
                         nproc_per_node=nproc, env=_env)


_env: dict = {}


@pytest.fixture(autouse=True)
def _server_env(s3_server):
    _env.clear()
    _env.update(s3_server.env())


def _s3_steps(boto3_client, bucket, run):
    keys = [o["Key"] for o in boto3_client.list_objects_v2(Bucket=bucket, Prefix=f"{run}/").get("Contents", [])]
    return sorted({k.split("/")[1] for k in keys if k.endswith("/.metadata")})


def test_restart_from_local_copies_and_peer_replicas(bucket, tmp_path, boto3_client):
    uri, root = f"s3://{bucket}/run", tmp_path / "local"
    _run(tmp_path, "save", uri, root, 1)
    assert _s3_steps(boto3_client, bucket, "run") == ["step-00000010"]  # 20 is local only
    for node, held in ((0, ["rank-0", "rank-1", "rank-2", "rank-3"]), (1, ["rank-0", "rank-1", "rank-2", "rank-3"])):
        assert sorted(p.name for p in (root / f"node{node}" / "step-00000020").iterdir()) == held  # own + replicas

    # every process restarted on the same nodes: step 20, nothing read from S3
    loads = _run(tmp_path, "load", uri, root, 1, name="restart")
    for r in loads:
        assert r["step"] == 20 and r["equal"], r
        assert r["stats"]["tier"] == "local" and r["stats"]["job_bytes"]["s3"] == 0, r["stats"]

    # node 1's local_dir lost: step 20 from the replicas node 0 holds, still nothing from S3
    shutil.rmtree(root / "node1")
    loads = _run(tmp_path, "load", uri, root, 1, name="lost")
    for r in loads:
        assert r["step"] == 20 and r["equal"], r
        assert r["stats"]["tier"] == "peer" and r["stats"]["job_bytes"]["s3"] == 0, r["stats"]
    assert all(r["stats"]["peer_bytes"] > 0 for r in loads if r["env"]["node"] == 1)

    # a corrupt local file: that rank's part of step 20 comes from the next tier, node 1's copy
    shutil.copytree(root / "node0", root / "node1")  # node 1 holds the same copies again
    damaged = next((root / "node0" / "step-00000020" / "rank-0").glob("__0_*.distcp"))
    data = bytearray(damaged.read_bytes())
    data[100] ^= 0xFF
    damaged.write_bytes(bytes(data))
    loads = _run(tmp_path, "load", uri, root, 1, name="corrupt")
    for r in loads:
        assert r["step"] == 20 and r["equal"], r
        assert r["stats"]["corrupt_copies"] == [[20, 0]] and r["stats"]["job_bytes"]["s3"] == 0, r["stats"]
    assert loads[0]["stats"]["peer_bytes"] > 0  # rank 0's own objects, sent from node 1

    # node 1's copies of step 20 with a .metadata that does not decode: named in the log, and the
    # metadata comes from node 0's copies; node 1's objects still come from its own files
    for rank_dir in (root / "node1" / "step-00000020").iterdir():
        (rank_dir / ".metadata").write_bytes(b"\x80\x04 not a metadata")
    loads = _run(tmp_path, "load", uri, root, 1, name="garbled")
    for r in loads:
        assert r["step"] == 20 and r["equal"] and r["stats"]["job_bytes"]["s3"] == 0, r
    assert all(r["stats"]["local_bytes"] > 0 for r in loads if r["env"]["node"] == 1)
    assert "its .metadata is unreadable" in (tmp_path / "garbled" / "node1.log").read_text()


def test_without_replicas_a_lost_node_resumes_from_s3_and_a_killed_write_is_never_selected(
        bucket, tmp_path, boto3_client):
    uri, root = f"s3://{bucket}/run", tmp_path / "local"
    _run(tmp_path, "save", uri, root, 0)
    with pytest.raises(NodesFailed):  # rank 3 dies while writing its copy of step 30
        _run(tmp_path, "crash", uri, root, 0)
    assert "step-00000030" not in _s3_steps(boto3_client, bucket, "run")
    loads = _run(tmp_path, "load", uri, root, 0, name="after-crash")
    assert all(r["step"] == 20 and r["equal"] and r["stats"]["job_bytes"]["s3"] == 0 for r in loads), loads

    # resharded: 2 ranks (one a node) each load all 4 saving ranks' tensors of step 20: their
    # node's copies locally, the other node's sent over by a rank there
    loads = _run(tmp_path, "load", uri, root, 0, "all", nproc=1, name="resharded")
    for r in loads:
        assert r["step"] == 20 and r["equal"], r
        assert r["stats"]["local_bytes"] > 0 and r["stats"]["peer_bytes"] > 0 and r["stats"]["s3_bytes"] == 0

    shutil.rmtree(root / "node1")  # ranks 2 and 3's copies are gone, and no peer holds them
    loads = _run(tmp_path, "load", uri, root, 0, name="lost")
    for r in loads:
        assert r["step"] == 10 and r["equal"], r
    assert all(r["stats"]["s3_bytes"] > 0 for r in loads if r["env"]["node"] == 1)
    assert all(r["stats"]["s3_bytes"] == 0 and r["stats"]["local_bytes"] > 0 for r in loads if r["env"]["node"] == 0)
