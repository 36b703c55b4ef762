"""``s3dcp inspect``, ``verify`` and ``ls`` run in a process where ``import torch`` fails, and say
what the DCP decode of the same checkpoint says: they read the metadata through the torch-free
decode (:func:`s3dcp.format.metadata.decode_plain`), so small checkpoints are inspected in about a
second instead of the ten it takes to import torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

from s3dcp import S3StorageWriter
from s3dcp.format.layout import METADATA_NAME
from s3dcp.format.metadata import dtype_to_str, encode_metadata
from s3dcp.loading.reader import S3StorageReader
from s3dcp.s3.client import S3Client

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The CLI in a fresh interpreter whose every import of torch (or a torch submodule) fails.
NO_TORCH = """
import sys

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"import of {name} refused: this command must not need torch")

sys.meta_path.insert(0, NoTorch())
from s3dcp.cli import main
code = main(sys.argv[1:])
assert "torch" not in sys.modules
sys.exit(code)
"""


def _cli_without_torch(*argv):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", NO_TORCH, *argv], capture_output=True, text=True, env=env,
                          timeout=120)
    return done.returncode, done.stdout, done.stderr


def test_the_blocker_blocks():
    """The harness can fail: a command that imports torch dies in it."""
    code, _, err = _cli_without_torch("download", "s3://b/x", "--to-torch-save", "/nonexistent/x.pt")
    assert code != 0 and "import of torch" in err


def _state():
    g = torch.Generator().manual_seed(0)
    return {"model": {"w": torch.randn(16, 8, generator=g), "b": torch.randn(8, generator=g).to(torch.bfloat16)},
            "ids": torch.arange(5), "step": 4, "extra": {"name": "run"}}


@pytest.mark.parametrize("version", [3, 2, 1])
def test_inspect_verify_and_ls_without_torch(version, bucket, s3_config):
    uri = f"s3://{bucket}/notorch/step-4"
    dcp.save(_state(), storage_writer=S3StorageWriter(uri, config=s3_config), no_dist=True)
    md = S3StorageReader(uri, config=s3_config).fetch_metadata()  # the DCP decode, for comparison
    if version != 2:  # the same checkpoint with its metadata in format 1 or 3 (3's packed header: ls too)
        S3Client(s3_config).put(bucket, f"notorch/step-4/{METADATA_NAME}",
                                encode_metadata(md, version=version)).result()

    code, out, err = _cli_without_torch("inspect", "--json", uri)
    assert code == 0, err
    report = json.loads(out)
    assert report["format_version"] == version and report["dcp_version"] == md.version
    assert report["save_id"] == md.storage_meta.save_id and report["invalid_items"] == []
    stored: dict[str, int] = {}
    for index, loc in md.storage_data.items():
        stored[index.fqn] = stored.get(index.fqn, 0) + loc.length
    expected_tensors = [{"fqn": fqn, "dtype": dtype_to_str(item.properties.dtype), "shape": list(item.size),
                         "chunks": len(item.chunks), "bytes": stored[fqn]}
                        for fqn, item in md.state_dict_metadata.items() if hasattr(item, "chunks")]
    assert report["tensors"] == expected_tensors
    assert report["non_tensors"] == [{"fqn": fqn, "bytes": stored[fqn]} for fqn, item in md.state_dict_metadata.items()
                                     if not hasattr(item, "chunks")]
    assert report["total_bytes"] == sum(stored.values())
    assert {o["object"] for o in report["objects"]} == {loc.object_name for loc in md.storage_data.values()}

    code, out, err = _cli_without_torch("inspect", uri)
    assert code == 0 and f"format s3dcp-metadata v{version}" in out and "model.w" in out, err

    code, out, err = _cli_without_torch("verify", "--json", uri)
    report = json.loads(out)
    assert code == 0 and report["ok"] is True, err
    assert report["items"] == report["verified_items"] == len(md.storage_data)
    assert report["bytes"] == sum(loc.length for loc in md.storage_data.values())

    code, out, err = _cli_without_torch("ls", "--json", f"s3://{bucket}/notorch")
    assert code == 0 and [(r["name"], r["state"]) for r in json.loads(out)] == [("step-4", "committed")], err


def test_errors_without_torch(bucket, s3_config, boto3_client):
    """A missing, incomplete or damaged checkpoint is refused as before, torch or not."""
    code, _, err = _cli_without_torch("inspect", f"s3://{bucket}/nothing/here")
    assert code == 1 and "no checkpoint at" in err
    uri = f"s3://{bucket}/broken/step-1"
    dcp.save(_state(), storage_writer=S3StorageWriter(uri, config=s3_config), no_dist=True)
    key = f"broken/step-1/{METADATA_NAME}"
    raw = boto3_client.get_object(Bucket=bucket, Key=key)["Body"].read()
    boto3_client.put_object(Bucket=bucket, Key=key, Body=raw[:-1])
    for command in ("inspect", "verify"):
        code, _, err = _cli_without_torch(command, uri)
        assert code == 1 and "CRC32" in err and err.startswith("s3dcp: error:"), (command, err)
    boto3_client.delete_object(Bucket=bucket, Key=key)
    code, _, err = _cli_without_torch("verify", uri)
    assert code == 1 and "is incomplete" in err


def test_the_nodes_copies_without_torch(bucket, s3_config, tmp_path):
    """``ls``, ``verify`` and ``inspect`` with ``--local-dir`` read the node's copies (markers,
    .metadata) without torch too."""
    from s3dcp import CheckpointManager

    run, local_dir = f"s3://{bucket}/tiered", str(tmp_path / "node")
    m = CheckpointManager(run, config=s3_config, local_dir=local_dir, async_mode=False, s3_every=2)
    for step in (1, 2):
        m.save(step, _state())
    m.close()
    code, out, err = _cli_without_torch("ls", "--json", run, "--local-dir", local_dir)
    assert code == 0, err
    report = json.loads(out)
    assert [(r["step"], r["s3"]) for r in report["local_copies"]] == [(1, "committed"), (2, "not sent")]
    assert report["restart"][0]["step"] == 2
    for step in (1, 2):
        code, out, err = _cli_without_torch("verify", "--json", f"{run}/step-{step:08d}", "--local-dir", local_dir)
        assert code == 0 and json.loads(out)["ok"] is True, err
    code, out, err = _cli_without_torch("inspect", "--json", f"{run}/step-00000002", "--local-dir", local_dir)
    assert code == 0 and "metadata_from" in json.loads(out), err
