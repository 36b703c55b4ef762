"""``s3dcp ls / verify / inspect --local-dir`` on a local-tier run (issue 39, row 7), against the
real server: the node's copies beside S3's, which step a restart takes (the same as
``CheckpointManager.load``), stale copies named with why (another save of a step, a step
``s3dcp rm`` deleted from S3), corrupt and incomplete copies, and ``local_dir`` read as
untrusted input. The copies are made by a CheckpointManager in this process (rank 0 alone)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from s3dcp import CheckpointManager, S3StorageWriter
from s3dcp.errors import CheckpointNotFoundError
from s3dcp.format.local import LocalMarker
from s3dcp.lifecycle.holdings import S3View, choose_save, stale_copies

from cli_run import run_cli
from forged_copy import forge


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4096, generator=g), "b": torch.randn(100, generator=g)}


def _manager(s3_config, run, local_dir, **kw):
    return CheckpointManager(run, config=s3_config, local_dir=local_dir, async_mode=False, s3_every=2,
                             local_keep_last=4, **kw)


@pytest.fixture
def tier_run(bucket, s3_config, tmp_path):
    """Steps 2 and 6 in S3 and on the node, 4 and 8 on the node only (s3_every=2)."""
    run, local_dir = f"s3://{bucket}/run", tmp_path / "node"
    m = _manager(s3_config, run, local_dir)
    for step in (2, 4, 6, 8):
        m.save(step, _state(step))
    m.close()
    return run, local_dir


def _restored(s3_config, run, local_dir) -> int:
    """The step CheckpointManager.load takes (what a restart does), its bytes checked."""
    m = _manager(s3_config, run, local_dir)
    out = {k: torch.zeros_like(v) for k, v in _state(0).items()}
    try:
        step = m.load(out)
    finally:
        m.close()
    assert all(torch.equal(out[k], v) for k, v in _state(step).items())
    return step


def _ls(capsys, run, local_dir):
    code, out, err = run_cli(capsys, "ls", "--json", run, "--local-dir", str(local_dir))
    assert code == 0, err
    return json.loads(out)


def _rows(report):
    return [(r["step"], r["s3"], r["state"]) for r in report["local_copies"]]


def _copy(local_dir, step, rank=0) -> Path:
    return Path(local_dir) / f"step-{step:08d}" / f"rank-{rank}"


def _rewrite_marker(copy: Path, **changes) -> None:
    path = copy / ".local-commit"
    path.write_bytes(dataclasses.replace(LocalMarker.decode(path.read_bytes(), str(path)), **changes).encode())


def test_ls_shows_the_nodes_copies_and_the_step_a_restart_takes(capsys, tier_run, s3_config, bucket):
    run, local_dir = tier_run
    report = _ls(capsys, run, local_dir)
    assert [r["name"] for r in report["checkpoints"]] == ["step-00000002", "step-00000006"]
    assert _rows(report) == [(2, "committed", "complete"), (4, "not sent", "complete"), (6, "committed", "complete"),
                             (8, "not sent", "complete")]
    for r in report["local_copies"]:
        files = sorted(_copy(local_dir, r["step"]).glob("__*"))
        assert r["ranks"] == [0] and r["world_size"] == 1 and r["bytes"] == sum(f.stat().st_size for f in files)
        assert r["save_id"] in files[0].name and r["uri"] == f"{run}/step-{r['step']:08d}"
    assert [(r["step"], r["from"]) for r in report["restart"]] == [(8, "nodes")]
    assert _restored(s3_config, run, local_dir) == 8  # what ls said a restart takes

    code, out, err = run_cli(capsys, "ls", f"s3://{bucket}/", "--local-dir", str(local_dir))
    assert code == 0, err
    assert f"{run}/  (2 checkpoint(s), " in out and "latest in S3: step 6)" in out
    assert "restart: step 8 from the nodes' copies (not in S3)" in out
    assert "step-00000004  4     " in out and "not sent" in out
    code, out, _ = run_cli(capsys, "ls", "--json", run)  # without --local-dir: the S3 rows, as before
    assert code == 0 and [r["name"] for r in json.loads(out)] == ["step-00000002", "step-00000006"]


def test_rm_of_an_s3_step_leaves_its_copies_which_no_restore_takes(capsys, tier_run, s3_config):
    """``s3dcp rm`` deletes S3's checkpoint, not the nodes' files: ls names them stale, and the
    restart ls announces is the one load() makes, also once it falls back to S3."""
    run, local_dir = tier_run
    code, _, err = run_cli(capsys, "rm", f"{run}/step-00000006", "--yes")
    assert code == 0, err
    assert _copy(local_dir, 6).is_dir()  # the node's copy stays (retention on the node removes it)
    report = _ls(capsys, run, local_dir)
    assert (6, "deleted", "stale") in _rows(report)
    assert [r["why"] for r in report["local_copies"] if r["step"] == 6] == [
        "step 6 went to S3 and was deleted there since"]
    assert report["restart"][0]["step"] == 8 == _restored(s3_config, run, local_dir)

    # step 8 now a 2-rank save of which this node holds rank 0; step 4 gone from the node
    _rewrite_marker(_copy(local_dir, 8), world_size=2)
    for f in sorted(_copy(local_dir, 4).iterdir()):
        f.unlink()
    _copy(local_dir, 4).rmdir()
    report = _ls(capsys, run, local_dir)
    assert _rows(report) == [(2, "committed", "complete"), (6, "deleted", "stale"), (8, "not sent", "partial")]
    s3_save = report["local_copies"][0]["save_id"]
    assert report["restart"][0] | {"text": None} == {"run": run, "step": 2, "save_id": s3_save, "from": "s3",
                                                    "text": None}
    assert report["restart"][0]["text"] == (
        "restart: step 2 from S3 (read from this node's copies); this node holds part of step 8 (ranks 0 of 2): "
        "other nodes may hold the rest, and then a restart takes that step")
    assert _restored(s3_config, run, local_dir) == 2
    code, out, _ = run_cli(capsys, "ls", run, "--local-dir", str(local_dir))
    assert "step-00000008  8     " in out and "0 of 2" in out and "partial" in out
    assert "# step-00000006 (save " in out and "step 6 went to S3 and was deleted there since" in out

    assert run_cli(capsys, "rm", f"{run}/step-00000002", "--yes")[0] == 0  # S3 holds nothing of the run now
    code, out, _ = run_cli(capsys, "ls", run.rpartition("/")[0], "--local-dir", str(local_dir))
    assert f"{run}/  (no checkpoint in S3)" in out
    assert "restart: no step: S3 holds none of this run and this node no save in full; this node holds part " \
           "of step 8 (ranks 0 of 2)" in out
    with pytest.raises(CheckpointNotFoundError):
        _restored(s3_config, run, local_dir)


def test_a_copy_of_another_save_than_s3_s_is_stale(capsys, tier_run, s3_config):
    """Step 2 deleted from S3 and saved there again (another save): the node's copy is of the
    old one: stale, checked against its own metadata by verify, which passes it."""
    run, local_dir = tier_run
    assert run_cli(capsys, "rm", f"{run}/step-00000002", "--yes")[0] == 0
    dcp.save(_state(99), storage_writer=S3StorageWriter(f"{run}/step-00000002", config=s3_config), no_dist=True)
    report = _ls(capsys, run, local_dir)
    assert (2, "another save", "stale") in _rows(report)
    assert [r["why"] for r in report["local_copies"] if r["step"] == 2] == [
        "another save of step 2 than the one S3 committed"]
    code, out, err = run_cli(capsys, "verify", "--json", f"{run}/step-00000002", "--local-dir", str(local_dir))
    result = json.loads(out)
    assert code == 0 and result["ok"], err
    assert [(c["against"], c["result"], c["stale"]) for c in result["copies"]] == [
        ("copy", "ok", "another save of step 2 than the one S3 committed")]
    assert result["s3_save_id"] != result["copies"][0]["save_id"]


def _forge(copy: Path, seed: int) -> None:
    forge(copy, "w", _state(seed)["w"])


def test_verify_names_corrupt_and_incomplete_copies(capsys, tier_run):
    run, local_dir = tier_run
    for step, against in ((8, "copy"), (6, "s3")):
        code, out, err = run_cli(capsys, "verify", f"{run}/step-{step:08d}", "--local-dir", str(local_dir))
        assert code == 0 and "OK: 1 copie(s)" in out and ("S3's .metadata" if against == "s3" else "its own") in out

    obj = next(_copy(local_dir, 8).glob("__*"))  # step 8: on the node only
    data = bytearray(obj.read_bytes())
    data[100] ^= 0xFF
    obj.write_bytes(bytes(data))
    code, out, err = run_cli(capsys, "verify", "--json", f"{run}/step-00000008", "--local-dir", str(local_dir))
    copy = json.loads(out)["copies"][0]
    assert code == 1 and (copy["against"], copy["result"]) == ("copy", "corrupt")
    assert copy["why"] == f"{obj.name}: the item at offset 0 does not match its checksum", copy
    code, out, err = run_cli(capsys, "verify", f"{run}/step-00000008", "--local-dir", str(local_dir))
    assert code == 1 and "corrupt: " in out and "rank 0: corrupt" in err

    _forge(_copy(local_dir, 6), seed=5)  # step 6: in S3, whose metadata is the truth
    code, out, err = run_cli(capsys, "verify", "--json", f"{run}/step-00000006", "--local-dir", str(local_dir))
    copy = json.loads(out)["copies"][0]
    assert code == 1 and (copy["against"], copy["result"]) == ("s3", "corrupt"), copy

    obj = next(_copy(local_dir, 4).glob("__*"))
    obj.write_bytes(obj.read_bytes()[:-1])
    code, out, err = run_cli(capsys, "verify", "--json", f"{run}/step-00000004", "--local-dir", str(local_dir))
    copy = json.loads(out)["copies"][0]
    assert code == 1 and copy["result"] == "incomplete" and "its marker says" in copy["why"], copy
    report = _ls(capsys, run, local_dir)
    assert (4, "not sent", "not used") in _rows(report)

    code, _, err = run_cli(capsys, "verify", f"{run}/step-00000010", "--local-dir", str(local_dir))
    assert code == 1 and "holds no copy of" in err and f"{run}/step-00000008" in err


def test_verify_of_a_copy_without_checksums_says_it_is_unchecked(capsys, bucket, s3_config, tmp_path):
    run, local_dir = f"s3://{bucket}/plain", tmp_path / "node"
    m = _manager(dataclasses.replace(s3_config, checksum=None), run, local_dir)
    m.save(1, _state(1))
    m.close()
    code, out, err = run_cli(capsys, "verify", "--json", f"{run}/step-00000001", "--local-dir", str(local_dir))
    copy = json.loads(out)["copies"][0]
    assert code == 1 and copy["result"] == "unchecked" and copy["why"].startswith("2 item(s) without a checksum")


def test_inspect_reads_a_step_kept_on_the_node(capsys, tier_run):
    run, local_dir = tier_run
    code, _, err = run_cli(capsys, "inspect", f"{run}/step-00000008")
    assert code == 1 and "no checkpoint at" in err
    code, out, err = run_cli(capsys, "inspect", "--json", f"{run}/step-00000008", "--local-dir", str(local_dir))
    report = json.loads(out)
    assert code == 0, err
    assert report["metadata_from"] == str(_copy(local_dir, 8) / ".metadata")
    assert sorted((t["fqn"], t["shape"]) for t in report["tensors"]) == [("b", [100]), ("w", [4096])]
    code, out, _ = run_cli(capsys, "inspect", "--json", f"{run}/step-00000006", "--local-dir", str(local_dir))
    assert code == 0 and "metadata_from" not in json.loads(out)  # in S3: S3's, as without --local-dir


def test_local_dir_is_read_as_untrusted_input(capsys, tier_run, tmp_path):
    """Links are not followed below local_dir, markers are read bounded, and what cannot be
    used is named; a --local-dir that is no directory is a usage error."""
    run, local_dir = tier_run
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "rank-0").mkdir(parents=True)
    for f in _copy(local_dir, 8).iterdir():
        (elsewhere / "rank-0" / f.name).write_bytes(f.read_bytes())
    os.symlink(elsewhere, local_dir / "step-00000010")  # a whole step, by a link
    os.makedirs(local_dir / "step-00000012")
    os.symlink(elsewhere / "rank-0", local_dir / "step-00000012" / "rank-0")  # a rank directory, by a link
    big = local_dir / "step-00000014" / "rank-0"
    big.mkdir(parents=True)
    (big / ".local-commit").write_bytes(b" " * (5 << 20))  # past the marker's 4 MiB bound
    linked = local_dir / "step-00000016" / "rank-0"
    linked.mkdir(parents=True)
    os.symlink(_copy(local_dir, 8) / ".local-commit", linked / ".local-commit")
    (local_dir / "step-00000018" / "rank-0").mkdir(parents=True)  # no marker: a save that died
    fifo = local_dir / "step-00000020" / "rank-0"
    fifo.mkdir(parents=True)
    os.mkfifo(fifo / ".local-commit")  # before: ls waited for a writer for ever
    report = _ls(capsys, run, local_dir)
    assert [r["step"] for r in report["local_copies"]] == [2, 4, 6, 8]
    unusable = {Path(u["path"]).parent.name: u["why"] for u in report["unusable"]}
    assert unusable.keys() == {"step-00000014", "step-00000016", "step-00000018", "step-00000020"}, unusable
    assert "not a regular file" in unusable["step-00000020"]
    assert "at most 4194304" in unusable["step-00000014"]
    assert "a link, not followed" in unusable["step-00000016"]
    assert unusable["step-00000018"].startswith("no marker")

    code, _, err = run_cli(capsys, "ls", run, "--local-dir", str(tmp_path / "nothing"))
    assert code == 2 and "is not a directory" in err


def _marker(step, save_id, rank, world, in_s3, saved_at):
    return LocalMarker(base="s3://b/run", step=step, save_id=save_id, rank=rank, world_size=world,
                       objects={f"__{rank}_0.{save_id}.distcp": 8}, in_s3=in_s3, saved_at=saved_at)


@pytest.mark.parametrize("case", ["deleted", "another save", "rolled back", "partial"])
def test_stale_copies_says_what_choose_save_says(case):
    """The copies a restore leaves out whatever step it takes (what `ls --local-dir` names), and the
    same ones choose_save names for the step it takes."""
    a = {(2, 0): _marker(2, "a2", 0, 1, True, 10.0), (4, 0): _marker(4, "a4", 0, 1, False, 20.0),
         (6, 0): _marker(6, "a6", 0, 1, True, 30.0)}
    reports, s3 = [("n0", a)], S3View(frozenset({2, 6}), {6: "a6", 2: "a2"})
    if case == "deleted":
        s3 = S3View(frozenset({2}), {2: "a2"})
    elif case == "another save":
        s3 = S3View(frozenset({2, 6}), {6: "b6"})
    elif case == "rolled back":  # step 4 saved again after step 6: 6 belongs to an abandoned line
        reports = [("n0", {**a, (4, 0): _marker(4, "c4", 0, 1, False, 40.0)})]
        s3 = S3View(frozenset({2}), {2: "a2"})
    else:
        reports = [("n0", {**a, (8, 0): _marker(8, "a8", 0, 2, False, 50.0)}), ("n1", {})]
    said = stale_copies(reports, s3)
    for step in (2, 4, 6, 8):
        choice = choose_save(reports, s3, wanted=step)
        if choice is not None:
            assert sorted(choice.ignored) == sorted((*k, why) for k, why in said.items() if k[1] == step), (case, step)
    expected = {"deleted": {("n0", 6, 0)}, "another save": {("n0", 6, 0)}, "rolled back": {("n0", 6, 0)},
                "partial": set()}[case]
    assert set(said) == expected
