"""Hugging Face safetensors in and out of S3: S3SafetensorsReader (dcp.load) and `s3dcp export`.

Multi-rank loads (DTensor Shard(0), bytes read per rank) are in test_interop_multirank.py.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

from s3dcp import S3StorageReader, S3StorageWriter, cli
from s3dcp.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    IncompleteCheckpointError,
    IntegrityError,
    MetadataFormatError,
)
from s3dcp.interop.export import export_safetensors
from s3dcp.cli.parser import build_parser, parse_size
from s3dcp.interop.safetensors_reader import S3SafetensorsReader
from s3dcp.format.safetensors import parse_header

MODEL_FILES = {  # file -> tensors, as Hugging Face shards a model
    "model-00001-of-00002.safetensors": ("embed.weight", "norm.scale"),
    "model-00002-of-00002.safetensors": ("layer.0.weight", "layer.0.bias", "step_ids"),
}


def hf_model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(13)
    return {
        "embed.weight": torch.randn(96, 40, generator=g).to(torch.bfloat16),
        "norm.scale": torch.tensor(1.5, dtype=torch.float16),
        "layer.0.weight": torch.randn(40, 72, generator=g),
        "layer.0.bias": torch.randn(72, generator=g).to(torch.float64),
        "step_ids": torch.randint(-100, 100, (33,), generator=g, dtype=torch.int8),
    }


def upload_hf_model(boto3_client, bucket: str, prefix: str, tmp_path, *, index: bool = True) -> dict:
    """Write the model with ``safetensors`` as Hugging Face does (shards + index) and upload it."""
    model = hf_model()
    files = MODEL_FILES if index else {"model.safetensors": tuple(model)}
    weight_map = {}
    for name, keys in files.items():
        save_file({k: model[k] for k in keys}, tmp_path / name, metadata={"format": "pt"})
        boto3_client.upload_file(str(tmp_path / name), bucket, f"{prefix}/{name}")
        weight_map.update({k: name for k in keys})
    if index:
        doc = {"metadata": {"total_size": 0}, "weight_map": weight_map}
        boto3_client.put_object(Bucket=bucket, Key=f"{prefix}/model.safetensors.index.json", Body=json.dumps(doc))
    return model


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.dtype == expected.dtype, f"{what}: {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: {actual.shape} != {expected.shape}"
    assert torch.equal(actual, expected), f"{what}: values differ"


# ------------------------------------------------------------------------------ format
def test_parse_header_refuses_what_a_reader_cannot_trust(tmp_path):
    save_file({"a": torch.ones(3, 4), "b": torch.zeros(2, dtype=torch.bfloat16)}, tmp_path / "x.safetensors")
    raw = (tmp_path / "x.safetensors").read_bytes()
    header = parse_header(raw, source="x", file_size=len(raw))
    by_name = {t.name: t for t in header.tensors}
    assert (by_name["a"].dtype, by_name["a"].shape, by_name["a"].nbytes) == (torch.float32, (3, 4), 48)
    assert raw[by_name["b"].start:by_name["b"].end] == bytes(4)

    with pytest.raises(MetadataFormatError, match="past the end"):
        parse_header(raw, source="x", file_size=len(raw) - 1)  # truncated
    n = struct.unpack("<Q", raw[:8])[0]
    doc = json.loads(raw[8:8 + n])
    doc["a"]["data_offsets"][1] -= 4  # a range that does not match dtype x shape
    bad = json.dumps(doc).encode()
    with pytest.raises(MetadataFormatError, match="'a'.*expected a range of 48 bytes"):
        parse_header(struct.pack("<Q", len(bad)) + bad, source="x")
    with pytest.raises(MetadataFormatError, match="not that of a safetensors file"):
        parse_header(b"\xff" * 16, source="x")


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size("1000") == 1000
    for bad in ("5 parsecs", "", "-1GB", "0"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_check_shard_set():
    from s3dcp.format.safetensors import check_shard_set

    check_shard_set(["model.safetensors"], where="p")
    check_shard_set(["a.safetensors", "b.safetensors"], where="p")  # unnumbered: nothing to count
    check_shard_set([f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)], where="p")
    with pytest.raises(IncompleteCheckpointError, match=r"s3://b/p/ is incomplete: .*1 of 3 .*\(model-00002-of-00003"):
        check_shard_set(["model-00001-of-00003.safetensors", "model-00003-of-00003.safetensors"], where="s3://b/p/")
    with pytest.raises(MetadataFormatError, match="more than one model"):
        check_shard_set(["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                         "model-00001-of-00003.safetensors"], where="p")
    with pytest.raises(MetadataFormatError, match="more than one model"):
        check_shard_set(["model.safetensors", "model-00001-of-00001.safetensors"], where="p")
    with pytest.raises(MetadataFormatError, match="not shard 1..2"):
        check_shard_set(["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                         "model-00003-of-00002.safetensors"], where="p")


def test_a_shard_count_from_a_file_name_costs_nothing_to_check():
    """N comes from a name anyone can upload: the missing shards are counted, never listed."""
    import tracemalloc

    from s3dcp.format.safetensors import check_shard_set

    tracemalloc.start()
    try:
        missing = (r"3999999 of 4000000 shard file\(s\) missing "
                   r"\(model-0000002-of-4000000.safetensors, .* and 3999994 more\)")
        with pytest.raises(IncompleteCheckpointError, match=missing):
            check_shard_set(["model-0000001-of-4000000.safetensors"], where="p")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20  # was ~400 MiB: every missing name built first
    with pytest.raises(IncompleteCheckpointError, match=r"99999999998 of 99999999999 shard"):
        check_shard_set(["model-00000000001-of-99999999999.safetensors"], where="p")  # was: hours


def test_parse_header_refuses_odd_shapes_and_overlapping_tensors(tmp_path):
    save_file({"a": torch.ones(4), "b": torch.zeros(4)}, tmp_path / "x.safetensors")
    raw = (tmp_path / "x.safetensors").read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]

    def edited(change) -> bytes:
        doc = json.loads(raw[8:8 + n])
        change(doc)
        text = json.dumps(doc).encode()
        return struct.pack("<Q", len(text)) + text

    # -2 x -2 = 4 elements: the byte count alone passes
    with pytest.raises(MetadataFormatError, match=r"'a' has shape \[-2, -2\]"):
        parse_header(edited(lambda d: d["a"].update(shape=[-2, -2])), source="x")
    with pytest.raises(MetadataFormatError, match="'a' has shape '4'"):
        parse_header(edited(lambda d: d["a"].update(shape="4")), source="x")
    with pytest.raises(MetadataFormatError, match="overlap"):
        parse_header(edited(lambda d: d["b"].update(data_offsets=d["a"]["data_offsets"])), source="x")
    with pytest.raises(MetadataFormatError, match="not JSON"):  # too deep for the parser
        parse_header(struct.pack("<Q", 4_000) + b"[" * 2_000 + b"]" * 2_000, source="x")
    with pytest.raises(MetadataFormatError, match="holds 200000 JSON values in 200000 bytes"):  # refused unparsed
        parse_header(struct.pack("<Q", 200_000) + b"[" * 200_000, source="x")


# ------------------------------------------------------------------------------ reader
def test_reader_loads_index_and_shards_bitwise_with_dtype_conversion(bucket, s3_config, boto3_client, tmp_path):
    model = upload_hf_model(boto3_client, bucket, "models/tiny", tmp_path)
    dest = {k: torch.zeros_like(v) for k, v in model.items()}
    dest["embed.weight"] = torch.zeros(96, 40, dtype=torch.float32)  # the state asks for fp32
    reader = S3SafetensorsReader(f"s3://{bucket}/models/tiny/", config=s3_config)
    dcp.load(dest, storage_reader=reader)
    for k, v in model.items():
        assert_bitwise(dest[k], v.to(dest[k].dtype), k)
    tensor_bytes = sum(v.numel() * v.element_size() for v in model.values())
    assert reader.last_read_bytes == tensor_bytes  # exactly the tensors: no header bytes twice, no holes
    # index + at most the first 64 KiB of each file (one GET per file finds the header)
    assert 0 < reader.last_header_bytes <= 2 * 64 * 1024 + 1024

    # A subset of the model reads only that subset.
    part = {"layer.0.weight": torch.zeros(40, 72)}
    dcp.load(part, storage_reader=S3SafetensorsReader(f"s3://{bucket}/models/tiny", config=s3_config))
    assert_bitwise(part["layer.0.weight"], model["layer.0.weight"], "subset")


def test_reader_without_index_reads_every_file(bucket, s3_config, boto3_client, tmp_path):
    model = upload_hf_model(boto3_client, bucket, "single", tmp_path, index=False)
    dest = {k: torch.zeros_like(v) for k, v in model.items()}
    dcp.load(dest, storage_reader=S3SafetensorsReader(f"s3://{bucket}/single", config=s3_config))
    for k, v in model.items():
        assert_bitwise(dest[k], v, k)


def test_reader_errors_name_what_is_wrong(bucket, s3_config, boto3_client, tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="no model.safetensors.index.json and no"):
        S3SafetensorsReader(f"s3://{bucket}/nothing", config=s3_config).fetch_metadata()

    upload_hf_model(boto3_client, bucket, "broken", tmp_path)
    boto3_client.delete_object(Bucket=bucket, Key="broken/model-00002-of-00002.safetensors")
    with pytest.raises(MetadataFormatError, match="names .*model-00002-of-00002.safetensors.* but no such object"):
        S3SafetensorsReader(f"s3://{bucket}/broken", config=s3_config).fetch_metadata()

    # Without the index, the files must be every shard of one -of-N set.
    boto3_client.delete_object(Bucket=bucket, Key="broken/model.safetensors.index.json")
    with pytest.raises(IncompleteCheckpointError,
                       match=r"s3://.*/broken/ is incomplete: no model.safetensors.index.json .*"
                             r"model-00002-of-00002.safetensors"):
        S3SafetensorsReader(f"s3://{bucket}/broken", config=s3_config).fetch_metadata()

    raw = (tmp_path / "model-00002-of-00002.safetensors").read_bytes()
    boto3_client.put_object(Bucket=bucket, Key="broken/model-00002-of-00002.safetensors", Body=raw[:-10])
    with pytest.raises(MetadataFormatError, match="past the end of the .*truncated"):
        S3SafetensorsReader(f"s3://{bucket}/broken", config=s3_config).fetch_metadata()


class _Planner:
    """The two planner calls read_data makes, for hand-built ReadItems (a DTensor Shard(1)
    rank asks for a column range of each stored tensor)."""

    def __init__(self, dests: dict[str, torch.Tensor]) -> None:
        self.dests, self.committed = dests, []

    def resolve_tensor(self, item):
        return self.dests[item.dest_index.fqn]

    def commit_tensor(self, item, tensor) -> None:
        self.committed.append(item.dest_index.fqn)


def _read_columns(reader: S3SafetensorsReader, name: str, rows: int, col: int, width: int,
                  dtype=torch.float32) -> torch.Tensor:
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    reader.set_up_storage_reader(reader.fetch_metadata(), True)
    dest = torch.zeros(rows, width, dtype=dtype)
    item = ReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex(name), dest_offsets=torch.Size([0, 0]),
                    storage_index=MetadataIndex(name, torch.Size([0, 0])), storage_offsets=torch.Size([0, col]),
                    lengths=torch.Size([rows, width]))
    planner = _Planner({name: dest})
    reader.read_data(LoadPlan([item]), planner).wait()
    assert planner.committed == [name]
    return dest


def _proxied_get_bytes(proxy, key: str) -> int:
    """Bytes the client asked the server for with GETs of ``key`` (their Range headers), as the
    proxy in front of the server saw them."""
    total = 0
    for r in proxy.requests:
        if r.method == "GET" and r.target.split("?")[0].endswith("/" + key):
            lo, hi = r.header("Range").removeprefix("bytes=").split("-")
            total += int(hi) - int(lo) + 1
    return total


def test_a_column_range_fetches_about_its_share_as_the_server_sees_it(s3_server, bucket, boto3_client, tmp_path):
    """A Shard(1) rank of four asks for a quarter of the columns of an 8 x 1M fp32 tensor (rows
    of 4 MiB): only the box's pieces are fetched, 8 of the 32 MiB, counted at the server's door
    (a proxy reading the GETs' Range headers), default config. Fetching the smallest range
    holding the box would read 7/8 of the tensor."""
    from urllib.parse import urlsplit

    from fault_proxy import FaultProxy

    wide = torch.randn(8, 1 << 20, generator=torch.Generator().manual_seed(8))
    save_file({"wide": wide}, tmp_path / "model.safetensors")
    boto3_client.upload_file(str(tmp_path / "model.safetensors"), bucket, "cols/model.safetensors")
    u = urlsplit(s3_server.endpoint_url)
    quarter = wide.shape[1] // 4
    with FaultProxy(u.hostname, u.port) as proxy:
        cfg = s3_server.s3_config(endpoint_url=proxy.endpoint_url)
        for rank in (0, 3):
            reader = S3SafetensorsReader(f"s3://{bucket}/cols", config=cfg)
            header_bytes = _proxied_get_bytes(proxy, "cols/model.safetensors")
            got = _read_columns(reader, "wide", 8, rank * quarter, quarter)
            assert torch.equal(got, wide[:, rank * quarter:(rank + 1) * quarter]), rank
            fetched = _proxied_get_bytes(proxy, "cols/model.safetensors") - header_bytes
            fetched -= reader.last_header_bytes
            assert fetched == reader.last_read_bytes == wide.numel() * 4 // 4, (rank, fetched)


def test_a_bf16_to_fp32_load_holds_bounce_memory_within_the_window(s3_server, bucket, boto3_client, tmp_path):
    """Every byte of a bf16 file loaded into fp32 state goes through bounce memory: the load
    takes one window (download_part_size_bytes x max_concurrency = 64 MiB) from the pool, and
    the process's resident memory rises by at most twice that (the window and the CRT's parts in
    flight: ~95-105 MiB measured), below the 160 MiB file (a bounce buffer per tensor up front
    held all of it: 175 MiB). The same bound as test_load_window's for S3StorageReader."""
    from rss import peak_rss_sampler
    from s3dcp.memory.pool import HostBufferPool

    MiB = 2**20
    count, shape = 5, (2, 8 * MiB)  # 5 x 32 MiB of bf16

    def tensors():
        gen = torch.Generator().manual_seed(9)
        for i in range(count):
            yield f"t{i}", torch.randn(*shape, generator=gen).to(torch.bfloat16)

    save_file(dict(tensors()), tmp_path / "model.safetensors")
    boto3_client.upload_file(str(tmp_path / "model.safetensors"), bucket, "bf16/model.safetensors")
    (tmp_path / "model.safetensors").unlink()
    cfg = s3_server.s3_config(download_part_size_bytes=8 * MiB, max_concurrency=8)
    window = cfg.download_part_size_bytes * cfg.max_concurrency
    dest = {f"t{i}": torch.zeros(shape, dtype=torch.float32) for i in range(count)}  # 320 MiB, faulted in
    pool = HostBufferPool(pin_memory=False)
    allocated = []
    acquire = pool.acquire

    def counting_acquire(nbytes, **kwargs):
        allocated.append(nbytes)
        return acquire(nbytes, **kwargs)

    pool.acquire = counting_acquire
    S3SafetensorsReader(f"s3://{bucket}/bf16", config=cfg).fetch_metadata()  # the client exists before the baseline

    with peak_rss_sampler(0.002) as measured:
        dcp.load(dest, storage_reader=S3SafetensorsReader(f"s3://{bucket}/bf16", config=cfg, pool=pool))
    rise = measured.extra
    print(f"bf16 -> fp32 load of {count * 32} MiB: RSS rose {rise / MiB:.1f} MiB, bounce arenas {allocated}")
    for name, v in tensors():
        assert_bitwise(dest[name], v.float(), name)
    assert len(allocated) == 1 and allocated[0] <= window and pool.in_use == 0, allocated  # one window, given back
    assert rise <= 2 * window, f"RSS rose {rise / MiB:.0f} MiB during the load (bound {2 * window / MiB:.0f} MiB)"


