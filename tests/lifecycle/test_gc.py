"""s3dcp.gc against the real server: leftovers of failed saves go, committed data stays."""

import time

import torch
import torch.distributed.checkpoint as dcp

from s3dcp import S3StorageReader, S3StorageWriter, gc
from s3dcp.s3.client import S3Client


def _keys(boto3_client, bucket, prefix=""):
    resp = boto3_client.list_objects_v2(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for o in resp.get("Contents", []))


def test_gc_removes_failed_saves_and_stale_uploads_only(bucket, s3_config, boto3_client):
    client = S3Client(s3_config)
    good = {"w": torch.randn(100)}
    dcp.save(good, storage_writer=S3StorageWriter(f"s3://{bucket}/run/step-1", config=s3_config))
    committed = _keys(boto3_client, bucket, "run/step-1/")
    # leftovers: a save that never committed, and a stray object of a failed save next to a
    # committed checkpoint (same directory, another token)
    client.put(bucket, "run/step-2/__0_0.aaaaaaaaaaaa.distcp", b"x" * 10).result()
    client.put(bucket, "run/step-2/__1_0.aaaaaaaaaaaa.distcp", b"y" * 5).result()
    client.put(bucket, "run/step-1/__0_0.bbbbbbbbbbbb.distcp", b"z").result()
    client.put(bucket, "run/notes.txt", b"user data").result()  # not ours: never touched
    upload = boto3_client.create_multipart_upload(Bucket=bucket, Key="run/step-3/__0_0.cccccccccccc.distcp")

    # everything is fresh: nothing is old enough to judge
    report = gc(f"s3://{bucket}/run", older_than_s=3600, client=client)
    assert report.deleted == [] and report.aborted_uploads == []
    assert len(report.kept_recent) == 3

    later = time.time() + 7200
    dry = gc(f"s3://{bucket}/run", older_than_s=3600, client=client, dry_run=True, now=later)
    assert dry.deleted == ["run/step-1/__0_0.bbbbbbbbbbbb.distcp", "run/step-2/__0_0.aaaaaaaaaaaa.distcp",
                           "run/step-2/__1_0.aaaaaaaaaaaa.distcp"]
    assert dry.deleted_bytes == 16
    assert dry.aborted_uploads == [("run/step-3/__0_0.cccccccccccc.distcp", upload["UploadId"])]
    assert len(_keys(boto3_client, bucket)) == len(committed) + 4  # dry run deleted nothing

    gc(f"s3://{bucket}/run", older_than_s=3600, client=client, now=later)
    assert _keys(boto3_client, bucket) == sorted(committed + ["run/notes.txt"])
    assert boto3_client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    out = {"w": torch.zeros(100)}
    dcp.load(out, storage_reader=S3StorageReader(f"s3://{bucket}/run/step-1", config=s3_config))
    assert torch.equal(out["w"], good["w"])


def test_gc_leaves_a_checkpoint_with_unreadable_metadata_alone(bucket, s3_config, boto3_client):
    client = S3Client(s3_config)
    client.put(bucket, "c/.metadata", b"not json").result()
    client.put(bucket, "c/__0_0.dddddddddddd.distcp", b"x").result()
    report = gc(f"s3://{bucket}/c", older_than_s=0, client=client, now=time.time() + 10)
    assert report.deleted == [] and report.unreadable_metadata == ["c/.metadata"]


def test_gc_knows_spread_object_names(bucket, s3_config):
    client = S3Client(s3_config)
    client.put(bucket, "r/step-9/02-__3_1.eeeeeeeeeeee.distcp", b"x").result()
    report = gc(f"s3://{bucket}/r", older_than_s=0, client=client, now=time.time() + 10)
    assert report.deleted == ["r/step-9/02-__3_1.eeeeeeeeeeee.distcp"]


def test_s3dcp_gc_is_the_function_whatever_was_imported_before():
    import s3dcp
    import s3dcp.lifecycle.gc  # noqa: F401 - a submodule named like the function would replace it

    assert callable(s3dcp.gc) and s3dcp.gc is gc
