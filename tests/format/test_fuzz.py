"""The metadata fuzzer (benchmarks/fuzz.py) in CI: a bounded number of hypothesis examples over
real metadata objects of every shape, mutated as a hostile user would; every decode, validation
and lookup gives a result or an S3DCPError. ``python benchmarks/fuzz.py --minutes N`` runs long.
A few mutated objects are also loaded through a real S3 server: a load fills every tensor with
the saved values or fails with an S3DCPError."""

from __future__ import annotations

import functools
import importlib.util
import pathlib
import random
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import s3dcp
from s3dcp.errors import S3DCPError
from s3dcp.format.layout import METADATA_NAME


def _fuzz_module():
    module = sys.modules.get("fuzz")
    if module is None:
        path = pathlib.Path(__file__).parents[2] / "benchmarks" / "fuzz.py"
        spec = importlib.util.spec_from_file_location("fuzz", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["fuzz"] = module
        spec.loader.exec_module(module)
    return module


fuzz = _fuzz_module()


@functools.cache
def seeds():
    return fuzz.seeds()


class DrawSource(fuzz.Source):
    """The fuzzer's choices drawn from hypothesis, so a finding shrinks to a small mutation."""

    def __init__(self, data) -> None:
        self.data = data

    def integer(self, lo: int, hi: int) -> int:
        return self.data.draw(st.integers(lo, hi))


def test_seeds_are_real_checkpoints_of_every_shape_and_reach_every_consumer():
    names = [name for name, _, _ in seeds()]
    assert names == [f"{s}/{v}" for s in fuzz.SHAPES for v in ("v3", "v2", "v1")]
    for name, data, md in seeds():
        reached: set = set()
        assert fuzz.check(data, reached) == "accepted", name
        assert reached == set(fuzz.fuzz_consumers.CONSUMERS) - {"safetensors"}, (name, reached)
        assert s3dcp.format.metadata.decode_metadata(data, lazy=False) == md
    ((name, raw),) = fuzz.fuzz_consumers.safetensors_seeds()
    reached = set()
    assert fuzz.check_safetensors(raw, reached) == "accepted" and reached == {"safetensors"}


@settings(max_examples=1500, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
def test_mutated_metadata_decodes_or_is_refused(data):
    src = DrawSource(data)
    name, raw, _ = seeds()[data.draw(st.integers(0, len(seeds()) - 1), label="seed")]
    note(name)
    for _ in range(data.draw(st.integers(1, 3), label="edits")):
        raw, what = fuzz.mutate(src, raw)
        note(what)
    outcome = fuzz.check(raw)  # raises fuzz.Finding on anything but a result or a MetadataFormatError
    assert outcome != "safety-net", "refused only by decode's last-resort net: a named check is missing"


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
def test_mutated_safetensors_headers_parse_or_are_refused(data):
    src = DrawSource(data)
    ((_, raw),) = fuzz.fuzz_consumers.safetensors_seeds()
    for _ in range(data.draw(st.integers(1, 3), label="edits")):
        raw, what = fuzz.fuzz_consumers.mutate_safetensors(src, raw, fuzz._json_edit)
        note(what)
    fuzz.check_safetensors(raw)  # raises fuzz.Finding on anything but a result or an S3DCPError


class NewValues(fuzz.RandomSource):
    """Random choices, but every format-2 header edit writes new values for a column."""

    def integer(self, lo: int, hi: int) -> int:
        return 4 if lo == 0 and hi in (11, 12) else super().integer(lo, hi)


def test_the_fuzzer_never_generates_what_a_lying_count_declares():
    """An edit set a column's count to 2^40, a later one wrote new values for it "at its count":
    the fuzzer tried to allocate 8 TiB. It now writes at most MAX_GENERATED values (of at most 8
    bytes), and the decoder refuses the object before allocating what it declares."""
    raw = next(raw for name, raw, _ in seeds() if name == "one-rank/v2")
    src = NewValues(random.Random(5))
    for _ in range(40):
        header, body = fuzz._parts(raw)
        for entry in header["columns"].values():
            entry["count"] = 2**40
        edited, new_body, what = fuzz._v2_header_edit(src, header, body)
        assert len(new_body) - len(body) <= 8 * fuzz.MAX_GENERATED * 1.01, what  # zlib may grow random bytes
        assert fuzz.check(fuzz._pack(edited, new_body, raw[:8])) != "accepted", what


def test_the_fuzzer_flags_an_example_over_its_memory_budget(tmp_path):
    out = tmp_path / "fuzz.json"
    assert fuzz.main(["--examples", "5", "--seed", "3", "--tracemalloc", "--memory-mib", "0.001",
                      "--json", str(out)]) == 1
    import json

    report = json.loads(out.read_text())
    assert report["findings"] and all(f["error"].startswith("memory: +") for f in report["findings"]), report
    assert report["most_memory_bytes"] > 1024


def test_the_oracle_catches_an_internal_error(monkeypatch):
    """The fuzzer can fail: an internal error inside a decode is a finding, not a pass."""
    from s3dcp.format.metadata import plain_v2

    def broken(node, where):
        raise ZeroDivisionError("bug")

    v2_seed = next(raw for name, raw, _ in seeds() if name.endswith("/v2"))
    monkeypatch.setattr(plain_v2, "decode_tree", broken)  # inside the (one, torch-free) decoder
    with pytest.raises(fuzz.Finding, match="ZeroDivisionError"):
        fuzz.check(v2_seed)
    monkeypatch.undo()
    monkeypatch.setattr(fuzz, "decode_metadata", lambda data, source: (_ for _ in ()).throw(MemoryError()))
    with pytest.raises(fuzz.Finding, match="MemoryError"):  # in building DCP's classes
        fuzz.check(seeds()[0][1])
    monkeypatch.setattr(fuzz, "decode_metadata", lambda data, source: (_ for _ in ()).throw(
        s3dcp.errors.MetadataFormatError("refused otherwise")))
    with pytest.raises(fuzz.Finding, match="the DCP decode refused"):  # the two decodes disagree
        fuzz.check(seeds()[0][1])
    monkeypatch.undo()
    # in the consumers past the decoder: verify's checks, the reader's and export's planning, safetensors
    from s3dcp.format import safetensors
    from s3dcp.interop import export

    monkeypatch.setattr(fuzz.fuzz_consumers, "problems", lambda *a: 1 / 0)
    with pytest.raises(fuzz.Finding, match="verify.*ZeroDivisionError"):
        fuzz.check(seeds()[0][1])
    monkeypatch.undo()
    monkeypatch.setattr(export, "_select", lambda *a: 1 / 0)
    with pytest.raises(fuzz.Finding, match="export.*ZeroDivisionError"):
        fuzz.check(seeds()[0][1])
    monkeypatch.undo()
    monkeypatch.setattr(safetensors, "parse_header", lambda *a, **k: 1 / 0)
    with pytest.raises(fuzz.Finding, match="safetensors: ZeroDivisionError"):
        fuzz.check_safetensors(fuzz.fuzz_consumers.safetensors_seeds()[0][1])


# ---------------------------------------------------------------------------------------------
# Loads through a real server


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g).to(torch.bfloat16),
            "ids": torch.arange(50), "scale": torch.tensor(3.5, dtype=torch.float64), "step": 12}


