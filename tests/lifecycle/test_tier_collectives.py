"""A restore's steps that run on some ranks only, failing on one rank: every rank raises within
a second (the failing rank its own error, the others PeerReadError naming it), none is left
waiting in the next collective, and the group is still usable."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from test_multiprocess import Job, run_jobs

pytestmark = pytest.mark.multiproc


def _outcome(call) -> tuple:
    begin = time.monotonic()
    try:
        return ("ok", call(), time.monotonic() - begin)
    except Exception as e:  # noqa: BLE001 - the outcome is the test's subject
        return (type(e).__name__, str(e), time.monotonic() - begin)


def _worker(rank: int, world: int, directory: str) -> dict:
    from pathlib import Path

    import torch
    import torch.distributed as dist

    from s3dcp.lifecycle.restore import _Job
    from s3dcp.loading.tiered import TieredReader, Transfers

    out = {}

    def survey():  # e.g. rank 1's local_dir unreadable, or its S3 listing refused
        if rank == 1:
            raise OSError("local_dir is not readable")
        return rank

    out["together"] = _outcome(lambda: _Job(None, True).together(survey))
    out["together_ok"] = _outcome(lambda: _Job(None, True).together(lambda: rank * 2))

    received = {}
    reader = SimpleNamespace(process_group=None, transfer_group=None,
                             client=SimpleNamespace(add_received=received.__setitem__),
                             local_paths={"obj": Path(directory) / "obj"}, watch_key="s3dcp/test/broken")
    send = Transfers(send=(("obj", 1000, 1),), agree=True)
    receive = Transfers(receive=(("obj", 1000, 0),), agree=True)
    mine = send if rank == 0 else receive
    # rank 0's file is gone (deleted since the scan): no send is posted, rank 1 posts no receive
    out["transfer_missing"] = _outcome(lambda: TieredReader._transfer(reader, mine))
    dist.barrier()
    if rank == 0:
        (Path(directory) / "obj").write_bytes(bytes(range(200)) * 5)
    dist.barrier()
    out["transfer"] = _outcome(lambda: TieredReader._transfer(reader, mine))
    out["received"] = bytes(received["obj"].numpy()) == bytes(range(200)) * 5 if rank == 1 else None
    dist.barrier()  # the group is still usable
    out["usable"] = int(torch.ones(1).sum())
    return out


def test_a_failure_on_one_rank_reaches_every_rank_at_once(tmp_path):
    job = Job("tier-collectives", _worker, 2, (str(tmp_path),))
    run_jobs(tmp_path / "out", job)
    zero, one = job.results
    assert one["together"][:2] == ("OSError", "local_dir is not readable")
    assert zero["together"][0] == "PeerReadError" and "rank 1 failed: OSError: local_dir is not readable" in \
        zero["together"][1]
    assert zero["together_ok"][:2] == ("ok", [0, 2]) and one["together_ok"][:2] == ("ok", [0, 2])
    assert zero["transfer_missing"][0] == "RuntimeError" and "obj" in zero["transfer_missing"][1]  # torch's, naming it
    assert one["transfer_missing"][0] == "PeerReadError" and "rank 0 could not prepare" in one["transfer_missing"][1]
    assert all(r[key][2] < 5.0 for r in (zero, one) for key in ("together", "transfer_missing")), (zero, one)
    assert zero["transfer"][0] == one["transfer"][0] == "ok" and one["received"] is True