# ------------------------------------------------------------------------------ export
def training_state() -> dict:
    g = torch.Generator().manual_seed(5)
    return {
        "model": {"embed.weight": torch.randn(64, 48, generator=g).to(torch.bfloat16),
                  "proj.weight": torch.randn(300, 100, generator=g),  # 120 kB: its own shard below
                  "proj.bias": torch.randn(100, generator=g), "scale": torch.tensor(0.5)},
        "optim": {"state": {"proj.weight": {"exp_avg": torch.randn(300, 100, generator=g)}}, "lr": 0.01},
        "step": 1000,
    }


def test_export_local_shards_load_with_safetensors_and_the_reader(bucket, s3_config, tmp_path):
    state = training_state()
    dcp.save(state, storage_writer=S3StorageWriter(f"s3://{bucket}/run/step-1000", config=s3_config))
    out = tmp_path / "hf"
    report = export_safetensors(f"s3://{bucket}/run/step-1000", str(out), only=["model."], strip_prefix="model.",
                                shard_size_bytes=100_000, config=s3_config)
    model = state["model"]
    names = sorted(os.listdir(out))
    # embed (6 kB) | proj.weight (120 kB, over the shard size: alone) | proj.bias + scale
    assert names == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)] + ["model.safetensors.index.json"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(model)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in model.values())
    loaded = {}
    for name in names[:3]:
        part = load_file(out / name)
        assert all(index["weight_map"][k] == name for k in part)
        loaded.update(part)
    assert loaded.keys() == model.keys()
    for k, v in model.items():
        assert_bitwise(loaded[k], v, k)
    assert report.tensors == 4 and report.verified_chunks == 4 and report.unverified_chunks == 0
    assert sorted(report.skipped) == ["optim.lr", "optim.state.proj.weight.exp_avg", "step"]
    assert report.peak_buffered_bytes <= 120_000 + 256 * 2**20

    # every file with the mode of any file the user makes (safetensors alone makes its files 0600)
    umask = os.umask(0o022)
    os.umask(umask)
    assert {name: oct((out / name).stat().st_mode & 0o777) for name in names} == \
        {name: oct(0o666 & ~umask) for name in names}
    with pytest.raises(CheckpointExistsError, match="already holds safetensors files .*; pass overwrite=True to"):
        export_safetensors(f"s3://{bucket}/run/step-1000", str(out), config=s3_config)


