"""Restart from the nearest copy, on two simulated nodes × 2 ranks (torchrun ``--nnodes 2``,
tests/multinode.py), bitwise, in one job whose phases are restarts (tests/lifecycle/tiers_job.py):

    save       steps 10 (local + S3) and 20 (local only), replicated; every file private
    restart    20, nothing read from S3
    lost       node 1's local_dir gone: 20 from the replicas node 0 holds
    corrupt    a corrupt local file: that part from the other node's copy
    garbled    a node's .metadata unreadable: another node's
    rollback_s3  back to 10, then 15 to S3 and 20 ("y2") on the nodes only, without replicas, the
               other save's replicas left on the nodes: 20 "y2" resumed (before: 15), no rank waits
               (issue 38, rows 1 and 2), the stale copies named
    rollback   back to 10 again, 20 saved again ("y", to S3), with replicas: S3's save is read
    rm         step 20 deleted from S3: the nodes' copies of it are not loaded; 15 is resumed
    swap       the node order changes between runs: each node finds the other's copies
    outage     S3 unreachable: the restore comes from the nodes; the S3 steps are kept on the nodes,
               saying why they are not in S3 (issue 39, row 1)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from multinode import run_two_nodes

pytestmark = pytest.mark.multiproc

JOB = Path(__file__).with_name("tiers_job.py")
PHASES = ["save", "restart", "lost", "corrupt", "garbled", "rollback_s3", "rollback", "rm", "swap", "outage"]


def _s3_steps(boto3_client, bucket, run):
    keys = [o["Key"] for o in boto3_client.list_objects_v2(Bucket=bucket, Prefix=f"{run}/").get("Contents", [])]
    return sorted(int(k.split("/")[1][5:]) for k in keys if k.endswith("/.metadata"))


def _loaded(r, step, variant, tier=None):
    assert r.get("step") == step and r["variant"] == variant and r["equal"], r
    if tier is not None:
        assert r["stats"]["tier"] == tier, r["stats"]


def test_restart_from_the_nearest_copy_through_rollbacks_node_changes_and_an_outage(
        s3_server, bucket, tmp_path, boto3_client):
    uri, root = f"s3://{bucket}/run", tmp_path / "local"
    ranks = run_two_nodes(JOB, [uri, str(root), ",".join(PHASES)], outdir=tmp_path / "job", nproc_per_node=2,
                          env=s3_server.env(), timeout_s=420)
    logs = "\n".join((tmp_path / "job" / f"node{n}.log").read_text(errors="replace") for n in (0, 1))
    for r in ranks:
        node = r["env"]["node"]
        save = r["save"]
        assert [s["stored_in"] for s in save["saves"]] == [["s3", "local"], ["local"]], save
        assert save["held"] == ["rank-0", "rank-1", "rank-2", "rank-3"]  # own copies + the other node's replicas
        assert save["loose"] == [], save["loose"]  # 0700 directories, 0600 files (issue 38, row 4)

        _loaded(r["restart"], 20, "x", "local")
        assert r["restart"]["stats"]["job_bytes"]["s3"] == 0
        _loaded(r["lost"], 20, "x", "peer")
        assert r["lost"]["stats"]["job_bytes"]["s3"] == 0
        if node == 1:
            assert r["lost"]["stats"]["peer_bytes"] > 0
        _loaded(r["corrupt"], 20, "x")
        assert r["corrupt"]["stats"]["corrupt_copies"] == [[20, 0]] and r["corrupt"]["stats"]["job_bytes"]["s3"] == 0
        _loaded(r["garbled"], 20, "x")
        assert r["garbled"]["stats"]["job_bytes"]["s3"] == 0
        if node == 1:
            assert r["garbled"]["stats"]["local_bytes"] > 0

        rollback = r["rollback_s3"]
        _loaded(rollback["back"], 10, "x")
        assert [s["stored_in"] for s in rollback["saves"]] == [["s3", "local"], ["local"]]
        assert rollback["held"] == ["rank-0", "rank-1", "rank-2", "rank-3"]  # "y2" of its own, "x" of the other's
        _loaded(rollback["load"], 20, "y2")  # before: 15, or every rank waiting for the group's timeout
        assert rollback["load"]["s"] < 30, rollback["load"]

        _loaded(r["rollback"]["load"], 20, "y", "local")  # own copies and replicas of "y" on both nodes
        assert [s["stored_in"] for s in r["rollback"]["saves"]] == [["s3", "local"]]

        rm = r["rm"]
        assert rm["gone"]["error"] == "CheckpointNotFoundError", rm["gone"]
        assert "S3 holds step(s) 10, 15" in rm["gone"]["message"], rm["gone"]
        _loaded(rm["load"], 15, "y2")
        _loaded(rm["after"], 20, "y3")

        _loaded(r["swap"]["load"], 20, "y3")
        assert r["swap"]["load"]["stats"]["job_bytes"]["s3"] == 0 and r["swap"]["load"]["stats"]["peer_bytes"] > 0
        _loaded(r["swap"]["after"], 30, "z")

        outage = r["outage"]
        # without replicas, node 1 gets rank 0's non-tensor item ("step") from node 0: "peer"
        _loaded(outage["load"], 30, "z")
        first, second = outage["saves"]
        # the S3 step: kept on the nodes, and why it is not in S3 said; the next one tries S3 again
        assert first["stored_in"] == ["local"] and "S3ConnectionError" in first["s3_error"], first
        assert second["stored_in"] == ["local"] and "S3ConnectionError" in second["s3_error"], second
        _loaded(outage["after"], 50, "w")
        assert outage["load"]["stats"]["job_bytes"]["s3"] == outage["after"]["stats"]["job_bytes"]["s3"] == 0
        assert any("without S3" in line for line in outage["warnings"]), outage["warnings"]
    assert _s3_steps(boto3_client, bucket, "run") == [15, 20, 30]  # keep_last=3
    said = [line for r in ranks for key, lines in r.items() if key.endswith(".log") for line in lines]
    assert any("are not used" in line and "saved again" in line for line in ranks[0]["rollback_s3.log"]), \
        ranks[0]["rollback_s3.log"]  # the stale copies, named once, by the coordinator
    assert not [line for line in said if "is partial" in line]  # no copy seen half deleted (issue 39, row 4)
    assert "Traceback" not in logs
