"""Checkpoints crafted by whoever can write the bucket, read by the ``s3dcp`` command: a
``.metadata`` whose planner paths declare a huge list is refused before a download builds it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import torch

import s3dcp
from s3dcp.format.metadata import decode_metadata, encode_metadata

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# A download in a process of its own under this cap on its address space: what a regression
# would try to allocate fails there, not on the machine that runs the suite.
_CAPPED = ("import resource, runpy, sys\n"
           "cap = int(sys.argv.pop(1))\n"
           "resource.setrlimit(resource.RLIMIT_AS, (cap, cap))\n"
           "sys.argv[0] = 's3dcp'\n"
           "runpy.run_module('s3dcp.cli', run_name='__main__', alter_sys=True)\n")
_CAP_BYTES = 4 << 30


def _download(uri: str, out: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-c", _CAPPED, str(_CAP_BYTES), "download", uri, "--to-torch-save", out],
                          capture_output=True, text=True, env=env, timeout=300)


def test_download_refuses_a_planner_path_into_a_list_past_its_entries(bucket, s3_config, boto3_client, tmp_path):
    """Issue 42, row 6: the checkpoint's own .metadata, one planner_data path changed to hold
    the list index 10^11 (a 2.8 KB object). Before: DCP's empty-state-dict planner appended None
    until the list was that long: MemoryError after 11.5 s under a 2 GB cap, unbounded without
    one. Now the decode refuses it, naming the entry; the honest checkpoint downloads under the
    same cap."""
    uri = f"s3://{bucket}/run/step-1"
    state = {"model": {"w": torch.ones(4)}, "groups": [{"lr": torch.tensor(0.1)}, {"lr": torch.tensor(0.2)}]}
    s3dcp.save(state, uri, config=s3_config)
    done = _download(uri, str(tmp_path / "honest.pt"))
    assert done.returncode == 0, done.stderr
    assert torch.equal(torch.load(tmp_path / "honest.pt")["groups"][1]["lr"], torch.tensor(0.2))

    key = "run/step-1/.metadata"
    md = decode_metadata(boto3_client.get_object(Bucket=bucket, Key=key)["Body"].read())
    assert md.planner_data["groups.1.lr"] == ("groups", 1, "lr")
    md.planner_data["groups.1.lr"] = ("groups", 10**11, "lr")
    crafted = encode_metadata(md)
    assert len(crafted) < 4_000
    boto3_client.put_object(Bucket=bucket, Key=key, Body=crafted)

    started = time.monotonic()
    done = _download(uri, str(tmp_path / "crafted.pt"))
    assert done.returncode == 1, done.stderr
    assert "metadata.planner_data['groups.1.lr']: list index 100000000000 at ('groups',) is past the 2 entries " \
           "that use that list" in done.stderr, done.stderr
    assert time.monotonic() - started < 120 and not (tmp_path / "crafted.pt").exists()
