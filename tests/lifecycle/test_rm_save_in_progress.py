"""``rm`` next to a save in progress (issue 33, row 9): when the removed checkpoint's metadata names
an object of a sibling that has no commit yet, that object is not deleted while its save is younger
than gc's age rule, and ``rm`` says what it kept and why; past the rule it is released, as gc would."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from s3dcp.format import integrity
from s3dcp.format.layout import ItemLocation
from s3dcp.lifecycle.deletion import delete_checkpoint
from s3dcp.s3.client import S3Client
from s3dcp.uri import parse_s3_uri

from handmade import put_metadata, tensor_meta

sys.path.insert(0, str(Path(__file__).parents[1] / "cli"))
from cli_run import run_cli  # noqa: E402

IN_PROGRESS = "run/step-2/__0_0.abcdef012345.distcp"  # a save of step-2 uploading: no .metadata yet


def _setup(bucket: str, cfg) -> S3Client:
    """step-2: one object of a save in progress; step-1: committed, its metadata naming that object."""
    client = S3Client(cfg)
    body = torch.arange(4, dtype=torch.float32).numpy().tobytes()
    client.put(bucket, IN_PROGRESS, body).result()
    loc = ItemLocation("../step-2/__0_0.abcdef012345.distcp", 0, 16,
                       integrity.compute("crc64nvme", memoryview(body)).whole, "float32", (4,))
    md = Metadata({"w": tensor_meta(torch.float32, [4], [([0], [4])])},
                  storage_data={MetadataIndex("w", torch.Size([0])): loc})
    put_metadata(f"s3://{bucket}/run/step-1", cfg, md, {})
    return client


def _exists(client: S3Client, bucket: str, key: str) -> bool:
    objects, _ = client.list(bucket, key).result()
    return any(o.key == key for o in objects)


def test_rm_keeps_an_object_of_a_sibling_save_in_progress_and_says_why(capsys, monkeypatch, s3_server, bucket, s3_config):
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    client = _setup(bucket, s3_config)
    code, out, err = run_cli(capsys, "rm", "--yes", f"s3://{bucket}/run/step-1")
    assert code == 0, err
    assert _exists(client, bucket, IN_PROGRESS), "rm deleted an object of a save in progress"
    assert f"kept: s3://{bucket}/{IN_PROGRESS}: only this checkpoint referenced it, but it belongs to a save " \
           "without a commit that was active less than 1h ago (gc's age rule)" in out, out

    client = _setup(bucket, s3_config)  # again, as JSON
    code, out, _ = run_cli(capsys, "rm", "--yes", "--json", f"s3://{bucket}/run/step-1")
    report = json.loads(out)
    assert code == 0 and report["kept_recent"] == [IN_PROGRESS] and report["released"] == []
    assert "gc's age rule" in report["kept_recent_reason"]
    assert _exists(client, bucket, IN_PROGRESS)


def test_rm_releases_it_once_the_save_is_older_than_gcs_age_rule(bucket, s3_config):
    client = _setup(bucket, s3_config)
    result = delete_checkpoint(client, parse_s3_uri(f"s3://{bucket}/run/step-1"), now=time.time() + 2 * 3600)
    assert result.released == [IN_PROGRESS] and result.kept_recent == []
    assert not _exists(client, bucket, IN_PROGRESS)
