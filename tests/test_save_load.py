"""dcp.save / dcp.load through S3StorageWriter and S3StorageReader, single process, against
the real server: every dtype and shape, exact bytes, commit semantics, integrity."""

import time
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from s3dcp import S3StorageReader, S3StorageWriter
from s3dcp.config import MiB
from s3dcp.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    IncompleteCheckpointError,
    IntegrityError,
    root_error,
)
from s3dcp.format.layout import parse_object_name
from s3dcp.saving.writer import METADATA_NAME

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

FLOAT8 = [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
          if hasattr(torch, n)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, *FLOAT8, torch.int8, torch.int16,
          torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64]


def _random(shape, dtype, gen):
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype, generator=gen)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=gen, dtype=dtype)


def _zeros_like_tree(value):
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    if isinstance(value, dict):
        return {k: _zeros_like_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_zeros_like_tree(v) for v in value]
    return value


def _assert_bitwise_equal(expected, actual, path="state"):
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), path
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, path
        # compare raw bytes: NaN payloads and float8 included
        e, a = expected.contiguous(), actual.contiguous()
        if e.numel():
            assert torch.equal(e.view(torch.uint8) if e.dim() else e.reshape(1).view(torch.uint8),
                               a.view(torch.uint8) if a.dim() else a.reshape(1).view(torch.uint8)), path
    elif isinstance(expected, dict):
        assert set(expected) == set(actual), path
        for k in expected:
            _assert_bitwise_equal(expected[k], actual[k], f"{path}.{k}")
    elif isinstance(expected, list):
        assert len(expected) == len(actual), path
        for i, (e, a) in enumerate(zip(expected, actual)):
            _assert_bitwise_equal(e, a, f"{path}[{i}]")
    else:
        assert expected == actual, path


def save(state, uri, config, **kw):
    dcp.save(state, storage_writer=S3StorageWriter(uri, config=config, **kw))


def load(state, uri, config, **kw):
    dcp.load(state, storage_reader=S3StorageReader(uri, config=config, **kw))
    return state


@pytest.fixture
def small_parts(s3_server):
    # small parts and objects so multipart uploads and several objects per rank happen with MBs
    return s3_server.s3_config(part_size_bytes=5 * MiB, object_size_target_bytes=4 * MiB)


def test_every_dtype_and_shape_round_trips_bitwise(uri, small_parts):
    gen = torch.Generator().manual_seed(0)
    state = {}
    for dtype in DTYPES:
        name = str(dtype).removeprefix("torch.")
        state[f"{name}/matrix"] = _random((17, 5), dtype, gen)
        state[f"{name}/scalar"] = _random((), dtype, gen)
        state[f"{name}/empty"] = _random((0, 3), dtype, gen)
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    state["views/transposed"] = base.t()  # non-contiguous
    state["views/strided"] = base[::2, 1::3]
    state["views/shared_a"] = base[1]  # two views of one storage
    state["views/shared_b"] = base[1:3]
    state["large"] = torch.randn(3 * 1024 * 1024, generator=gen)  # 12 MiB: > part size, own object
    state["nested"] = {"ints": 7, "text": "héllo", "raw": b"\x00\x01", "list": [1, 2.5, {"deep": "x"}],
                       "t": torch.arange(5)}
    save(state, uri, small_parts)
    loaded = load(_zeros_like_tree(state) | {"nested": {"ints": 0, "text": "", "raw": b"", "list": [0, 0, {"deep": ""}],
                                                        "t": torch.zeros(5, dtype=torch.int64)}}, uri, small_parts)
    _assert_bitwise_equal(state, loaded)