def _fresh() -> dict:
    return {"w": torch.zeros(64, 32), "b": torch.zeros(32, dtype=torch.bfloat16), "ids": torch.zeros(50, dtype=torch.int64),
            "scale": torch.tensor(0.0, dtype=torch.float64), "step": 0}


LOAD_EXAMPLES = 40


def test_mutated_metadata_loads_correctly_or_fails_with_an_s3dcp_error(uri, bucket, s3_config, boto3_client):
    state = _state()
    s3dcp.save(state, uri, config=s3_config)
    key = uri.removeprefix(f"s3://{bucket}/") + "/" + METADATA_NAME
    original = boto3_client.get_object(Bucket=bucket, Key=key)["Body"].read()
    src = fuzz.RandomSource(random.Random(20261203))
    outcomes = []
    for i in range(LOAD_EXAMPLES):
        mutated, what = fuzz.mutate(src, original) if i else (original, "none: the saved object")
        boto3_client.put_object(Bucket=bucket, Key=key, Body=mutated)
        dest = _fresh()
        try:
            s3dcp.load(dest, uri, config=s3_config)
        except S3DCPError as e:
            outcomes.append(type(e).__name__)
            continue
        except RuntimeError as e:
            # A renamed fqn: the checkpoint no longer has a key the state dict asks for, and DCP's own
            # planner says so, as for any checkpoint without it. Nothing was loaded as a success.
            if "Missing key in checkpoint state_dict" not in str(e):
                raise
            outcomes.append("missing key")
            continue
        for name, value in state.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(dest[name], value), (i, what, name)
            else:
                assert dest[name] == value, (i, what, name)
        outcomes.append("loaded")
    assert outcomes[0] == "loaded" and len(outcomes) == LOAD_EXAMPLES, outcomes
