"""The torch-free decode (``decode_plain``) and DCP's (``decode_metadata``, built on it) say the same
thing about every object, and refuse the same objects with the same errors; the torch-free name
tables are the installed torch's. (The fuzzer, ``tests/format/test_fuzz.py``, compares both decodes
on every mutated object too.)"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from s3dcp.errors import MetadataFormatError
from s3dcp.format.metadata import decode_metadata, decode_plain, encode_metadata, names
from s3dcp.format.metadata.locations import check_item
from s3dcp.format.layout import ItemLocation

from test_fuzz import fuzz, seeds
from test_metadata import chunked_metadata, metadata, planner_metadata


def _agree(md, version):
    data = encode_metadata(md, version=version)
    for lazy in (True, False):
        fuzz.plain_matches(decode_plain(data), decode_metadata(data, lazy=lazy))


@pytest.mark.parametrize("version", [1, 2])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(md=metadata)
def test_random_metadata_decodes_the_same_both_ways(md, version):
    _agree(md, version)


@pytest.mark.parametrize("version", [1, 2])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(md=chunked_metadata())
def test_random_chunked_metadata_decodes_the_same_both_ways(md, version):
    _agree(md, version)


@pytest.mark.parametrize("version", [1, 2])
def test_real_checkpoints_decode_the_same_both_ways(version):
    _agree(planner_metadata()[0], version)
    for _, data, _ in seeds():
        fuzz.plain_matches(decode_plain(data), decode_metadata(data))


def test_the_comparison_can_fail():
    data = encode_metadata(planner_metadata()[0])
    md = decode_metadata(data)
    md.version = "something else"
    with pytest.raises(fuzz.Finding, match="dcp_version"):
        fuzz.plain_matches(decode_plain(data), md)


@pytest.mark.parametrize("cut", [0, 1, 17, -1])
def test_damaged_objects_are_refused_the_same_way(cut):
    for _, data, _ in seeds():
        damaged = data[:cut] if cut >= 0 else data[:-1]
        with pytest.raises(MetadataFormatError) as plain_error:
            decode_plain(damaged, source="x")
        with pytest.raises(MetadataFormatError) as dcp_error:
            decode_metadata(damaged, source="x")
        assert str(plain_error.value) == str(dcp_error.value) and str(plain_error.value).startswith("x: ")


def test_name_tables_are_the_installed_torchs():
    def table(kind):
        return {str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, kind)}

    assert names.DTYPE_SIZES == {name: dtype.itemsize for name, dtype in table(torch.dtype).items()}
    assert names.LAYOUTS == set(table(torch.layout))
    assert names.MEMORY_FORMATS == set(table(torch.memory_format))
    assert torch.__version__.startswith(names.TABLE_TORCH + ".")
    with pytest.raises(MetadataFormatError, match="unknown torch dtype 'float99'"):
        names.element_size("float99")
    with pytest.raises(MetadataFormatError, match="length 12 is not the 8 bytes"):
        check_item(ItemLocation("o", 0, 12, None, "bfloat16", (4,)), "item 'w'")


def test_the_plain_decode_does_not_import_torch():
    code = ("import sys; from s3dcp.format.metadata import decode_plain; "
            "md = decode_plain(sys.stdin.buffer.read()); "
            "print(len(md.state_dict), md.storage.n, 'torch' in sys.modules)")
    for _, data, md in seeds()[:2]:  # one rank, versions 2 and 1
        done = subprocess.run([sys.executable, "-c", code], input=data, capture_output=True, timeout=60)
        assert done.stdout.decode().split() == [str(len(md.state_dict_metadata)), str(len(md.storage_data)), "False"], \
            done.stderr.decode()


def test_a_dtype_newer_than_the_tables_is_read_through_the_installed_torch():
    """A torch newer than the tables may store a dtype they lack: the plain decode imports torch
    for that name alone (here: bfloat16 taken out of the tables in a fresh interpreter)."""
    code = ("import sys; from s3dcp.format.metadata import names; del names.DTYPE_SIZES['bfloat16']; "
            "before = 'torch' in sys.modules; size = names.element_size('bfloat16'); "
            "print(before, size, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["False", "2", "True"], done.stderr