@pytest.mark.parametrize("how", ["save", "async_save"])
def test_lazy_conjugate_and_negative_views_save_and_load_their_values(uri, small_parts, how):
    """``z.conj()`` is a view with a conjugate bit: its memory holds ``z``, not the values it
    reads as (likewise a negative view). Its raw bytes would checkpoint the wrong values; both
    save paths and the in-place load resolve the bit. Loading into such a view writes values
    that read back right (the view's memory gets their conjugate)."""
    gen = torch.Generator().manual_seed(3)
    z = torch.complex(torch.randn(3 * MiB // 8, generator=gen), torch.randn(3 * MiB // 8, generator=gen))
    state = {"conj": z.conj(), "small_conj": z[:5].conj(), "neg": torch._neg_view(torch.randn(6, generator=gen)),
             "conj_t": torch.complex(torch.randn(4, 3, generator=gen), torch.randn(4, 3, generator=gen)).conj().t()}
    expected = {k: v.resolve_conj().resolve_neg().clone() for k, v in state.items()}
    writer = S3StorageWriter(uri, config=small_parts)
    if how == "save":
        dcp.save(state, storage_writer=writer)
    else:
        dcp.async_save(state, storage_writer=writer).result(timeout=120)
    loaded = load({k: torch.zeros_like(v) for k, v in expected.items()}, uri, small_parts)
    for k in expected:
        assert torch.equal(loaded[k], expected[k]), k
    into_conj = {k: torch.zeros_like(v) for k, v in expected.items()}
    into_conj["conj"] = torch.zeros_like(z).conj()
    load(into_conj, uri, small_parts)
    assert torch.equal(into_conj["conj"], expected["conj"])


def test_checkpoint_id_may_come_from_dcp(bucket, small_parts):
    state = {"w": torch.randn(4, 4)}
    dcp.save(state, checkpoint_id=f"s3://{bucket}/by-id", storage_writer=S3StorageWriter(config=small_parts))
    out = {"w": torch.zeros(4, 4)}
    dcp.load(out, checkpoint_id=f"s3://{bucket}/by-id", storage_reader=S3StorageReader(config=small_parts))
    assert torch.equal(out["w"], state["w"])


def test_objects_in_the_bucket(uri, bucket, small_parts, boto3_client):
    save({"a": torch.randn(1024, 1024), "b": torch.randn(1024, 1024), "c": torch.ones(3)}, uri, small_parts)
    keys = sorted(o["Key"] for o in boto3_client.list_objects_v2(Bucket=bucket, Prefix="ckpt/")["Contents"])
    data = [k for k in keys if k.endswith(".distcp")]
    assert f"ckpt/{METADATA_NAME}" in keys
    assert len(data) >= 2 and all(k.startswith("ckpt/__0_") for k in data)  # 8 MiB at a 4 MiB target
    meta = boto3_client.get_object(Bucket=bucket, Key=f"ckpt/{METADATA_NAME}")["Body"].read()
    assert meta.startswith(b"\x89S3DCPMD") and b'"format":"s3dcp-metadata"' in meta  # s3dcp format v2, not pickle


def test_saving_onto_a_committed_checkpoint_is_refused(uri, small_parts):
    save({"w": torch.ones(3)}, uri, small_parts)
    with pytest.raises(CheckpointException) as e:
        save({"w": torch.zeros(3)}, uri, small_parts)
    assert "already holds a committed checkpoint" in str(e.value) and "overwrite=True" in str(e.value)
    assert torch.equal(load({"w": torch.empty(3)}, uri, small_parts)["w"], torch.ones(3))
    save({"w": torch.full((3,), 2.0)}, uri, small_parts, overwrite=True)
    assert torch.equal(load({"w": torch.empty(3)}, uri, small_parts)["w"], torch.full((3,), 2.0))


def test_overwrite_removes_the_replaced_data_objects(uri, bucket, small_parts, boto3_client):
    save({"w": torch.ones(3)}, uri, small_parts)
    save({"w": torch.zeros(3)}, uri, small_parts, overwrite=True)
    keys = [o["Key"] for o in boto3_client.list_objects_v2(Bucket=bucket, Prefix="ckpt/")["Contents"]]
    assert len([k for k in keys if k.endswith(".distcp")]) == 1


def test_commit_is_conditional_even_after_the_early_check(uri, small_parts, s3_server):
    """Two writers that both passed the early check: the second commit must lose."""
    from s3dcp.s3.client import S3Client
    from s3dcp.uri import parse_s3_uri

    writer = S3StorageWriter(uri, config=small_parts)
    writer.set_up_storage_writer(True, rank=0)  # passes: nothing committed yet
    save({"w": torch.ones(3)}, uri, small_parts)  # someone else commits meanwhile
    target = parse_s3_uri(uri)
    with pytest.raises(CheckpointExistsError, match="another save committed this checkpoint first"):
        from torch.distributed.checkpoint.metadata import Metadata

        writer.finish(Metadata(state_dict_metadata={}), [[]])
    body = S3Client(small_parts).get(target.bucket, target.key(METADATA_NAME)).result()
    assert b'"w"' in body  # the first commit is untouched


def test_missing_checkpoint_and_incomplete_checkpoint_are_told_apart(uri, bucket, small_parts, boto3_client):
    # DCP re-raises metadata failures with our message; the reader itself keeps the type.
    with pytest.raises(CheckpointException, match="no checkpoint at"):
        load({"w": torch.empty(3)}, uri, small_parts)
    with pytest.raises(CheckpointNotFoundError):
        S3StorageReader(uri, config=small_parts).fetch_metadata()
    save({"w": torch.ones(3)}, uri, small_parts)
    boto3_client.delete_object(Bucket=bucket, Key=f"ckpt/{METADATA_NAME}")  # as if the commit never happened
    with pytest.raises(CheckpointException) as e:
        load({"w": torch.empty(3)}, uri, small_parts)
    assert "is incomplete" in str(e.value) and "s3dcp gc" in str(e.value)
    with pytest.raises(IncompleteCheckpointError):
        S3StorageReader(uri, config=small_parts).fetch_metadata()


def _corrupt(boto3_client, bucket, key, offset, *, truncate=False):
    body = bytearray(boto3_client.get_object(Bucket=bucket, Key=key)["Body"].read())
    if truncate:
        body = body[:offset]
    else:
        body[offset] ^= 0xFF
    boto3_client.put_object(Bucket=bucket, Key=key, Body=bytes(body))


def _data_key(boto3_client, bucket):
    return next(o["Key"] for o in boto3_client.list_objects_v2(Bucket=bucket, Prefix="ckpt/")["Contents"]
                if o["Key"].endswith(".distcp"))


def test_a_flipped_byte_is_caught_and_named(uri, bucket, small_parts, boto3_client):
    save({"first": torch.randn(100), "second": torch.randn(100)}, uri, small_parts)
    _corrupt(boto3_client, bucket, _data_key(boto3_client, bucket), 400 + 17)  # inside "second"
    with pytest.raises(CheckpointException) as e:
        load({"first": torch.empty(100), "second": torch.empty(100)}, uri, small_parts)
    err = _root(e.value)
    assert isinstance(err, IntegrityError)
    assert "'second'" in str(err) and "checksum mismatch" in str(err) and ".distcp" in str(err)
    assert "expected crc64nvme:" in str(err) and "got crc64nvme:" in str(err)  # the default item checksum


def test_a_truncated_object_is_caught(uri, bucket, small_parts, boto3_client):
    save({"w": torch.randn(1000)}, uri, small_parts)
    _corrupt(boto3_client, bucket, _data_key(boto3_client, bucket), 1000, truncate=True)
    with pytest.raises(CheckpointException) as e:
        load({"w": torch.empty(1000)}, uri, small_parts)
    assert isinstance(_root(e.value), IntegrityError)


def test_garbage_metadata_is_refused_clearly(uri, bucket, small_parts, boto3_client):
    save({"w": torch.ones(3)}, uri, small_parts)
    boto3_client.put_object(Bucket=bucket, Key=f"ckpt/{METADATA_NAME}", Body=b"\x80\x04K\x01.")  # a pickle
    with pytest.raises(CheckpointException) as e:
        load({"w": torch.empty(3)}, uri, small_parts)
    assert "not s3dcp metadata" in str(e.value)


def test_load_into_wrong_shape_or_missing_key_fails_clearly(uri, small_parts):
    save({"w": torch.ones(4, 4)}, uri, small_parts)
    with pytest.raises(CheckpointException) as e:
        load({"w": torch.empty(2, 2)}, uri, small_parts)
    assert "w" in str(e.value) and "size" in str(e.value).lower()
    with pytest.raises(CheckpointException) as e:
        load({"absent": torch.empty(2)}, uri, small_parts)
    assert "absent" in str(e.value)


def test_load_casts_into_a_destination_of_another_dtype(uri, small_parts):
    w = torch.randn(64, 3)
    save({"w": w}, uri, small_parts)
    out = load({"w": torch.empty(64, 3, dtype=torch.float64)}, uri, small_parts)
    assert torch.equal(out["w"], w.double())


def test_without_checksums_nothing_is_recorded(uri, small_parts):
    cfg = small_parts.replace(checksum=None)
    save({"w": torch.ones(5)}, uri, cfg)
    reader = S3StorageReader(uri, config=cfg)
    md = reader.fetch_metadata()
    assert all(loc.checksum is None for loc in md.storage_data.values())
    assert torch.equal(load({"w": torch.empty(5)}, uri, cfg)["w"], torch.ones(5))


def test_crc64nvme_checksums(uri, small_parts):
    cfg = small_parts.replace(checksum="crc64nvme")
    save({"w": torch.ones(5)}, uri, cfg)
    md = S3StorageReader(uri, config=cfg).fetch_metadata()
    assert all(loc.checksum.startswith("crc64nvme:") for loc in md.storage_data.values())
    assert torch.equal(load({"w": torch.empty(5)}, uri, cfg)["w"], torch.ones(5))


def test_validate_checkpoint_id():
    assert S3StorageWriter.validate_checkpoint_id("s3://bucket/x")
    assert S3StorageReader.validate_checkpoint_id("s3://bucket")
    assert not S3StorageWriter.validate_checkpoint_id("/tmp/x")
    assert not S3StorageReader.validate_checkpoint_id("s3://Not_Valid/x")


_root = root_error  # DCP wraps rank failures in CheckpointException


class _Custom:
    """Not plain data: unpickling it means importing and calling arbitrary code."""

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return isinstance(other, _Custom) and other.value == self.value


def test_non_tensor_items_beyond_plain_data_are_refused_unless_allowed(uri, small_parts):
    save({"w": torch.ones(2), "obj": _Custom(3)}, uri, small_parts)
    with pytest.raises(CheckpointException) as e:
        load({"w": torch.empty(2), "obj": None}, uri, small_parts)
    assert "'obj'" in str(e.value) and "allow_pickle=True" in str(e.value)
    out = load({"w": torch.empty(2), "obj": None}, uri, small_parts, allow_pickle=True)
    assert out["obj"] == _Custom(3)


def test_key_prefix_spread_names_objects_under_several_prefixes(uri, bucket, small_parts, boto3_client):
    from s3dcp import gc

    cfg = small_parts.replace(key_prefix_spread=4)
    state = {f"w{i}": torch.randn(1024 * 1024) for i in range(5)}  # 20 MiB at a 4 MiB target: 5 objects
    save(state, uri, cfg)
    keys = [o["Key"].removeprefix("ckpt/") for o in boto3_client.list_objects_v2(Bucket=bucket, Prefix="ckpt/")["Contents"]]
    data = [k for k in keys if k.endswith(".distcp")]
    assert len(data) == 5 and {k[:3] for k in data} == {"00-", "01-", "02-", "03-"}
    out = load({k: torch.empty(1024 * 1024) for k in state}, uri, cfg)
    assert all(torch.equal(out[k], v) for k, v in state.items())
    # gc recognises them as this checkpoint's (committed: untouched)
    assert gc(uri, older_than_s=0, config=cfg, now=time.time() + 10).deleted == []


def test_metadata_records_the_checkpoint_and_save_id(uri, small_parts):
    writer = S3StorageWriter(uri, config=small_parts)
    dcp.save({"w": torch.ones(2)}, storage_writer=writer)
    md = S3StorageReader(uri, config=small_parts).fetch_metadata()
    meta = md.storage_meta
    tokens = {parse_object_name(loc.object_name).token for loc in md.storage_data.values()}
    assert meta.checkpoint_id == uri and tokens == {meta.save_id}  # the save id named every object
