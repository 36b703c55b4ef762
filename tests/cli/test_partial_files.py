"""``s3dcp download`` and ``s3dcp export`` write each file under a fresh name of its own, made
exclusively, and rename it when complete: a symlink planted at the name they used to write
under (``DEST.partial``) leads nowhere."""

from __future__ import annotations

import os
import stat

import torch
from safetensors.torch import load_file

import s3dcp
from s3dcp.format.safetensors import INDEX_NAME, shard_file_name

from cli_run import run_cli


def _plant(path, victim) -> None:
    """A symlink at ``path`` to ``victim``, as a user who may write that directory would leave it."""
    victim.write_bytes(b"precious: not to be overwritten")
    os.symlink(victim, path)


def _regular(path) -> bool:
    return stat.S_ISREG(os.lstat(path).st_mode)


def test_download_never_writes_through_a_file_planted_at_its_partial_name(capsys, bucket, s3_config, tmp_path):
    """Before: torch.save wrote through the symlink at out.pt.partial into the victim, then the
    symlink itself was renamed onto out.pt."""
    uri = f"s3://{bucket}/run/step-1"
    state = {"w": torch.arange(1000, dtype=torch.float32)}
    s3dcp.save(state, uri, config=s3_config)
    out, victim = tmp_path / "out.pt", tmp_path / "victim"
    _plant(tmp_path / "out.pt.partial", victim)
    code, _, err = run_cli(capsys, "download", uri, "--to-torch-save", str(out))
    assert code == 0, err
    assert victim.read_bytes() == b"precious: not to be overwritten"
    assert _regular(out) and torch.equal(torch.load(out)["w"], state["w"])
    assert stat.S_IMODE(out.stat().st_mode) == 0o666 & ~_umask()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.pt", "out.pt.partial", "victim"]  # nothing else left


def test_export_never_writes_through_a_file_planted_at_its_partial_names(capsys, bucket, s3_config, tmp_path):
    """Before: safetensors' save_file wrote the shard through the symlink at
    model-00001-of-00001.safetensors.partial, and the index through the one at
    model.safetensors.index.json.partial, into the victims."""
    uri = f"s3://{bucket}/run/step-1"
    state = {"w": torch.arange(1000, dtype=torch.float32), "b": torch.ones(7)}
    s3dcp.save(state, uri, config=s3_config)
    dest = tmp_path / "hf"
    dest.mkdir()
    shard = shard_file_name(1, 1)
    victims = [tmp_path / "victim-shard", tmp_path / "victim-index"]
    _plant(dest / f"{shard}.partial", victims[0])
    _plant(dest / f"{INDEX_NAME}.partial", victims[1])
    code, _, err = run_cli(capsys, "export", uri, "--to-safetensors", str(dest))
    assert code == 0, err
    assert [v.read_bytes() for v in victims] == [b"precious: not to be overwritten"] * 2
    assert _regular(dest / shard) and _regular(dest / INDEX_NAME)
    loaded = load_file(dest / shard)
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["b"], state["b"])
    for name in (shard, INDEX_NAME):
        assert stat.S_IMODE((dest / name).stat().st_mode) == 0o666 & ~_umask()
    assert sorted(p.name for p in dest.iterdir()) == sorted([shard, INDEX_NAME, f"{shard}.partial",
                                                            f"{INDEX_NAME}.partial"])


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
