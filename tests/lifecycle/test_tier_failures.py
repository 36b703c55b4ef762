"""The local tier when one rank fails (issue 38, row 7), on 4 gloo ranks as two simulated nodes
(``GROUP_RANK`` per rank, as torchrun sets it), against the real server:

- a rank SIGKILLed (or raising) mid-transfer of a restore: every survivor fails within seconds, not at the
  group's timeout (before: the senders waited forever);
- a local commit that fails on one rank (ENOSPC writing ``.metadata``): every rank says the same
  of the step — in S3 with its local copy failed on rank 1, or, kept on the nodes only, dropped
  everywhere with a LocalCopyError — and nothing waits, replication included (before: the peer
  waited for a manifest that never came, and ``wait()`` hung);
- a rank killed while writing its copy of step 30: 20 is resumed; then the job comes back on 2
  ranks (another world size): the 4 ranks' copies are read (resharded), and the copies no rank
  owns any more are cleaned by retention.
"""

from __future__ import annotations

import errno
import os
import shutil
import time

import pytest
import torch.distributed as dist

from killed_rank import KilledJob, joined, killed, report, stay
from test_multiprocess import Job, run_jobs
from tiers_job import Ctx

pytestmark = pytest.mark.multiproc

BOUND_S = 40  # documented: a few seconds (liveness POLL_S, then BROKEN_TIMEOUT_S); generous for 2 loaded cores
GROUP_TIMEOUT_S = 300