def test_export_to_s3_loads_with_the_reader(bucket, s3_config, tmp_path):
    state = training_state()
    dcp.save(state, storage_writer=S3StorageWriter(f"s3://{bucket}/run/step-1000", config=s3_config))
    export_safetensors(f"s3://{bucket}/run/step-1000", f"s3://{bucket}/hf/step-1000", only=["model."],
                       strip_prefix="model.", config=s3_config, temp_dir=str(tmp_path))
    assert os.listdir(tmp_path) == []  # the spool directory is gone
    dest = {k: torch.zeros_like(v) for k, v in state["model"].items()}
    dcp.load(dest, storage_reader=S3SafetensorsReader(f"s3://{bucket}/hf/step-1000", config=s3_config))
    for k, v in state["model"].items():
        assert_bitwise(dest[k], v, k)


def test_export_refuses_a_corrupted_item_and_writes_no_index(bucket, s3_config, boto3_client, tmp_path):
    from s3dcp.loading.reader import S3StorageReader

    uri = f"s3://{bucket}/run/step-1"
    dcp.save(training_state(), storage_writer=S3StorageWriter(uri, config=s3_config))
    md = S3StorageReader(uri, config=s3_config).fetch_metadata()
    loc = next(loc for idx, loc in md.storage_data.items() if idx.fqn == "model.proj.bias")
    key = f"run/step-1/{loc.object_name}"
    body = bytearray(boto3_client.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[loc.offset + 7] ^= 0x01
    boto3_client.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    with pytest.raises(IntegrityError, match="checksum mismatch .* 'model.proj.bias'"):
        export_safetensors(uri, str(tmp_path / "out"), config=s3_config)
    assert os.listdir(tmp_path / "out") == []  # no index, no partial files


def _corrupt_item(boto3_client, bucket: str, uri: str, fqn: str, s3_config) -> None:
    """Flip one bit of checkpoint item ``fqn`` in its data object."""
    from s3dcp.loading.reader import S3StorageReader

    md = S3StorageReader(uri, config=s3_config).fetch_metadata()
    loc = next(loc for idx, loc in md.storage_data.items() if idx.fqn == fqn)
    key = f"{uri.split('/', 3)[3]}/{loc.object_name}"
    body = bytearray(boto3_client.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[loc.offset + 7] ^= 0x01
    boto3_client.put_object(Bucket=bucket, Key=key, Body=bytes(body))


def _keys(boto3_client, bucket: str, prefix: str) -> list[str]:
    return sorted(o["Key"] for o in boto3_client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", []))


# shard_size 100 kB over the model: embed | proj.weight | proj.bias + scale; proj.bias fails shard 3
_THREE = dict(only=["model."], strip_prefix="model.", shard_size_bytes=100_000)


def test_a_multi_shard_export_failing_midway_leaves_nothing_that_loads(bucket, s3_config, boto3_client, tmp_path):
    """Shards 1 and 2 are finished (renamed locally, uploaded to s3://) when shard 3 meets a
    corrupted item: the export removes them. A forced re-export over a complete earlier one
    removes the earlier index first, so its failure cannot leave old index + new files."""
    uri = f"s3://{bucket}/run/step-2"
    dcp.save(training_state(), storage_writer=S3StorageWriter(uri, config=s3_config))
    out = tmp_path / "out"
    export_safetensors(uri, str(out), config=s3_config, **_THREE)
    export_safetensors(uri, f"s3://{bucket}/hf-old", config=s3_config, temp_dir=str(tmp_path), **_THREE)
    assert len(os.listdir(out)) == 4 and len(_keys(boto3_client, bucket, "hf-old/")) == 4
    # An upload that lost its index and shard 2 of 3 is refused, naming what is missing.
    for name in ("model.safetensors.index.json", "model-00002-of-00003.safetensors"):
        boto3_client.delete_object(Bucket=bucket, Key=f"hf-old/{name}")
    with pytest.raises(IncompleteCheckpointError, match=rf"s3://{bucket}/hf-old/ is incomplete: .*1 of 3 shard "
                                                        r"file\(s\) missing \(model-00002-of-00003.safetensors\)"):
        S3SafetensorsReader(f"s3://{bucket}/hf-old", config=s3_config).fetch_metadata()
    _corrupt_item(boto3_client, bucket, uri, "model.proj.bias", s3_config)

    with pytest.raises(IntegrityError, match="'model.proj.bias'"):
        export_safetensors(uri, str(out), config=s3_config, overwrite=True, **_THREE)
    assert os.listdir(out) == []  # neither the new shards 1-2 nor the earlier export
    for dest in (f"s3://{bucket}/hf-new", f"s3://{bucket}/hf-old"):
        prefix = dest.split("/", 3)[3]
        with pytest.raises(IntegrityError, match="'model.proj.bias'"):
            export_safetensors(uri, dest, config=s3_config, overwrite=True, temp_dir=str(tmp_path), **_THREE)
        assert _keys(boto3_client, bucket, prefix + "/") == [], dest
        with pytest.raises(CheckpointNotFoundError):
            S3SafetensorsReader(dest, config=s3_config).fetch_metadata()
    assert os.listdir(tmp_path) == ["out"]  # no spool directory left


def test_an_export_that_cannot_remove_its_shards_says_what_is_left(s3_server, bucket, boto3_client, tmp_path):
    """Deleting is refused too (403 through a fault proxy): the error names the files left and
    keeps the export's own error as its cause; the reader refuses what is left."""
    from urllib.parse import urlsplit

    from fault_proxy import FaultProxy, Rule

    cfg = s3_server.s3_config()
    uri = f"s3://{bucket}/run/step-3"
    dcp.save(training_state(), storage_writer=S3StorageWriter(uri, config=cfg))
    _corrupt_item(boto3_client, bucket, uri, "model.proj.bias", cfg)
    u = urlsplit(s3_server.endpoint_url)
    with FaultProxy(u.hostname, u.port) as proxy:
        proxy.add_rule(Rule("error", method="POST", query_has="delete", status=403, code="AccessDenied"))
        with pytest.raises(IncompleteCheckpointError) as info:
            export_safetensors(uri, f"s3://{bucket}/hf", config=cfg.replace(endpoint_url=proxy.endpoint_url,
                                                                            max_retries=0),
                               temp_dir=str(tmp_path), **_THREE)
    text = str(info.value)
    for i in (1, 2):
        assert f"s3://{bucket}/hf/model-0000{i}-of-00003.safetensors" in text
    assert "IntegrityError" in text and "--force" in text and isinstance(info.value.__cause__, IntegrityError)
    assert _keys(boto3_client, bucket, "hf/") == [f"hf/model-0000{i}-of-00003.safetensors" for i in (1, 2)]
    with pytest.raises(IncompleteCheckpointError, match=r"hf/ is incomplete.*model-00003-of-00003.safetensors"):
        S3SafetensorsReader(f"s3://{bucket}/hf", config=cfg).fetch_metadata()


@pytest.mark.parametrize("second", [(4,), (2,)], ids=["tiled", "overlap-and-hole"])
def test_export_refuses_chunks_that_do_not_tile_their_tensor(bucket, s3_config, tmp_path, second):
    """Two chunks of 4 elements each always add up to the 8 of the tensor; only at (0,) and (4,)
    do they tile it. At (0,) and (2,) they overlap and leave [6, 8) to nobody: refused, not
    exported as whatever the buffer held."""
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                       TensorProperties, TensorStorageMetadata)

    from s3dcp.format.layout import ItemLocation
    from s3dcp.format.metadata import encode_metadata
    from s3dcp.s3.client import S3Client

    uri = f"s3://{bucket}/run/step-1"
    dcp.save({"w": torch.arange(8, dtype=torch.float32)}, storage_writer=S3StorageWriter(uri, config=s3_config))
    client = S3Client(s3_config)
    saved = S3StorageReader(uri, config=s3_config).fetch_metadata()
    (whole,) = saved.storage_data.values()
    chunks = [((0,), (4,)), (second, (4,))]
    md = Metadata(
        state_dict_metadata={"w": TensorStorageMetadata(
            properties=TensorProperties(dtype=torch.float32), size=torch.Size([8]),
            chunks=[ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(n)) for o, n in chunks])},
        storage_data={MetadataIndex("w", torch.Size(o)): ItemLocation(
            whole.object_name, whole.offset + 16 * i, 16, None, "float32", (4,)) for i, (o, _) in enumerate(chunks)})
    client.put(bucket, "run/step-1/.metadata", encode_metadata(md)).result()
    out = tmp_path / "hf"
    if second == (4,):
        export_safetensors(uri, str(out), config=s3_config)
        assert torch.equal(load_file(out / "model-00001-of-00001.safetensors")["w"], torch.arange(8, dtype=torch.float32))
        return
    with pytest.raises(MetadataFormatError, match=r"'w'.*(overlap|no chunk holds)"):
        export_safetensors(uri, str(out), config=s3_config)
    assert not out.exists() or sorted(os.listdir(out)) == []


def test_export_refuses_a_negative_offset_as_a_format_error(bucket, s3_config, tmp_path):
    from metadata_edit import column, edit_column, header

    from s3dcp.s3.client import S3Client

    uri = f"s3://{bucket}/run/step-1"
    dcp.save({"w": torch.arange(8, dtype=torch.float32)}, storage_writer=S3StorageWriter(uri, config=s3_config))
    client = S3Client(s3_config)
    raw = client.get(bucket, "run/step-1/.metadata").result()
    row = column(raw, "sd.fqn").index(header(raw)["fqns"].index("w"))
    edited = edit_column(raw, "sd.offset", lambda vs: [-8 if i == row else v for i, v in enumerate(vs)])
    client.put(bucket, "run/step-1/.metadata", edited).result()
    with pytest.raises(MetadataFormatError, match=r"'w'.*offset -8 is not a non-negative int"):
        export_safetensors(uri, str(tmp_path / "hf"), config=s3_config)


def test_export_reports_progress_in_growing_byte_counts(bucket, s3_config, tmp_path):
    uri = f"s3://{bucket}/run/step-4"
    dcp.save(training_state(), storage_writer=S3StorageWriter(uri, config=s3_config))
    calls: list[tuple[int, int]] = []
    report = export_safetensors(uri, str(tmp_path / "o"), config=s3_config,
                                on_progress=lambda done, total: calls.append((done, total)), **_THREE)
    sizes = sorted(v.numel() * v.element_size() for v in training_state()["model"].values())
    assert len(calls) == len(sizes)  # one call per tensor written
    assert {t for _, t in calls} == {report.tensor_bytes} == {sum(sizes)}
    done = [d for d, _ in calls]
    assert done == sorted(done) and len(set(done)) == len(done) and done[-1] == report.tensor_bytes
    assert sorted(b - a for a, b in zip([0] + done, done)) == sizes  # each step is one tensor's bytes


def test_default_shard_size_is_hugging_faces_5gb():
    import inspect

    from s3dcp.interop.export_defaults import DEFAULT_SHARD_SIZE_BYTES

    assert DEFAULT_SHARD_SIZE_BYTES == 5 * 1000**3
    assert inspect.signature(export_safetensors).parameters["shard_size_bytes"].default == 5 * 1000**3
    args = build_parser().parse_args(["export", "s3://b/c", "--to-safetensors", "out"])
    assert args.shard_size == 5 * 1000**3


def test_export_cli_strip_prefix(capsys, monkeypatch, s3_server, bucket, s3_config, tmp_path):
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    dcp.save(training_state(), storage_writer=S3StorageWriter(f"s3://{bucket}/run/step-8", config=s3_config))
    out = tmp_path / "hf"
    code = cli.main(["export", f"s3://{bucket}/run/step-8", "--to-safetensors", str(out), "--only", "model.",
                     "--strip-prefix", "model.", "-q"])
    assert code == 0, capsys.readouterr().err
    model = training_state()["model"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(model)  # "model.embed.weight" -> "embed.weight"
    loaded = load_file(out / "model-00001-of-00001.safetensors")
    for k, v in model.items():
        assert_bitwise(loaded[k], v, k)


def test_export_cli_json(capsys, monkeypatch, s3_server, bucket, s3_config, tmp_path):
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    dcp.save(training_state(), storage_writer=S3StorageWriter(f"s3://{bucket}/run/step-7", config=s3_config))
    capsys.readouterr()
    code = cli.main(["export", f"s3://{bucket}/run/step-7", "--to-safetensors", str(tmp_path / "o"),
                     "--only", "model.", "--only", "optim.", "--shard-size", "200kB", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    summary = json.loads(out)
    assert summary["tensors"] == 5 and summary["skipped"] == ["optim.lr", "step"]  # non-tensor, filtered out
    assert [f["name"] for f in summary["files"]] == [f"model-0000{i}-of-00002.safetensors" for i in (1, 2)]
    code = cli.main(["export", f"s3://{bucket}/run/step-7", "--to-safetensors", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 1 and "pass --force to replace it" in err and "overwrite=True" not in err, err
    code = cli.main(["export", f"s3://{bucket}/run/step-7", "--to-safetensors", str(tmp_path / "p"),
                     "--shard-size", "lots"])
    assert code == 2


_BLOCKER = textwrap.dedent("""
    # sitecustomize: this interpreter has neither optional extra installed
    import sys

    class _NotInstalled:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("safetensors", "torchsnapshot"):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, _NotInstalled())
""")

_WITHOUT_EXTRAS_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    import torch.distributed.checkpoint as dcp
    for name in ("safetensors", "torchsnapshot"):
        try:
            __import__(name)
        except ImportError:
            pass
        else:
            raise SystemExit(f"{name} is importable: the blocker does not work")
    import s3dcp, s3dcp.cli
    from s3dcp import S3Config, S3SafetensorsReader, S3StorageReader, S3StorageWriter
    cfg = S3Config(**json.loads(sys.argv[1]))
    state = {"w": torch.arange(10.0), "step": 3}
    dcp.save(state, storage_writer=S3StorageWriter(sys.argv[2], config=cfg))
    back = {"w": torch.zeros(10), "step": 0}
    dcp.load(back, storage_reader=S3StorageReader(sys.argv[2], config=cfg))
    assert torch.equal(back["w"], state["w"]) and back["step"] == 3, back
    print("ok")
""")


def _without_extras(tmp_path) -> dict:
    """The environment of a subprocess in which ``safetensors`` and ``torchsnapshot`` cannot be
    imported (a sitecustomize puts a blocker first on sys.meta_path)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_BLOCKER)
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), os.getcwd()]))


def test_s3dcp_works_without_the_optional_extras(s3_config, bucket, tmp_path):
    cfg = {k: getattr(s3_config, k) for k in ("endpoint_url", "region", "access_key_id", "secret_access_key")}
    result = subprocess.run([sys.executable, "-c", _WITHOUT_EXTRAS_SCRIPT, json.dumps(cfg), f"s3://{bucket}/plain"],
                            capture_output=True, text=True, timeout=120, env=_without_extras(tmp_path))
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def test_export_without_safetensors_says_what_to_install_and_creates_nothing(s3_server, s3_config, bucket,
                                                                            tmp_path):
    dcp.save(training_state(), storage_writer=S3StorageWriter(f"s3://{bucket}/run/step-1", config=s3_config))
    dest = tmp_path / "hf"
    env = _without_extras(tmp_path)
    env.update(s3_server.env())
    result = subprocess.run([sys.executable, "-m", "s3dcp.cli", "export", f"s3://{bucket}/run/step-1",
                             "--to-safetensors", str(dest)], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "pip install 's3dcp[safetensors]'" in result.stderr, result.stderr
    assert not dest.exists()


_MEMORY_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    from s3dcp.config import S3Config
    from s3dcp.s3.client import S3Client
    from s3dcp.interop.export import export_safetensors
    import s3dcp.loading.reader, safetensors.torch  # imported by the export: not part of what it holds
    cfg = S3Config(**json.loads(sys.argv[1]))
    client = S3Client(cfg)
    client.list(cfg_bucket := sys.argv[2]).result()  # the CRT client exists before the baseline
    def status_mib(field):
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith(field + ":")) / 1024
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current resident size
    base = status_mib("VmHWM")
    report = export_safetensors(f"s3://{cfg_bucket}/big", sys.argv[3], client=client,
                                window_bytes=int(sys.argv[4]), shard_size_bytes=int(sys.argv[5]))
    print(json.dumps({"base_mib": base, "peak_mib": status_mib("VmHWM"), "buffered": report.peak_buffered_bytes,
                      "bytes": report.tensor_bytes, "files": len(report.files)}))
""")


def test_export_memory_is_bounded_by_the_largest_tensor_plus_the_window(bucket, s3_config, tmp_path):
    """16 tensors of 4 MiB (64 MiB, one shard file), window one tensor: the export process's peak
    resident memory grows by about one tensor plus the CRT's download buffers, not by the model."""
    g = torch.Generator().manual_seed(0)
    tensor_bytes = 4 * 2**20
    state = {f"layer{i}.weight": torch.randn(tensor_bytes // 4, generator=g).view(1024, -1) for i in range(16)}
    dcp.save(state, storage_writer=S3StorageWriter(f"s3://{bucket}/big", config=s3_config))
    del state
    cfg = {k: getattr(s3_config, k) for k in ("endpoint_url", "region", "access_key_id", "secret_access_key")}
    result = subprocess.run(
        [sys.executable, "-c", _MEMORY_SCRIPT, json.dumps(cfg), bucket, str(tmp_path / "out"),
         str(tensor_bytes), str(10**9)],
        capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert result.returncode == 0, result.stderr[-3000:]
    m = json.loads(result.stdout.strip().splitlines()[-1])
    assert m["files"] == 1 and m["bytes"] == 16 * tensor_bytes
    assert m["buffered"] <= tensor_bytes  # window = one tensor: one at a time
    grown_mib = m["peak_mib"] - m["base_mib"]
    print(f"export of {m['bytes'] >> 20} MiB: process grew {grown_mib:.1f} MiB ({m})")
    # One tensor buffered plus the CRT's download buffers; the model is 64 MiB.
    assert grown_mib < 32, f"export grew by {grown_mib:.0f} MiB for a 64 MiB model ({m})"
    loaded = load_file(tmp_path / "out" / "model-00001-of-00001.safetensors")
    assert len(loaded) == 16


def test_ring_arena_hands_out_spans_first_in_first_out():
    from s3dcp.memory.ring_buffer import RingArena

    arena = RingArena(640)
    a, b = arena.allocate(256), arena.allocate(256)
    assert (a, b) == ((0, 256), (256, 512))
    assert arena.allocate(256) is None  # 128 left at the end, the start is taken
    arena.free(a)
    c = arena.allocate(200)  # wraps to the freed start
    assert c == (0, 256)
    assert arena.allocate(64) is None  # wrapped: only [256, 256) is free
    arena.free(b)
    assert arena.allocate(320) == (256, 576)
    assert arena.used_bytes == 256 + 320
    with pytest.raises(ValueError):
        arena.allocate(1000)
