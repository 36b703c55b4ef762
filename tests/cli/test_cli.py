"""The ``s3dcp`` command against the real server, mostly in-process through ``cli.main``."""

from __future__ import annotations

import datetime
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

from s3dcp import S3StorageWriter, __version__
from s3dcp.cli.parser import parse_duration
from s3dcp.config import MiB

from cli_run import run_cli
from processes import interruptible

BIN = os.path.join(os.path.dirname(sys.executable), "s3dcp")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLI = [sys.executable, "-m", "s3dcp.cli"]  # this checkout's CLI, whichever s3dcp the venv installed


def _cli_env(**extra):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    env.update(extra)
    return env




def _save(uri, state, config):
    dcp.save(state, storage_writer=S3StorageWriter(uri, config=config))


def _state():
    gen = torch.Generator().manual_seed(0)
    return {
        "model": {"w": torch.randn(64, 32, generator=gen), "b": torch.randn(32, generator=gen).to(torch.bfloat16)},
        "big": torch.randn(5 * MiB, generator=gen),  # 20 MiB: two checksum blocks
        "step": 7,
        "extra": {"name": "run-1", "lrs": [0.1, 0.01]},
    }


def _keys(boto3_client, bucket, prefix=""):
    return sorted(o["Key"] for o in boto3_client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", []))


def _flip(boto3_client, bucket, key, offset):
    body = bytearray(boto3_client.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[offset] ^= 0xFF
    boto3_client.put_object(Bucket=bucket, Key=key, Body=bytes(body))


@pytest.fixture
def run_dir(bucket, s3_config, boto3_client):
    """Two committed checkpoints, one incomplete one and a file that is not a checkpoint."""
    _save(f"s3://{bucket}/run/step-10", {"w": torch.ones(10)}, s3_config)
    _save(f"s3://{bucket}/run/step-20", {"w": torch.ones(1000)}, s3_config)
    boto3_client.put_object(Bucket=bucket, Key="run/step-30/__0_0.aaaaaaaaaaaa.distcp", Body=b"x" * 10)
    boto3_client.put_object(Bucket=bucket, Key="run/notes.txt", Body=b"hello")
    return f"s3://{bucket}/run"


# ------------------------------------------------------------------------------ basics
def test_help_version_and_usage_errors(capsys):
    assert subprocess.run([BIN, "--help"], capture_output=True, text=True).returncode == 0  # the console script
    for command in ("ls", "inspect", "verify", "rm", "gc", "download", "mb", "server"):
        code, out, _ = run_cli(capsys, command, "--help")
        assert code == 0 and out.startswith(f"usage: s3dcp {command}"), command
    code, out, _ = run_cli(capsys, "--version")
    assert code == 0 and out.strip() == f"s3dcp {__version__}"
    assert run_cli(capsys)[0] == 2
    assert run_cli(capsys, "frobnicate")[0] == 2
    code, _, err = run_cli(capsys, "ls", "s3://Not_A_Bucket/x")
    assert code == 2 and err.startswith("s3dcp: error:") and "not a valid bucket name" in err
    code, _, err = run_cli(capsys, "gc", "s3://bucket/x", "--older-than", "soon")
    assert code == 2 and "invalid duration" in err


def test_light_commands_do_not_import_torch(run_dir, bucket):
    code = ("import sys; from s3dcp import cli; "
            f"codes = [cli.main(a) for a in (['--version'], ['ls', '{run_dir}'], ['rm', '{run_dir}/step-30'])]; "
            "print(codes, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip().splitlines()[-1] == "[0, 0, 0] False", done.stdout + done.stderr


def test_durations():
    assert [parse_duration(t) for t in ("30s", "10m", "1h", "2d", "1w", "90", "1h30m", "1.5h")] == \
        [30, 600, 3600, 172800, 604800, 90, 5400, 5400]
    for bad in ("", "h", "1x", "1h 30", "-1s"):
        with pytest.raises(ValueError):
            parse_duration(bad)


def test_missing_bucket_is_one_clear_line(capsys):
    code, out, err = run_cli(capsys, "ls", "s3://no-such-bucket-xyz/run")
    assert code == 1 and out == ""
    assert err.startswith("s3dcp: error:") and "no-such-bucket-xyz" in err and "bucket does not exist" in err
    assert err.count("\n") == 1 and "Traceback" not in err
    code, _, err = run_cli(capsys, "--debug", "inspect", "s3://no-such-bucket-xyz/run")
    assert code == 1 and "Traceback" in err and err.rstrip().splitlines()[-1].startswith("s3dcp: error:")


def test_endpoint_option_overrides_the_environment(capsys, run_dir, s3_server, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")  # nothing listens there
    assert run_cli(capsys, "--endpoint-url", s3_server.endpoint_url, "ls", run_dir)[0] == 0
    assert run_cli(capsys, "ls", run_dir, "--endpoint-url", s3_server.endpoint_url, "--region", "us-east-1")[0] == 0


# ------------------------------------------------------------------------------ ls
def test_ls(capsys, run_dir):
    code, out, _ = run_cli(capsys, "ls", run_dir + "/")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["NAME", "STEP", "SIZE", "OBJECTS", "STATE", "AGE"]
    assert [line.split()[0] for line in lines[1:]] == ["step-10", "step-20", "step-30"]
    assert [line.split()[-2] for line in lines[1:]] == ["committed", "committed", "INCOMPLETE"]

    code, out, _ = run_cli(capsys, "ls", "--json", run_dir)
    rows = json.loads(out)
    assert [(r["name"], r["step"], r["committed"], r["objects"]) for r in rows] == \
        [("step-10", 10, True, 2), ("step-20", 20, True, 2), ("step-30", 30, False, 1)]
    assert rows[2]["bytes"] == 10 and rows[1]["bytes"] > 4000 and rows[0]["uri"] == f"{run_dir}/step-10"
    assert all(r["age_s"] is not None and r["age_s"] < 600 for r in rows)

    assert {r["run"] for r in rows} == {run_dir}

    code, out, err = run_cli(capsys, "ls", run_dir + "/nothing-here")
    assert code == 0 and out == "" and "no checkpoints under" in err
    assert json.loads(run_cli(capsys, "ls", "--json", run_dir + "/nothing-here")[1]) == []


def test_ls_of_a_bucket_groups_checkpoints_by_run(capsys, bucket, s3_config):
    for name in ("a/step-1", "a/step-2", "b/x/step-5"):
        _save(f"s3://{bucket}/{name}", {"w": torch.ones(4)}, s3_config)
    code, out, _ = run_cli(capsys, "ls", f"s3://{bucket}")
    assert code == 0
    blocks = [b.splitlines() for b in out.strip().split("\n\n")]
    assert [b[0].split()[0] for b in blocks] == [f"s3://{bucket}/a/", f"s3://{bucket}/b/x/"]
    assert "latest in S3: step 2" in blocks[0][0]
    assert [line.split()[0] for line in blocks[0][2:]] == ["step-1", "step-2"]
    assert [line.split()[0] for line in blocks[1][2:]] == ["step-5"]
    rows = json.loads(run_cli(capsys, "ls", "--json", f"s3://{bucket}")[1])
    assert [(r["run"], r["name"]) for r in rows] == [
        (f"s3://{bucket}/a", "a/step-1"), (f"s3://{bucket}/a", "a/step-2"), (f"s3://{bucket}/b/x", "b/x/step-5")]


def test_ls_shows_what_is_stored_for_a_removed_base_and_who_holds_it(capsys, bucket, s3_config):
    """After ``rm`` of an incremental checkpoint's base, its kept objects are a row of their own
    (they used to vanish from ls while still stored, and paid for)."""
    import s3dcp

    run_uri = f"s3://{bucket}/run"
    state = {"frozen": torch.arange(300_000, dtype=torch.float32), "head": torch.zeros(4)}
    s3dcp.save(state, f"{run_uri}/step-1", config=s3_config, item_checksum="crc64nvme")
    state["head"] += 1
    s3dcp.save(state, f"{run_uri}/step-2", config=s3_config, incremental_from=f"{run_uri}/step-1")
    code, out, _ = run_cli(capsys, "rm", "--yes", f"{run_uri}/step-1")
    assert code == 0 and "that other checkpoints reference" in out
    code, out, _ = run_cli(capsys, "ls", run_uri)
    assert code == 0
    rows = {line.split()[0]: line for line in out.splitlines()[1:] if not line.startswith("#")}
    assert set(rows) == {"step-1", "step-2"}, out
    assert "kept for step-2" in rows["step-1"] and "1.1 MiB" in rows["step-1"]
    assert "# step-1: deleted; its 1 object(s) (1.1 MiB) stay while step-2 reference them" in out
    by_name = {r["name"]: r for r in json.loads(run_cli(capsys, "ls", "--json", run_uri)[1])}
    assert by_name["step-1"]["state"] == "kept_for_references" and by_name["step-1"]["committed"] is False
    assert by_name["step-1"]["held_by"] == [f"{run_uri}/step-2"] and by_name["step-1"]["bytes"] >= 1_200_000
    assert by_name["step-2"]["state"] == "committed" and by_name["step-2"]["held_by"] == []


def test_ls_shows_unfinished_multipart_uploads(capsys, run_dir, bucket, boto3_client):
    """A save killed mid-upload leaves multipart uploads and maybe no object: ls shows them."""
    key = "run/step-40/__0_0.bbbbbbbbbbbb.distcp"
    upload_id = boto3_client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    boto3_client.upload_part(Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=1, Body=b"y" * (5 << 20))
    try:
        code, out, _ = run_cli(capsys, "ls", run_dir)
        assert code == 0
        row = next(line for line in out.splitlines() if line.startswith("step-40"))
        assert row.split()[2:5] == ["5.0", "MiB", "0"] and "INCOMPLETE, 1 unfinished upload(s)" in row, out
        assert f"# 1 unfinished multipart upload(s), counted in SIZE: their parts (5.0 MiB) are stored (and " \
               f"billed) until aborted; s3dcp gc {run_dir}/ aborts" in out
        by_name = {r["name"]: r for r in json.loads(run_cli(capsys, "ls", "--json", run_dir)[1])}
        assert by_name["step-40"]["state"] == "incomplete"
        assert [(u["key"], u["upload_id"], u["parts"], u["bytes"]) for u in by_name["step-40"]["uploads"]] == \
            [(key, upload_id, 1, 5 << 20)]
        assert by_name["step-40"]["bytes"] == 5 << 20
        assert by_name["step-10"]["uploads"] == []
    finally:
        boto3_client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)


def test_ls_without_permission_to_list_uploads_still_lists_checkpoints(capsys, run_dir, s3_server):
    from urllib.parse import urlsplit

    from fault_proxy import FaultProxy, Rule

    u = urlsplit(s3_server.endpoint_url)
    with FaultProxy(u.hostname, u.port) as proxy:
        proxy.add_rule(Rule("error", method="GET", query_has="uploads", status=403, code="AccessDenied"))
        code, out, err = run_cli(capsys, "ls", run_dir, "--endpoint-url", proxy.endpoint_url)
    assert code == 0 and [line.split()[0] for line in out.splitlines()[1:]] == ["step-10", "step-20", "step-30"]
    assert f"unfinished multipart uploads under {run_dir} not listed" in err and "AccessDenied" in err


def _put_dcp_pickled_metadata(boto3_client, bucket: str, key: str) -> None:
    """A ``.metadata`` as DCP's FileSystemWriter / fsspec writer make it: a pickle."""
    import pickle

    from torch.distributed.checkpoint.metadata import Metadata

    boto3_client.put_object(Bucket=bucket, Key=key, Body=pickle.dumps(Metadata(state_dict_metadata={})))


def test_ls_and_gc_say_when_a_run_holds_foreign_metadata(capsys, run_dir, bucket, boto3_client):
    _put_dcp_pickled_metadata(boto3_client, bucket, "run/dcp-7/.metadata")
    boto3_client.put_object(Bucket=bucket, Key="run/dcp-7/__0_0.distcp", Body=b"z" * 10)
    code, out, _ = run_cli(capsys, "ls", run_dir)
    assert code == 0
    row = next(line for line in out.splitlines() if line.startswith("dcp-7"))
    assert "not s3dcp's" in row
    assert f"# dcp-7: its .metadata is not s3dcp's (DCP's own pickle, say): s3dcp cannot load it, and rm, gc and " \
           f"retention delete nothing under {run_dir}/ that it might reference" in out
    by_name = {r["name"]: r for r in json.loads(run_cli(capsys, "ls", "--json", run_dir)[1])}
    assert by_name["dcp-7"]["state"] == "foreign" and by_name["step-10"]["state"] == "committed"
    # gc: data stays safe, and the output (not only a log line) says why
    before = _keys(boto3_client, bucket)
    code, out, _ = run_cli(capsys, "gc", run_dir, "--older-than", "0s")
    assert code == 0 and _keys(boto3_client, bucket) == before  # step-30's leftover too: what dcp-7 uses is unknown
    assert f"skipped: s3://{bucket}/run/dcp-7/ (metadata): its .metadata is not s3dcp metadata" in out
    assert f"nothing under s3://{bucket}/run/ is deleted" in out
    assert out.rstrip().endswith("1 .metadata not s3dcp's or unreadable: nothing under its run deleted")
    # rm of an s3dcp checkpoint there: its metadata goes, its data stays, and rm says why
    code, out, _ = run_cli(capsys, "rm", "--yes", f"{run_dir}/step-20")
    assert code == 0 and "kept its 1 data object(s)" in out, out
    assert f"s3://{bucket}/run/dcp-7/.metadata is not s3dcp metadata" in out and "other checkpoints" not in out
    assert len(_keys(boto3_client, bucket, "run/step-20/")) == 1


# ------------------------------------------------------------------------------ inspect
def test_inspect(capsys, bucket, s3_config):
    uri = f"s3://{bucket}/run/step-1000"
    _save(uri, _state(), s3_config)
    code, out, _ = run_cli(capsys, "inspect", "--json", uri)
    assert code == 0
    report = json.loads(out)
    assert report["format"] == "s3dcp-metadata" and report["format_version"] == 2
    tensors = {t["fqn"]: t for t in report["tensors"]}
    assert tensors["model.w"] == {"fqn": "model.w", "dtype": "float32", "shape": [64, 32], "chunks": 1,
                                  "bytes": 64 * 32 * 4}
    assert tensors["model.b"]["dtype"] == "bfloat16" and tensors["model.b"]["bytes"] == 64
    assert tensors["big"]["bytes"] == 20 * MiB
    others = {o["fqn"]: o["bytes"] for o in report["non_tensors"]}
    assert set(others) == {"step", "extra.name", "extra.lrs"} and all(b > 0 for b in others.values())
    assert report["objects"] and all(o["rank"] == 0 and o["object"].startswith("__0_") for o in report["objects"])
    assert sum(o["bytes"] for o in report["objects"]) == report["total_bytes"]
    assert report["total_bytes"] == sum(t["bytes"] for t in report["tensors"]) + sum(others.values())

    code, out, _ = run_cli(capsys, "inspect", uri)
    assert code == 0
    assert re.search(r"model\.w\s+float32\s+64x32\s+1\s+8192", out)
    assert "format s3dcp-metadata v2" in out and f"total: {report['total_bytes']} bytes" in out


def test_inspect_an_incomplete_checkpoint_fails(capsys, bucket, s3_config, boto3_client):
    uri = f"s3://{bucket}/run/step-1"
    _save(uri, {"w": torch.ones(3)}, s3_config)
    boto3_client.delete_object(Bucket=bucket, Key="run/step-1/.metadata")
    code, out, err = run_cli(capsys, "inspect", uri)
    assert code == 1 and out == "" and "is incomplete" in err and err.startswith("s3dcp: error:")
    code, _, err = run_cli(capsys, "inspect", f"s3://{bucket}/run/step-2")
    assert code == 1 and "no checkpoint at" in err


# ------------------------------------------------------------------------------ verify
def test_verify_passes_then_names_a_corrupted_item(capsys, bucket, s3_config, boto3_client):
    uri = f"s3://{bucket}/run/step-1"
    state = _state()
    _save(uri, state, s3_config)
    code, out, err = run_cli(capsys, "verify", uri)
    assert code == 0 and out.startswith("OK: 6 item(s)") and err == ""

    # flip one byte in the second 16 MiB block of "big", and one in "model.w"
    from s3dcp.loading.reader import S3StorageReader

    md = S3StorageReader(uri, config=s3_config).fetch_metadata()
    locs = {index.fqn: loc for index, loc in md.storage_data.items()}
    big, w = locs["big"], locs["model.w"]
    _flip(boto3_client, bucket, f"run/step-1/{big.object_name}", big.offset + 17 * MiB + 5)
    _flip(boto3_client, bucket, f"run/step-1/{w.object_name}", w.offset + 100)

    code, out, err = run_cli(capsys, "verify", "--quiet", uri)
    assert code == 1 and "2 bad item(s)" in err
    bad = {line.split()[1]: line for line in out.splitlines() if line.startswith("BAD ")}
    assert set(bad) == {"big", "model.w"}
    assert big.object_name in bad["big"] and f"expected {big.checksum}, got crc64nvme:" in bad["big"]
    assert "bad blocks [1]" in bad["big"]

    code, out, _ = run_cli(capsys, "verify", "--json", uri)
    report = json.loads(out)
    assert code == 1 and report["ok"] is False and report["checked_items"] == 6
    by_fqn = {b["fqn"]: b for b in report["bad"]}
    assert by_fqn["model.w"]["expected"] == w.checksum and by_fqn["model.w"]["got"] != w.checksum
    assert by_fqn["model.w"]["object"] == f"{uri}/{w.object_name}" and by_fqn["big"]["bad_blocks"] == [1]


def test_verify_reports_a_missing_object(capsys, bucket, s3_config, boto3_client):
    uri = f"s3://{bucket}/run/step-1"
    _save(uri, {"w": torch.ones(3)}, s3_config)
    data = [k for k in _keys(boto3_client, bucket) if k.endswith(".distcp")]
    boto3_client.delete_object(Bucket=bucket, Key=data[0])
    code, out, err = run_cli(capsys, "verify", uri)
    assert code == 1 and "BAD w" in out and "unreadable" in out and "1 bad item(s)" in err


# ------------------------------------------------------------------------------ rm
def test_rm(capsys, run_dir, bucket, boto3_client):
    code, _, err = run_cli(capsys, "rm", run_dir + "/step-10")
    assert code == 2 and "committed checkpoint" in err and "--yes" in err
    assert len(_keys(boto3_client, bucket, "run/step-10/")) == 2  # untouched

    code, out, _ = run_cli(capsys, "rm", "--yes", run_dir + "/step-10")
    assert code == 0 and "deleted committed checkpoint" in out
    assert _keys(boto3_client, bucket, "run/step-10/") == []

    code, out, _ = run_cli(capsys, "rm", "--json", run_dir + "/step-30")  # incomplete: no --yes needed
    assert code == 0 and json.loads(out)["deleted_objects"] == 1 and json.loads(out)["was_committed"] is False

    code, _, err = run_cli(capsys, "rm", "--yes", run_dir)  # the run itself is not a checkpoint
    assert code == 1 and "no checkpoint at" in err
    assert _keys(boto3_client, bucket) == sorted(["run/notes.txt", *_keys(boto3_client, bucket, "run/step-20/")])


# ------------------------------------------------------------------------------ gc
def test_gc_dry_run_deletes_nothing(capsys, run_dir, bucket, boto3_client):
    before = _keys(boto3_client, bucket)
    code, out, _ = run_cli(capsys, "gc", run_dir, "--older-than", "1h")
    assert code == 0 and "deleted 0 object(s)" in out
    assert "skipped 1 object(s) and 0 upload(s) of saves active in the last 1h" in out
    assert f"skipped: s3://{bucket}/run/step-30/ (1 object(s)): unreferenced data newer than --older-than 1h" in out
    report = json.loads(run_cli(capsys, "gc", "--json", run_dir, "--older-than", "1h")[1])
    assert [(s["prefix"], s["objects"]) for s in report["skipped"]] == [(f"s3://{bucket}/run/step-30/", 1)]
    assert "a save may still be writing it" in report["skipped"][0]["reason"]
    upload_id = boto3_client.create_multipart_upload(Bucket=bucket, Key="run/step-40/__0_0.bbbbbbbbbbbb.distcp")["UploadId"]
    code, out, _ = run_cli(capsys, "gc", run_dir, "--older-than", "1h")
    assert f"skipped: s3://{bucket}/run/step-40/__0_0.bbbbbbbbbbbb.distcp (upload {upload_id}): its save was active " \
           "less than --older-than 1h ago" in out
    assert "skipped 1 object(s) and 1 upload(s) of saves active" in out  # the summary counts the lines it lists
    time.sleep(1.1)  # S3 times have one-second resolution
    code, out, _ = run_cli(capsys, "gc", run_dir + "/", "--older-than", "0s", "--dry-run")
    assert code == 0 and f"would delete: s3://{bucket}/run/step-30/__0_0.aaaaaaaaaaaa.distcp" in out
    assert _keys(boto3_client, bucket) == before
    code, out, _ = run_cli(capsys, "gc", "--json", run_dir, "--older-than", "0s")
    report = json.loads(out)
    assert code == 0 and report["deleted"] == ["run/step-30/__0_0.aaaaaaaaaaaa.distcp"] and not report["dry_run"]
    assert _keys(boto3_client, bucket) == [k for k in before if not k.startswith("run/step-30/")]


# ------------------------------------------------------------------------------ download
def _assert_same(expected, actual, path="state"):
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and actual.dtype == expected.dtype, path
        assert torch.equal(actual, expected), path
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and set(actual) == set(expected), path
        for k in expected:
            _assert_same(expected[k], actual[k], f"{path}.{k}")
    else:
        assert actual == expected, path


def test_download_to_torch_save(capsys, bucket, s3_config, tmp_path):
    uri = f"s3://{bucket}/run/step-1"
    state = _state()
    state["big"] = state["big"][:1000].clone()
    _save(uri, state, s3_config)
    out_file = tmp_path / "out.pt"
    code, out, _ = run_cli(capsys, "download", uri, "--to-torch-save", str(out_file))
    assert code == 0 and "wrote" in out
    _assert_same(state, torch.load(out_file, weights_only=True))
    assert not (tmp_path / "out.pt.partial").exists()

    code, _, err = run_cli(capsys, "download", uri, "--to-torch-save", str(out_file))
    assert code == 2 and "--force" in err
    code, out, _ = run_cli(capsys, "download", uri, "--to-torch-save", str(out_file), "--force", "--json")
    report = json.loads(out)
    assert code == 0 and report["file"] == str(out_file) and report["bytes"] == out_file.stat().st_size
    assert report["top_level_keys"] == sorted(state)
    code, _, err = run_cli(capsys, "download", f"s3://{bucket}/run/none", "--to-torch-save", str(tmp_path / "x.pt"))
    assert code == 1 and "no checkpoint at" in err and not (tmp_path / "x.pt").exists()


def test_download_unpickles_only_with_allow_pickle(capsys, bucket, s3_config, tmp_path):
    uri = f"s3://{bucket}/run/step-1"
    _save(uri, {"w": torch.ones(2), "when": datetime.timedelta(seconds=3)}, s3_config)
    out_file = tmp_path / "out.pt"
    code, _, err = run_cli(capsys, "download", uri, "--to-torch-save", str(out_file))
    assert code == 1 and "'when' holds pickled Python objects beyond plain data" in err and "--allow-pickle" in err
    assert not out_file.exists()
    assert run_cli(capsys, "download", uri, "--to-torch-save", str(out_file), "--allow-pickle")[0] == 0
    assert torch.load(out_file, weights_only=False)["when"] == datetime.timedelta(seconds=3)


# ------------------------------------------------------------------------------ server
def _read_exports(stream, lines=None) -> dict[str, str]:
    """The ``export`` lines of a server's output (up to its "# Ctrl-C" line); every line read
    is appended to ``lines`` when given."""
    exports = {}
    for line in stream:
        if lines is not None:
            lines.append(line.rstrip("\n"))
        if line.startswith("export "):
            name, _, value = line[len("export "):].strip().partition("=")
            exports[name] = value
        if line.startswith("# Ctrl-C"):
            break
    return exports


def test_server_command_runs_until_ctrl_c_and_other_shells_find_it(capsys, monkeypatch, tmp_path):
    env = _cli_env(S3DCP_STATE_DIR=str(tmp_path))
    proc = subprocess.Popen(interruptible([*CLI, "server"]), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    try:
        lines: list[str] = []
        exports = _read_exports(proc.stdout, lines)
        assert exports["AWS_ENDPOINT_URL_S3"].startswith("http://127.0.0.1:")
        assert "# bucket: s3://demo" in lines, lines
        # a second shell: eval "$(s3dcp server --print-env)" gives the same server, starts none
        other = subprocess.run([*CLI, "server", "--print-env"], capture_output=True, text=True, env=env, timeout=60)
        assert other.returncode == 0 and f"pid {proc.pid}" in other.stderr and "created now" not in other.stderr
        assert _read_exports(other.stdout.splitlines(keepends=True)) == exports
        for name, value in exports.items():
            monkeypatch.setenv(name, value)
        code, _, err = run_cli(capsys, "ls", "s3://demo/")  # the default bucket exists
        assert code == 0 and "no checkpoints under s3://demo" in err
        # --bucket names a bucket the running server lacks: created there, not silently ignored
        more = subprocess.run([*CLI, "server", "--print-env", "--bucket", "more"], capture_output=True, text=True,
                              env=env, timeout=60)
        assert more.returncode == 0 and "created now: s3://more" in more.stderr, more.stderr
        assert "bucket(s) s3://demo, s3://more" in more.stderr
        code, _, err = run_cli(capsys, "ls", "s3://more/")
        assert code == 0 and "no checkpoints under s3://more" in err
        again = subprocess.run([*CLI, "server", "--print-env", "--bucket", "more"], capture_output=True, text=True,
                               env=env, timeout=60)
        assert again.returncode == 0 and "created now" not in again.stderr and "s3://more" in again.stderr
        assert oct((tmp_path / f"server-{proc.pid}.json").stat().st_mode & 0o777) == "0o600"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert not (tmp_path / f"server-{proc.pid}.json").exists()  # it forgot itself
    finally:
        if proc.poll() is None:  # a failed assertion: stop it the way that lets it stop its server
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_stop_never_signals_a_process_that_has_a_gone_servers_pid(capsys, monkeypatch, tmp_path):
    """A state file left by a server that is gone (a reboot, SIGKILL) whose pid now names
    another live process: that process is no server; nothing is signalled, the file is removed.
    Both with a recorded start that differs and in an earlier version's file (no start: the
    command line decides)."""
    monkeypatch.setenv("S3DCP_STATE_DIR", str(tmp_path))
    sleeper = subprocess.Popen(["sleep", "120"])
    try:
        state = {"pid": sleeper.pid, "endpoint_url": "http://127.0.0.1:9", "env": {}, "buckets": ["demo"],
                 "started_at": time.time()}
        for name, extra in (("server-1.json", {"start_mark": "another-boot:12345"}), ("server.json", {})):
            (tmp_path / name).write_text(json.dumps({**state, **extra}))
            code, _, err = run_cli(capsys, "server", "--stop", "--pid", str(sleeper.pid))
            assert code == 1 and f"no s3dcp server with pid {sleeper.pid} runs (none runs)" in err, err
            (tmp_path / name).write_text(json.dumps({**state, **extra}))
            code, _, err = run_cli(capsys, "server", "--stop", "--all")
            assert code == 0 and "no s3dcp server is running" in err, err
            assert sleeper.poll() is None  # not signalled
            assert not (tmp_path / name).exists()
    finally:
        sleeper.kill()
        sleeper.wait()


def _state_files(state_dir) -> list:
    return sorted(state_dir.glob("server-*.json"))


def test_server_print_env_starts_one_in_the_background_and_stop_ends_it(tmp_path):
    env = _cli_env(S3DCP_STATE_DIR=str(tmp_path))
    done = subprocess.run(["bash", "-c", 'eval "$("$@" server --print-env --bucket first)" && '
                                         '"$@" mb s3://second && "$@" ls s3://first/ && echo "$AWS_REGION"',
                           "_", *CLI], capture_output=True, text=True, env=env, timeout=120)
    files = _state_files(tmp_path)
    state = json.loads(files[0].read_text()) if files else None
    try:
        assert done.returncode == 0, done.stderr
        assert "created: s3://second" in done.stdout and done.stdout.rstrip().endswith("us-east-1")
        assert "no checkpoints under s3://first" in done.stderr and "s3dcp server --stop" in done.stderr
        assert len(files) == 1 and oct(files[0].stat().st_mode & 0o777) == "0o600"
        # --list asks the server: the bucket `mb` made is there too (it used to show only "first")
        listed = subprocess.run([*CLI, "server", "--list", "--json"], capture_output=True, text=True, env=env,
                                timeout=60)
        (entry,) = json.loads(listed.stdout)
        assert entry["buckets"] == ["first", "second"] and entry["buckets_from"] == "server", entry
        table = subprocess.run([*CLI, "server", "--list"], capture_output=True, text=True, env=env, timeout=60)
        assert "first,second" in table.stdout.splitlines()[1], table.stdout
    finally:
        stopped = subprocess.run([*CLI, "server", "--stop"], capture_output=True, text=True, env=env, timeout=60)
    assert state is not None and stopped.returncode == 0 and f"pid {state['pid']}" in stopped.stderr
    with pytest.raises(ProcessLookupError):
        os.kill(state["weed_pid"], 0)
    assert _state_files(tmp_path) == []
    again = subprocess.run([*CLI, "server", "--stop"], capture_output=True, text=True, env=env, timeout=60)
    assert again.returncode == 0 and "no s3dcp server is running" in again.stderr


def _stop_all(env) -> None:
    """Stop every server these tests started (by the state files of their own state directory)."""
    subprocess.run([*CLI, "server", "--stop", "--all"], capture_output=True, text=True, env=env, timeout=120)


def test_a_second_server_never_orphans_the_first(tmp_path):
    """The newcomer's afternoon: a background server, then ``s3dcp server`` in a second terminal;
    once that one stops, --print-env and --stop name the first again (it used to start a new,
    empty one, and the first could only be killed by pid)."""
    env = _cli_env(S3DCP_STATE_DIR=str(tmp_path))
    second = None
    try:
        first = subprocess.run([*CLI, "server", "--print-env"], capture_output=True, text=True, env=env, timeout=120)
        assert first.returncode == 0, first.stderr
        first_exports = _read_exports(first.stdout.splitlines(keepends=True))
        first_pid = int(re.search(r"started: pid (\d+)", first.stderr).group(1))
        second = subprocess.Popen(interruptible([*CLI, "server"]), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=env)
        lines: list[str] = []
        second_exports = _read_exports(second.stdout, lines)
        assert second_exports and second_exports != first_exports
        note = next(line for line in lines if "note:" in line)
        assert f"pid {first_pid}" in note and "--print-env and --stop now name this one" in note, note
        # both are listed; the newest is the one named
        listed = subprocess.run([*CLI, "server", "--list", "--json"], capture_output=True, text=True, env=env,
                                timeout=60)
        assert listed.returncode == 0, listed.stderr
        assert [(s["pid"], s["named"]) for s in json.loads(listed.stdout)] == [(first_pid, False),
                                                                              (second.pid, True)]
        table = subprocess.run([*CLI, "server", "--list"], capture_output=True, text=True, env=env, timeout=60)
        rows = table.stdout.splitlines()[1:]
        assert len(rows) == 2 and rows[1].startswith("*") and str(second.pid) in rows[1]
        assert str(first_pid) in rows[0] and not rows[0].startswith("*")
        named = subprocess.run([*CLI, "server", "--print-env"], capture_output=True, text=True, env=env, timeout=60)
        assert _read_exports(named.stdout.splitlines(keepends=True)) == second_exports
        assert f"pid {second.pid}" in named.stderr and "2 servers run" in named.stderr
        chosen = subprocess.run([*CLI, "server", "--print-env", "--pid", str(first_pid)], capture_output=True,
                                text=True, env=env, timeout=60)
        assert _read_exports(chosen.stdout.splitlines(keepends=True)) == first_exports
        # the second stops (Ctrl-C in its terminal): the first is named again, no new server starts
        second.send_signal(signal.SIGINT)
        assert second.wait(timeout=30) == 0
        again = subprocess.run([*CLI, "server", "--print-env"], capture_output=True, text=True, env=env, timeout=60)
        assert again.returncode == 0 and f"running: pid {first_pid}" in again.stderr, again.stderr
        assert _read_exports(again.stdout.splitlines(keepends=True)) == first_exports
        stopped = subprocess.run([*CLI, "server", "--stop"], capture_output=True, text=True, env=env, timeout=60)
        assert stopped.returncode == 0 and f"stopped s3dcp server pid {first_pid}" in stopped.stderr
        assert _state_files(tmp_path) == []
        missing = subprocess.run([*CLI, "server", "--stop", "--pid", str(first_pid)], capture_output=True,
                                 text=True, env=env, timeout=60)
        assert missing.returncode == 1 and f"no s3dcp server with pid {first_pid}" in missing.stderr
    finally:
        if second is not None and second.poll() is None:
            second.terminate()
            second.wait(timeout=30)
        _stop_all(env)


def test_print_env_from_a_folder_holding_a_clone_starts_the_installed_package(tmp_path):
    """A folder named ``s3dcp`` in the current directory (the clone, seen from its parent) does
    not shadow the package the background server runs."""
    here = tmp_path / "work"
    (here / "s3dcp").mkdir(parents=True)
    (here / "s3dcp" / "__init__.py").write_text("raise ImportError('the s3dcp folder of the current directory')")
    env = _cli_env(S3DCP_STATE_DIR=str(tmp_path / "state"))
    env.pop("PYTHONPATH")  # this checkout comes from the starter's sys.path alone
    # -P: the starter itself does not see the folder, as the installed `s3dcp` script does not
    starter = [sys.executable, "-P", "-c", f"import sys; sys.path.insert(0, {ROOT!r}); from s3dcp.cli import main; "
                                           "sys.exit(main())"]
    try:
        done = subprocess.run([*starter, "server", "--print-env", "--dir", "data"], capture_output=True, text=True,
                              env=env, timeout=120, cwd=here)
        assert done.returncode == 0, done.stderr + (tmp_path / "state" / "server.log").read_text()
        assert "AWS_ENDPOINT_URL_S3" in done.stdout
        (state,) = [json.loads(p.read_text()) for p in _state_files(tmp_path / "state")]
        assert state["data_dir"] == str(here / "data")  # a relative --dir is the caller's, not the server's
        assert "started_at" in state  # written by this checkout's server, not the one the venv installed
    finally:
        _stop_all(env)


def test_server_with_a_kept_data_dir_starts_again_with_its_buckets(tmp_path):
    env = _cli_env(S3DCP_STATE_DIR=str(tmp_path / "state"))
    data = str(tmp_path / "data")
    for attempt in range(2):
        proc = subprocess.Popen(interruptible([*CLI, "server", "--dir", data]), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env)
        try:
            exports = _read_exports(proc.stdout)
            assert exports, proc.stderr.read() if proc.poll() is not None else "no exports"
            client = _boto3_for(exports)
            if attempt == 0:
                client.put_object(Bucket="demo", Key="kept", Body=b"x")
            else:
                assert client.get_object(Bucket="demo", Key="kept")["Body"].read() == b"x"
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _boto3_for(exports):
    import boto3
    from botocore.config import Config

    return boto3.session.Session().client(
        "s3", endpoint_url=exports["AWS_ENDPOINT_URL_S3"], region_name=exports["AWS_REGION"],
        aws_access_key_id=exports["AWS_ACCESS_KEY_ID"], aws_secret_access_key=exports["AWS_SECRET_ACCESS_KEY"],
        config=Config(s3={"addressing_style": "path"}, proxies={}))


def test_server_help_lists_only_its_own_options(capsys):
    code, out, _ = run_cli(capsys, "server", "--help")
    assert code == 0 and "--print-env" in out and "--bucket" in out
    assert "--endpoint-url" not in out and "--region" not in out


# ------------------------------------------------------------------------------ mb
def test_mb_creates_a_bucket_once(capsys, s3_server):
    import uuid

    name = f"mb-{uuid.uuid4().hex[:10]}"
    code, out, _ = run_cli(capsys, "mb", f"s3://{name}")
    assert code == 0 and out.startswith(f"created: s3://{name}")
    assert name in [b["Name"] for b in s3_server.boto3_client().list_buckets()["Buckets"]]
    code, out, _ = run_cli(capsys, "mb", "--json", f"s3://{name}")
    assert code == 0 and json.loads(out)["created"] is False
    code, _, err = run_cli(capsys, "mb", f"s3://{name}/prefix")
    assert code == 2 and "not a prefix" in err


def test_a_missing_bucket_names_the_command_that_creates_it(capsys):
    code, _, err = run_cli(capsys, "ls", "s3://no-such-bucket-xyz/run")
    assert code == 1 and "s3dcp mb s3://no-such-bucket-xyz" in err


# ------------------------------------------------------------------------------ errors, pipes, TLS
def test_json_errors_are_json_on_stderr(capsys):
    code, out, err = run_cli(capsys, "ls", "--json", "s3://no-such-bucket-xyz/run")
    report = json.loads(err)["error"]
    assert code == 1 and out == "" and report["exit_code"] == 1
    assert report["type"] == "NoSuchBucketError" and report["bucket"] == "no-such-bucket-xyz"
    assert report["status"] == 404 and "bucket does not exist" in report["message"]
    code, _, err = run_cli(capsys, "gc", "--json", "s3://bucket/x", "--older-than", "soon")
    report = json.loads(err)["error"]
    assert code == 2 and report == {"type": "UsageError", "exit_code": 2, "message": report["message"]}
    assert "invalid duration" in report["message"]


def test_a_closed_pipe_ends_quietly(run_dir):
    proc = subprocess.Popen([*CLI, "ls", "--json", run_dir], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=_cli_env())
    proc.stdout.close()  # like `| head -0`: the reader is gone before anything is written
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 141 and err == b""


def test_an_https_endpoint_at_a_plain_http_server_says_so(capsys, s3_server, bucket):
    https = s3_server.endpoint_url.replace("http://", "https://")
    code, _, err = run_cli(capsys, "--endpoint-url", https, "ls", f"s3://{bucket}/")
    assert code == 1 and "answers plain HTTP, not TLS" in err and f"use {s3_server.endpoint_url}" in err