def _ctx(rank, world, uri, root, cfg, per_node=2) -> Ctx:
    os.environ["GROUP_RANK"] = str(rank // per_node)  # the simulated node, as torchrun says it
    return Ctx(uri, root, rank, world, rank // per_node, rank % per_node, config=cfg)


# ---------------------------------------------------------------------------------------------
# a rank killed mid-transfer


def _setup(rank, world, uri, root, cfg):
    c = _ctx(rank, world, uri, root, cfg)
    return c.save(c.manager(replicas=0), (10, 20), "x")


def _killed_mid_transfer(rank, world, port, outdir, uri, root, cfg):
    """Ranks 2 and 3 need rank 0's object (its non-tensor item: no replicas), sent by ranks 0
    and 1; rank 0 dies as it posts its send."""
    joined(rank, world, port, outdir, GROUP_TIMEOUT_S)
    c = _ctx(rank, world, uri, root, cfg)
    if rank == 0:
        dist.isend = lambda *args, **kwargs: killed(outdir)
    report(outdir, rank, c.load(c.manager(replicas=0)))
    stay()


def test_a_rank_killed_mid_transfer_ends_every_rank_s_restore_within_seconds(s3_config, bucket, tmp_path):
    uri, root = f"s3://{bucket}/run", str(tmp_path / "local")
    setup = Job("setup", _setup, 4, (uri, root, s3_config))
    run_jobs(tmp_path / "setup", setup)
    assert all([s["stored_in"] for s in r] == [["s3", "local"], ["local"]] for r in setup.results), setup.results
    with KilledJob(_killed_mid_transfer, 4, tmp_path / "killed", (uri, root, s3_config)) as job:
        results, logs = job.survivors([1, 2, 3], BOUND_S)
    assert sorted(results) == [1, 2, 3], f"survivors still waiting {BOUND_S} s after the kill\n{logs}"
    for r, (outcome, after) in results.items():
        assert "error" in outcome, (r, outcome)
        assert after < BOUND_S, f"rank {r} failed {after:.1f} s after the kill: {outcome}"
        print(f"rank {r}: {outcome['error']} {after:.1f} s after the kill: {outcome['message'][:120]!r}")


class _Ballast:
    pass


def _raising_mid_transfer(rank, world, port, outdir, uri, root, cfg):
    """As :func:`_killed_mid_transfer`, but rank 0 raises as it posts its send and lives on: only
    the transfers' watch key (in the group's store) tells rank 2, which waits for its object."""
    from pathlib import Path

    from killed_rank import write_atomically

    joined(rank, world, port, outdir, GROUP_TIMEOUT_S)
    c = _ctx(rank, world, uri, root, cfg)
    if rank == 0:
        def failing_send(*args, **kwargs):
            write_atomically(Path(outdir, "killed"), str(time.time()).encode())  # when it failed
            raise RuntimeError("the send failed")

        dist.isend = failing_send
        # ranks forked from one parent can share heap addresses; torchrun's ranks do not
        ballast = [_Ballast() for _ in range(20000)]  # noqa: F841 - rank 0's heap differs, as theirs would
    report(outdir, rank, c.load(c.manager(replicas=0)))
    stay()


def test_a_rank_raising_mid_transfer_ends_every_rank_s_restore_within_seconds(s3_config, bucket, tmp_path):
    """Before, each rank's transfers watched a key of its own (it held ``id()`` of an object):
    rank 2 never heard that rank 0 broke and waited for the group's timeout."""
    uri, root = f"s3://{bucket}/run", str(tmp_path / "local")
    run_jobs(tmp_path / "setup", Job("setup", _setup, 4, (uri, root, s3_config)))
    with KilledJob(_raising_mid_transfer, 4, tmp_path / "raising", (uri, root, s3_config)) as job:
        results, logs = job.survivors([0, 1, 2, 3], BOUND_S)
    assert sorted(results) == [0, 1, 2, 3], f"ranks still waiting {BOUND_S} s after rank 0 failed\n{logs}"
    for r, (outcome, after) in results.items():  # rank 0's own error, heard through the store
        assert "the send failed" in outcome.get("message", "") and after < BOUND_S, (r, outcome, after)


# ---------------------------------------------------------------------------------------------
# a job whose group carries no CPU tensors (NCCL's), played on gloo


_COLLECTIVES = ("all_gather", "all_reduce", "broadcast", "isend", "irecv", "send", "recv")


def _no_cpu_tensors_on_the_jobs_group(rank, world, uri, root, cfg):
    """Every collective s3dcp itself issues with a CPU tensor on the job's group (here the default
    one) raises, as NCCL's does ("No backend type associated with device type cpu"); DCP's own,
    and the *_object collectives (which NCCL carries on the GPU), go through."""
    import sys

    c = _ctx(rank, world, uri, root, cfg)
    refused = []

    def refusing(name, real):
        def call(*args, **kwargs):
            group = kwargs.get("group")
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("s3dcp.") and (group is None or group is dist.group.WORLD):
                refused.append(f"{caller}: {name}")
                raise RuntimeError(f"No backend type associated with device type cpu ({name} from {caller})")
            return real(*args, **kwargs)
        return call

    for name in _COLLECTIVES:
        setattr(dist, name, refusing(name, getattr(dist, name)))
    out = c.load(c.manager(replicas=0))
    out["refused"] = refused
    return out


def test_a_job_whose_group_carries_no_cpu_tensors_restores_from_the_nodes(s3_config, bucket, tmp_path):
    """Before, the restore's survey, broadcasts and peer transfers ran on the job's group with CPU
    tensors: under NCCL every restore from the nodes failed at its first step. They run on the
    tier's own gloo group now."""
    uri, root = f"s3://{bucket}/run", str(tmp_path / "local")
    run_jobs(tmp_path / "setup", Job("setup", _setup, 4, (uri, root, s3_config)))
    job = Job("nccl-like", _no_cpu_tensors_on_the_jobs_group, 4, (uri, root, s3_config))
    run_jobs(tmp_path / "nccl-like", job)
    for r, out in enumerate(job.results):
        assert out.get("step") == 20 and out["equal"] and not out["refused"], (r, out)
    assert {out["stats"]["tier"] for out in job.results} == {"peer"}, job.results  # transfers ran


# ---------------------------------------------------------------------------------------------
# a local commit that fails on one rank


def _failing_commit(rank, world, uri, root, cfg):
    from s3dcp.saving import local_copy

    c = _ctx(rank, world, uri, root, cfg)
    real, full = local_copy.write_private, [rank == 1]

    def no_room_for_its_metadata(path, data):  # rank 1's own copy only (not the replicas it receives)
        if full[0] and path.name == ".metadata" and path.parent.name == "rank-1":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, data)

    local_copy.write_private = no_room_for_its_metadata
    m = c.manager(replicas=1)
    began = time.monotonic()
    saves = c.save(m, (10, 20), "x")  # 10: to S3 (the first); 20: on the nodes only
    full[0] = False
    saves += c.save(m, (30,), "x")  # after a failed step: to S3, whatever s3_every says
    m.close()  # nothing left waiting: replication included
    out = {"saves": saves, "s": time.monotonic() - began, "load": c.load(c.manager(replicas=1))}
    out["held20"] = sorted(p.name for p in (c.dir() / "step-00000020").glob("*")) if (
        c.dir() / "step-00000020").exists() else []
    return out


def test_a_local_commit_failing_on_one_rank_is_the_same_outcome_on_every_rank(s3_config, bucket, tmp_path):
    uri, root = f"s3://{bucket}/run", str(tmp_path / "local")
    job = Job("commit", _failing_commit, 4, (uri, root, s3_config))
    run_jobs(tmp_path / "out", job)
    for r in job.results:
        ten, twenty, thirty = r["saves"]
        assert ten["stored_in"] == ["s3"] and "rank 1" in ten["local_error"] and "No space" in ten["local_error"], ten
        assert twenty["error"] == "LocalCopyError" and "rank 1" in twenty["message"], twenty
        assert thirty == {"step": 30, "stored_in": ["s3", "local"], "local_error": None, "s3_error": None}, thirty
        assert r["held20"] == [], r["held20"]  # dropped on every node: nobody counts it
        assert r["load"]["step"] == 30 and r["load"]["equal"], r["load"]
        assert r["s"] < 60, r["s"]


# ---------------------------------------------------------------------------------------------
# a rank killed while writing its copy; the job back on another world size


def _killed_writing(rank, world, port, outdir, uri, root, cfg):
    joined(rank, world, port, outdir, 20)
    c = _ctx(rank, world, uri, root, cfg)
    m = c.manager(replicas=0)
    c.save(m, (10, 20), "x")
    if rank == 3:  # dies after the first object of its copy of step 30 is written
        from s3dcp.saving import local_copy

        real = local_copy.LocalCopy.write

        def write_then_die(self, name, buffers):
            real(self, name, buffers)
            killed(outdir)

        local_copy.LocalCopy.write = write_then_die
    report(outdir, rank, c.save(m, (30,), "x"))
    stay()


def _restart(rank, world, uri, root, cfg):
    c = _ctx(rank, world, uri, root, cfg)
    return c.load(c.manager(replicas=0))


def _back_on_two(rank, world, uri, root, cfg):
    c = _ctx(rank, world, uri, root, cfg, per_node=1)
    out = {"resharded": c.load(c.manager(replicas=1), ranks=range(4))}  # every saving rank's tensors
    m = c.manager(replicas=1)
    out["saves"] = c.save(m, (40, 50, 60), "z")
    m.close()
    out["dirs"] = sorted(f"{s.name}/{d.name}" for s in c.dir().iterdir() for d in s.iterdir())
    shutil.rmtree(c.dir()) if rank == 1 else None
    dist.barrier()
    out["lost"] = c.load(c.manager(replicas=1))  # the replicas node 0 holds
    return out


def test_a_rank_killed_writing_its_copy_and_a_job_back_on_another_world_size(s3_config, bucket, tmp_path):
    uri, root = f"s3://{bucket}/run", str(tmp_path / "local")
    with KilledJob(_killed_writing, 4, tmp_path / "crash", (uri, root, s3_config)) as job:
        job.survivors([0, 1, 2], bound_s=60)  # their save of 30 fails (DCP's collectives: the group's timeout)

    after = Job("after-crash", _restart, 4, (uri, root, s3_config))
    back = Job("back-on-two", _back_on_two, 2, (uri, root, s3_config))
    run_jobs(tmp_path / "after", after)
    for r in after.results:  # 30 never selected: a rank's copy has no marker
        assert r["step"] == 20 and r["equal"] and r["stats"]["job_bytes"]["s3"] == 0, r
    run_jobs(tmp_path / "back", back)
    for r in back.results:
        assert r["resharded"]["step"] == 20 and r["resharded"]["equal"], r["resharded"]
        assert r["resharded"]["stats"]["s3_bytes"] == 0 and r["resharded"]["stats"]["peer_bytes"] > 0
        assert [s["stored_in"] for s in r["saves"]] == [["s3", "local"], ["local"], ["s3", "local"]], r["saves"]
        # steps 10-30 (and their rank-2, rank-3 copies no rank owns now) went by local_keep_last=3
        assert r["dirs"] == [f"step-000000{s}/rank-{k}" for s in (40, 50, 60) for k in (0, 1)], r["dirs"]
        assert r["lost"]["step"] == 60 and r["lost"]["equal"] and r["lost"]["stats"]["job_bytes"]["s3"] == 0
