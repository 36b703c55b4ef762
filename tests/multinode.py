"""Two nodes on one machine: ``torchrun --nnodes 2 --nproc-per-node N`` started twice, meeting
through a c10d rendezvous on loopback, so ranks see ``GROUP_RANK`` 0 and 1 and ``LOCAL_RANK``
0..N-1 as on two real nodes (s3dcp's cooperative reads spread their GETs over nodes by it).

    run_two_nodes(script, args, nproc_per_node=4, outdir=..., env=server.env())
      ├─ torchrun (node 0, hosts the rendezvous store)  ─┐
      └─ torchrun (node 1)                               ├─ script on 2 × N ranks (gloo)
    each rank writes outdir/rank<RANK>.json; the call returns them in rank order, or fails
    with every node's log tail. At the deadline (or when one node failed and the other does not
    follow) both agents and their ranks are ended, so a hung collective fails instead of hanging.

Used by the tests (small states) and by ``benchmarks/restore.py``. A job script reads
:func:`job_env` for where it runs and calls :func:`write_result` once per rank.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psutil

__all__ = ["run_two_nodes", "job_env", "write_result", "NodesFailed"]


class NodesFailed(RuntimeError):
    """A node's torchrun failed or ran past its deadline (the message has both logs' tails)."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_nodes(script: str | os.PathLike, args: list[str], *, outdir: str | os.PathLike, nproc_per_node: int = 4,
                  env: dict[str, str] | None = None, timeout_s: float = 240.0) -> list[dict]:
    """Run ``script args`` on 2 × ``nproc_per_node`` ranks as two simulated nodes; the ranks'
    results (see the module docstring)."""
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    run_id = uuid.uuid4().hex[:12]
    base_env = {**os.environ, **(env or {}), "S3DCP_JOB_OUT": str(outdir), "OMP_NUM_THREADS": "1"}
    root = str(Path(__file__).resolve().parent.parent)
    base_env["PYTHONPATH"] = os.pathsep.join([root, str(Path(__file__).resolve().parent),
                                              base_env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    procs: list[subprocess.Popen] = []
    logs = [outdir / f"node{n}.log" for n in range(2)]
    try:
        for node in range(2):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                   "--nproc-per-node", str(nproc_per_node), "--rdzv-backend", "c10d",
                   "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
                   "--rdzv-conf", f"is_host={'true' if node == 0 else 'false'}",
                   "--max-restarts", "0", "--monitor-interval", "0.2", str(script), *args]
            with open(logs[node], "w") as log:
                procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=base_env,
                                              start_new_session=True))
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                raise NodesFailed(f"two-node job ran past {timeout_s:.0f} s\n" + _tails(logs))
            if any(p.returncode not in (None, 0) for p in procs):  # one node failed: give the other a moment
                end = time.monotonic() + 15
                while any(p.poll() is None for p in procs) and time.monotonic() < end:
                    time.sleep(0.1)
                break
            time.sleep(0.1)
    finally:
        _stop(procs)
    codes = [p.returncode for p in procs]
    if codes != [0, 0]:
        raise NodesFailed(f"two-node job failed (exit codes {codes})\n" + _tails(logs))
    results = []
    for rank in range(2 * nproc_per_node):
        path = outdir / f"rank{rank}.json"
        if not path.exists():
            raise NodesFailed(f"rank {rank} wrote no result\n" + _tails(logs))
        results.append(json.loads(path.read_text()))
    return results


def _stop(procs: list[subprocess.Popen]) -> None:
    """End the agents still running and their ranks (torchrun starts each rank in a session of
    its own, so they are found as the agent's descendants, by pid): SIGTERM first, so the agent
    stops its ranks itself, then SIGKILL for whatever is left."""
    alive = [p for p in procs if p.poll() is None]
    if not alive:
        return
    ranks = []
    for p in alive:
        try:
            ranks += psutil.Process(p.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            pass
        p.send_signal(signal.SIGTERM)
    _, left = psutil.wait_procs(ranks, timeout=10)
    for proc in left:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    for p in alive:
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(5)


def _tails(logs: list[Path], lines: int = 150) -> str:
    out = []
    for log in logs:
        try:
            text = log.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            text = []
        out.append(f"---- {log.name} (last {len(text)} lines)\n" + "\n".join(text))
    return "\n".join(out)


def job_env() -> dict[str, Any]:
    """Where this rank of a two-node job runs: rank, world, node (GROUP_RANK), local rank."""
    return {"rank": int(os.environ["RANK"]), "world": int(os.environ["WORLD_SIZE"]),
            "node": int(os.environ["GROUP_RANK"]), "local_rank": int(os.environ["LOCAL_RANK"]),
            "local_world": int(os.environ["LOCAL_WORLD_SIZE"])}


def write_result(result: dict) -> None:
    """This rank's result (JSON), for :func:`run_two_nodes` to return."""
    out = Path(os.environ["S3DCP_JOB_OUT"]) / f"rank{os.environ['RANK']}.json"
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.rename(out)
