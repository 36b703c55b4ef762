"""Checkpoints crafted by whoever can write the bucket, read by the ``s3dcp`` command: names that
would drive the terminal are shown escaped, and a ``.metadata`` whose planner paths declare a
huge list is refused before a download builds it."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time

import torch

import s3dcp
from s3dcp import S3StorageReader
from s3dcp.format.metadata import decode_metadata, encode_metadata

from cli_run import run_cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# A C1 control (CSI on 8-bit terminals), a right-to-left override and a line break: characters
# S3's XML listings carry, so they can be in a key; an FQN (stored in the metadata) holds ESC too.
RUN = "run\u009b2J\u202eevil\nOK: fake"
FQN, NOTE = "w\x1b[2J\x1b[31mred\nfake", "n\x1b]0;title\x07"


def _printable(text: str) -> bool:
    return all(line.isprintable() for line in text.splitlines())


def test_names_from_storage_reach_the_terminal_escaped(capsys, bucket, s3_config, boto3_client, tmp_path):
    """Before: ls printed the run's name raw (its line break made a line of its own), inspect
    and verify the FQNs (ESC [2J clears the screen), gc the keys, and an error the key it failed on."""
    uri = f"s3://{bucket}/{RUN}/step-1"
    s3dcp.save({FQN: torch.arange(1000, dtype=torch.float32), NOTE: io.BytesIO(b"x" * 100)}, uri, config=s3_config)
    data_key = next(o["Key"] for o in boto3_client.list_objects_v2(Bucket=bucket)["Contents"]
                    if o["Key"].endswith(".distcp"))
    orphan = f"{RUN}/step-2/__0_0.aaaaaaaaaaaa.distcp"  # an unreferenced object gc reports
    boto3_client.put_object(Bucket=bucket, Key=orphan, Body=b"left over")

    code, out, err = run_cli(capsys, "ls", f"s3://{bucket}/")
    assert code == 0 and _printable(out) and _printable(err), out
    assert f"s3://{bucket}/run\\x9b2J\\u202eevil\\nOK: fake/  (2 checkpoint(s)" in out

    code, out, _ = run_cli(capsys, "inspect", uri)
    assert code == 0 and _printable(out), out
    assert "w\\x1b[2J\\x1b[31mred\\nfake  float32" in out and "n\\x1b]0;title\\x07" in out

    raw = bytearray(boto3_client.get_object(Bucket=bucket, Key=data_key)["Body"].read())
    raw[0] ^= 0xFF  # the first item's first byte
    boto3_client.put_object(Bucket=bucket, Key=data_key, Body=bytes(raw))
    code, out, err = run_cli(capsys, "verify", uri)
    assert code == 1 and _printable(out) and _printable(err), out
    (bad,) = [line for line in out.splitlines() if line.startswith("BAD ")]
    assert bad.startswith(("BAD w\\x1b[2J\\x1b[31mred\\nfake in ", "BAD n\\x1b]0;title\\x07 in ")), bad

    code, out, _ = run_cli(capsys, "gc", f"s3://{bucket}/", "--older-than", "1h")
    assert code == 0 and _printable(out), out
    assert f"skipped: s3://{bucket}/run\\x9b2J\\u202eevil\\nOK: fake/step-2/ (1 object(s))" in out
    time.sleep(1.1)  # S3 times have one-second resolution
    code, out, _ = run_cli(capsys, "gc", f"s3://{bucket}/", "--older-than", "0s", "--dry-run")
    assert code == 0 and _printable(out), out
    assert f"would delete: s3://{bucket}/run\\x9b2J\\u202eevil\\nOK: fake/step-2/__0_0.aaaaaaaaaaaa.distcp" in out

    code, out, _ = run_cli(capsys, "ls", "--json", f"s3://{bucket}/")  # JSON escapes them itself
    assert code == 0 and out.isascii() and json.loads(out)[0]["name"] == f"{RUN}/step-1"

    boto3_client.delete_object(Bucket=bucket, Key=data_key)  # an error's text names the stored key
    code, out, err = run_cli(capsys, "download", uri, "--to-torch-save", str(tmp_path / "w.pt"))
    assert code == 1 and _printable(err) and "run\\x9b2J\\u202eevil OK: fake/step-1/__" in err, err


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
    until the list was that long: MemoryError after 3 min under this 4 GiB cap (11.5 s under
    2 GB in the issue), unbounded without one. Now the decode refuses it, naming the entry; the
    honest checkpoint downloads under the same cap."""
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
    assert "metadata.planner_data['groups.1.lr']: declares 99999999999 list items (index 100000000000 at " \
           "('groups',), past the 2 entries that use that list), more than a metadata object of" in done.stderr, \
        done.stderr
    assert time.monotonic() - started < 120 and not (tmp_path / "crafted.pt").exists()


def test_a_list_index_past_its_entries_that_dcp_writes_still_decodes(capsys, bucket, s3_config):
    """DCP flattens {"l": [{}, {}, t]} to the one path ("l", 2): an index past the one entry
    that uses the list. It costs list items, not a refusal: s3dcp reads the metadata it wrote.
    (DCP itself cannot load this shape back, torch 2.13: "Missing key in checkpoint state_dict:
    l.0", with or without s3dcp.)"""
    uri = f"s3://{bucket}/run/step-2"
    s3dcp.save({"l": [{}, {}, torch.arange(3)]}, uri, config=s3_config)
    code, out, err = run_cli(capsys, "inspect", uri)
    assert code == 0 and "l.2" in out, err
    assert S3StorageReader(uri, config=s3_config).read_metadata().planner_data == {"l.2": ("l", 2)}
