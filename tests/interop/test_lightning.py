"""Lightning through s3dcp against the real server: S3CheckpointIO round trips a Lightning checkpoint
exactly (int keys, empty containers, hyper-parameters, dtypes), saves asynchronously, deletes only
after the saves in flight commit (never when one failed), references unchanged tensors
(incremental), works wrapped in Lightning's AsyncCheckpointIO; the fsspec view shows committed
checkpoints only; and the example runs ``Trainer.fit`` with DDP on 2 CPU processes, top-k and
``last``, then resumes from ``ckpt_path="last"``.
"""

from __future__ import annotations

import dataclasses
import io
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

from s3dcp.errors import ConfigError, IntegrityError, S3DCPError
from s3dcp.interop.lightning import S3CheckpointIO, S3ModelCheckpoint
from s3dcp.interop.lightning_fs import CheckpointFileSystem
from s3dcp.s3.client import S3Client

from test_examples import EXAMPLES, _env, _no_warnings
from test_multiprocess import _assert_tree_equal


def lightning_checkpoint(seed: int = 0) -> dict:
    """What Trainer.save_checkpoint hands a CheckpointIO, in miniature."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 32, generator=g)
    return {
        "epoch": 1, "global_step": 40, "pytorch-lightning_version": "2.6.6",
        "state_dict": {"net.0.weight": w, "net.0.bias": torch.randn(64, generator=g).bfloat16(),
                       "emb": torch.randint(0, 9, (5, 3), generator=g)},
        "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 2, "completed": 1}}}},
        "callbacks": {"ModelCheckpoint{'monitor': 'loss'}": {"best_model_score": torch.tensor(0.25),
                                                           "best_k_models": {}, "dirpath": "s3://b/run"}},
        "optimizer_states": [{"state": {0: {"step": torch.tensor(3.0), "exp_avg": w * 0.5}},
                              "param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), "params": [0]}]}],
        "lr_schedulers": [{"last_epoch": 3, "_last_lr": [0.01]}],
        "hparams_name": "kwargs", "hyper_parameters": {"width": 64, "layers": (2, 3), "name": None},
    }


def test_round_trip_is_exact_with_int_keys_empty_containers_and_dtypes(s3_config, uri):
    io = S3CheckpointIO(config=s3_config)
    ckpt = lightning_checkpoint()
    io.save_checkpoint(ckpt, f"{uri}/epoch=1-step=40.ckpt")
    back = io.load_checkpoint(f"{uri}/epoch=1-step=40.ckpt", weights_only=True)
    _assert_tree_equal(back, ckpt)
    assert list(back["optimizer_states"][0]["state"]) == [0]  # an int, as torch's Optimizer needs
    # the tensors are raw DCP items (verified on load), not pickled with the rest
    md = io.client.get(*_key(f"{uri}/epoch=1-step=40.ckpt/.metadata")).result()
    assert b"state_dict/net.0.weight" in bytes(md)


@pytest.mark.parametrize("async_save", [False, True])
def test_a_local_copy_is_loaded_from_the_node_and_a_corrupt_one_from_s3(s3_config, uri, bucket, boto3_client,
                                                                         tmp_path, caplog, async_save):
    io = S3CheckpointIO(config=s3_config, local_dir=tmp_path / "local", async_save=async_save)
    ckpt = lightning_checkpoint(3)
    path = f"{uri}/epoch=1-step=40.ckpt"
    io.save_checkpoint(ckpt, path)
    io.wait()
    copy = tmp_path / "local" / "epoch=1-step=40.ckpt" / "rank-0"
    assert (copy / ".local-commit").is_file()
    prefix = path.split("/", 3)[3] + "/"
    data = [o["Key"] for o in boto3_client.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]
            if o["Key"].endswith(".distcp")]
    saved = {k: boto3_client.get_object(Bucket=bucket, Key=k)["Body"].read() for k in data}
    for k in data:  # S3 no longer holds the data: only the node's copy can give it back
        boto3_client.delete_object(Bucket=bucket, Key=k)
    _assert_tree_equal(io.load_checkpoint(path, weights_only=True), ckpt)
    for k, body in saved.items():
        boto3_client.put_object(Bucket=bucket, Key=k, Body=body)
    damaged = next(copy.glob("*.distcp"))
    raw = bytearray(damaged.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    damaged.write_bytes(bytes(raw))
    with caplog.at_level("WARNING", logger="s3dcp"):
        _assert_tree_equal(io.load_checkpoint(path, weights_only=True), ckpt)
    assert any("local copy" in r.getMessage() and "loading it from S3" in r.getMessage() for r in caplog.records)
    raw[len(raw) // 2] ^= 0xFF  # the data intact again
    damaged.write_bytes(bytes(raw))
    (copy / ".metadata").write_bytes(b"\x80\x04 not a metadata")  # the copy's metadata garbled: S3's too
    caplog.clear()
    with caplog.at_level("WARNING", logger="s3dcp"):
        _assert_tree_equal(io.load_checkpoint(path, weights_only=True), ckpt)
    assert any("local copy" in r.getMessage() and "loading it from S3" in r.getMessage() for r in caplog.records)
    io.remove_checkpoint(path)
    io.wait()
    assert not (tmp_path / "local" / "epoch=1-step=40.ckpt").exists()


def test_s3_every_keeps_the_steps_between_on_the_node_and_loads_the_save_s3_agrees_with(
        s3_config, uri, bucket, boto3_client, tmp_path, caplog):
    """s3_every=2: checkpoint steps 2 and 6 go to S3 (the top-k file and last.ckpt alike), 4 and 8
    stay on the node, never in S3 nor shown by the view; a load takes the node's copy while it is
    the save S3 would give, else S3's (another node saved last.ckpt since: the node's copy is
    stale); the log and last_load_stats say where each save went and where each load came from."""
    node = tmp_path / "node"
    io = S3CheckpointIO(config=s3_config, local_dir=node, s3_every=2)
    saved = {}
    with caplog.at_level("INFO", logger="s3dcp"):
        for step in (2, 4, 6, 8):
            saved[step] = {**lightning_checkpoint(step), "global_step": step}
            io.save_checkpoint(saved[step], f"{uri}/epoch=0-step={step}.ckpt")
            io.save_checkpoint(saved[step], f"{uri}/last.ckpt")
    keys = [o["Key"] for o in boto3_client.list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert {k.split("/")[1] for k in keys} == {"epoch=0-step=2.ckpt", "epoch=0-step=6.ckpt", "last.ckpt"}, keys
    view = CheckpointFileSystem(s3_config)
    assert not view.exists(f"{uri}/epoch=0-step=4.ckpt") and view.exists(f"{uri}/epoch=0-step=6.ckpt")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("checkpoint step")]
    assert len(lines) == 8, lines
    saves = [(s, n) for s in (2, 4, 6, 8) for n in (f"epoch=0-step={s}.ckpt", "last.ckpt")]
    for line, (step, name) in zip(lines, saves):
        if step in (2, 6):
            assert line.startswith(f"checkpoint step {step} committed to {uri}/{name} (and kept on the node, "
                                   f"{node / name / 'rank-0'})"), line
        else:
            assert line.startswith(f"checkpoint step {step} kept on the node ({node / name / 'rank-0'}), not in S3 "
                                   "(s3_every=2)") and "committed" not in line, line
    assert lines[7].endswith(f"; S3's {uri}/last.ckpt is an earlier save"), lines[7]

    caplog.clear()
    with caplog.at_level("INFO", logger="s3dcp"):
        _assert_tree_equal(io.load_checkpoint(f"{uri}/last.ckpt"), saved[8])  # the node's, newer than S3's
    stats = io.last_load_stats
    assert (stats["step"], stats["tier"], stats["s3_bytes"]) == (8, "local", 0) and stats["local_bytes"] > 0, stats
    assert any(r.getMessage().startswith(f"restored {uri}/last.ckpt (step 8) from the node's copy (") and
               " bytes from the node's copy, 0 from S3, in " in r.getMessage() for r in caplog.records), caplog.text
    _assert_tree_equal(io.load_checkpoint(f"{uri}/epoch=0-step=4.ckpt"), saved[4])
    assert io.last_load_stats["tier"] == "local"
    # S3 out of reach (nothing listens there): the node's copy, with a warning that S3 was not asked
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    cut_off = S3CheckpointIO(config=dataclasses.replace(s3_config, endpoint_url=f"http://127.0.0.1:{port}",
                                                        max_retries=0, connect_timeout_s=1.0),
                             local_dir=node, s3_every=2)
    caplog.clear()
    with caplog.at_level("WARNING", logger="s3dcp"):
        _assert_tree_equal(cut_off.load_checkpoint(f"{uri}/last.ckpt"), saved[8])
    assert any("could not ask S3 which save of" in r.getMessage() for r in caplog.records), caplog.text
    assert cut_off.last_load_stats["tier"] == "local"
    cut_off.teardown()

    # a node-only copy found corrupt: S3's earlier save of that name, said so; with none in S3, an error
    damaged = next((node / "last.ckpt" / "rank-0").glob("*.distcp"))
    raw = bytearray(damaged.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    damaged.write_bytes(bytes(raw))
    with caplog.at_level("WARNING", logger="s3dcp"):
        _assert_tree_equal(io.load_checkpoint(f"{uri}/last.ckpt"), saved[6])
    assert any("kept on the node only (s3_every=2): loading S3's earlier save" in r.getMessage()
               for r in caplog.records), caplog.text
    assert io.last_load_stats["tier"] == "s3" and io.last_load_stats["step"] == 6
    raw[len(raw) // 2] ^= 0xFF
    damaged.write_bytes(bytes(raw))
    only = next((node / "epoch=0-step=4.ckpt" / "rank-0").glob("*.distcp"))
    only.write_bytes(b"\0" * only.stat().st_size)
    with pytest.raises(IntegrityError, match=r"kept on the node only \(s3_every=2\) and S3 holds no checkpoint"):
        io.load_checkpoint(f"{uri}/epoch=0-step=4.ckpt")
    io.remove_checkpoint(f"{uri}/epoch=0-step=4.ckpt")
    assert not (node / "epoch=0-step=4.ckpt").exists()

    # another node sends a newer last.ckpt to S3: this node's copy (made beside step 6's) is stale
    elsewhere = S3CheckpointIO(config=s3_config, local_dir=tmp_path / "other-node")
    io.last_load_stats = None
    saved[10] = {**lightning_checkpoint(10), "global_step": 10}
    elsewhere.save_checkpoint(saved[10], f"{uri}/last.ckpt")
    _assert_tree_equal(io.load_checkpoint(f"{uri}/last.ckpt"), saved[10])  # it used to load step 8's copy
    assert io.last_load_stats["tier"] == "s3" and io.last_load_stats["step"] == 10


def test_s3_every_and_local_dir_settings_are_checked():
    with pytest.raises(ConfigError, match=r"s3_every=3 keeps the other checkpoints on the node only: it needs "
                                          r"local_dir="):
        S3CheckpointIO(s3_every=3)
    with pytest.raises(ConfigError, match=r"s3_every=0 must be an int >= 1: 1 sends every checkpoint to S3"):
        S3CheckpointIO(local_dir="/dev/shm/x", s3_every=0)


def test_a_tensor_whose_declared_size_disagrees_with_its_stored_bytes_is_refused_before_allocating():
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                       TensorProperties, TensorStorageMetadata)

    from s3dcp.errors import MetadataFormatError
    from s3dcp.format.layout import ItemLocation
    from s3dcp.interop.lightning_dict import destinations

    huge = torch.Size([1 << 20, 1 << 20])  # 4 TiB of float32 declared, 16 bytes stored
    md = Metadata(state_dict_metadata={"w": TensorStorageMetadata(
        properties=TensorProperties(dtype=torch.float32), size=huge,
        chunks=[ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=huge)])},
        storage_data={MetadataIndex("w", torch.Size([0, 0])): ItemLocation("__0_0.x.distcp", 0, 16, None)})
    with pytest.raises(MetadataFormatError, match="'w' declares"):
        destinations(md, "s3://b/x.ckpt")


def test_async_save_removal_waits_for_the_commit_and_keeps_on_failure(s3_config, uri, s3_server):
    io = S3CheckpointIO(config=s3_config, async_save=True)
    fs = CheckpointFileSystem(s3_config)
    io.save_checkpoint(lightning_checkpoint(1), f"{uri}/a.ckpt")
    io.wait()
    live = lightning_checkpoint(2)
    expected = {k: v.clone() for k, v in live["state_dict"].items()}
    io.save_checkpoint(live, f"{uri}/b.ckpt")  # returns once staged
    io.remove_checkpoint(f"{uri}/a.ckpt")  # what ModelCheckpoint does right after a new top-k save
    live["state_dict"]["net.0.weight"].add_(1)  # training goes on: the save has its own copy
    io.teardown()
    assert not fs.exists(f"{uri}/a.ckpt") and fs.exists(f"{uri}/b.ckpt")
    _assert_tree_equal(io.load_checkpoint(f"{uri}/b.ckpt")["state_dict"], expected)

    # a save that fails (its bucket is gone) keeps the checkpoint whose removal came after it
    doomed = "s3://no-such-bucket-s3dcp/run"
    io.save_checkpoint(lightning_checkpoint(3), f"{doomed}/c.ckpt")
    io.remove_checkpoint(f"{uri}/b.ckpt")
    with pytest.raises(Exception, match="no-such-bucket-s3dcp"):
        io.teardown()
    assert fs.exists(f"{uri}/b.ckpt")


def test_incremental_last_after_top_k_uploads_nothing_unchanged_and_deletion_keeps_references(s3_config, uri):
    io = S3CheckpointIO(config=s3_config, incremental=True)
    ckpt = lightning_checkpoint(4)
    io.save_checkpoint(ckpt, f"{uri}/epoch=0-step=10.ckpt")
    io.save_checkpoint(ckpt, f"{uri}/last.ckpt")
    stats = io.last_stats
    tensor_bytes = sum(t.numel() * t.element_size() for t in _tensors(ckpt))
    # every tensor a reference; the pickled rest too, being the same bytes: nothing uploaded
    assert stats.inherited_items == len(_tensors(ckpt)) + 1 and stats.bytes == 0
    assert stats.inherited_bytes > tensor_bytes
    io.remove_checkpoint(f"{uri}/epoch=0-step=10.ckpt")  # its objects stay while last.ckpt uses them
    _assert_tree_equal(io.load_checkpoint(f"{uri}/last.ckpt"), ckpt)
    assert not CheckpointFileSystem(s3_config).isfile(f"{uri}/epoch=0-step=10.ckpt")  # no longer a checkpoint


def test_wrapped_in_lightnings_async_checkpoint_io(s3_config, uri):
    from pytorch_lightning.plugins.io import AsyncCheckpointIO

    io = AsyncCheckpointIO(S3CheckpointIO(config=s3_config))
    ckpt = lightning_checkpoint(5)
    io.save_checkpoint(ckpt, f"{uri}/x.ckpt")
    io.teardown()
    _assert_tree_equal(io.load_checkpoint(f"{uri}/x.ckpt"), ckpt)


def test_the_file_system_view_shows_committed_checkpoints_only(s3_config, uri, bucket, boto3_client):
    io = S3CheckpointIO(config=s3_config)
    io.save_checkpoint(lightning_checkpoint(), f"{uri}/last.ckpt")
    boto3_client.put_object(Bucket=bucket, Key="ckpt/last-v1.ckpt/__0_0.x.distcp", Body=b"partial")  # no .metadata
    boto3_client.put_object(Bucket=bucket, Key="ckpt/best_k_models.yaml", Body=b"{}")
    fs = CheckpointFileSystem(s3_config)
    listing = {e["name"]: e["type"] for e in fs.ls(uri)}
    assert listing == {f"{bucket}/ckpt/last.ckpt": "file", f"{bucket}/ckpt/last-v1.ckpt": "directory",
                       f"{bucket}/ckpt/best_k_models.yaml": "file"}
    assert fs.exists(f"{uri}/last.ckpt") and fs.isfile(f"{uri}/last.ckpt")
    assert not fs.isfile(f"{uri}/last-v1.ckpt")
    assert fs.modified(f"{uri}/last.ckpt").timestamp() > 0
    with pytest.raises(FileNotFoundError):
        fs.info(f"{uri}/nothing.ckpt")
    # S3ModelCheckpoint's "last" candidates: committed last*.ckpt only, as s3dcp:// URLs for the Trainer
    callback = S3ModelCheckpoint(dirpath=uri, config=s3_config, save_last=True)
    assert callback._find_last_checkpoints(trainer=None) == {f"s3dcp://{bucket}/ckpt/last.ckpt"}


class _Listed(S3Client):
    """An S3Client (real requests) that notes every key and common prefix its listings return."""

    def __init__(self, config):
        super().__init__(config)
        self.listed: list[str] = []

    def list(self, bucket, prefix="", **kwargs):
        f = super().list(bucket, prefix, **kwargs)
        objects, prefixes = f.result()
        self.listed += [o.key for o in objects] + prefixes
        return f


def test_the_file_system_view_lists_children_never_what_lies_inside_them(s3_config, uri, bucket, boto3_client):
    """ls and info cost what is asked about: a checkpoint's objects are never listed (before,
    both listed every object under the directory, O(objects in the run) per call)."""
    io = S3CheckpointIO(config=s3_config)
    io.save_checkpoint(lightning_checkpoint(), f"{uri}/last.ckpt")
    for i in range(30):  # a big checkpoint's objects, and a deep directory
        boto3_client.put_object(Bucket=bucket, Key=f"ckpt/last.ckpt/__{i}_0.distcp", Body=b"x")
        boto3_client.put_object(Bucket=bucket, Key=f"ckpt/runs/{i}/x", Body=b"x")
    boto3_client.put_object(Bucket=bucket, Key="ckpt/best_k_models.yaml", Body=b"{}")
    client = _Listed(s3_config)
    fs = CheckpointFileSystem(client=client)
    assert {e["name"]: e["type"] for e in fs.ls(uri)} == {
        f"{bucket}/ckpt/last.ckpt": "file", f"{bucket}/ckpt/runs": "directory",
        f"{bucket}/ckpt/best_k_models.yaml": "file"}
    assert fs.info(f"{uri}/last.ckpt")["type"] == "file" and fs.info(f"{uri}/runs")["type"] == "directory"
    assert fs.info(f"{uri}/best_k_models.yaml")["size"] == 2
    with pytest.raises(FileNotFoundError):
        fs.info(f"{uri}/last")  # a name that only starts another's
    assert sorted(set(client.listed)) == ["ckpt/best_k_models.yaml", "ckpt/last.ckpt/", "ckpt/runs/"], client.listed
    fs.close()  # a client passed in stays open
    assert client._use.native is not None
    client.close()


def test_the_plugin_the_callback_and_the_view_close_the_clients_they_made(s3_config, uri, bucket):
    io = S3CheckpointIO(config=s3_config)
    io.save_checkpoint(lightning_checkpoint(), f"{uri}/last.ckpt")
    assert io.client._use.native is not None
    io.teardown()
    assert io.client._use.native is None  # closed at the end of fit, not left to a finalizer
    assert io.load_checkpoint(f"{uri}/last.ckpt")["epoch"] == 1  # and usable again

    callback = S3ModelCheckpoint(dirpath=uri, config=s3_config, save_last=True)
    view = callback._fs
    for _ in range(2):  # one view (one client) for the callback's life, not one per look-up
        assert callback._find_last_checkpoints(trainer=None) == {f"s3dcp://{bucket}/ckpt/last.ckpt"}
        assert callback._fs is view
    assert view.client._use.native is not None
    callback.teardown(None, None, "fit")
    assert view.client._use.native is None

    fs = CheckpointFileSystem(s3_config)
    assert fs.isfile(f"{uri}/last.ckpt")
    fs.close()
    assert fs.client._use.native is None


def test_fit_with_s3_every_resumes_last_from_the_nodes_copy_bitwise(s3_config, uri, tmp_path):
    """Epoch-end checkpoints with s3_every=2: step 4 goes to S3, step 8 stays on the node (S3's
    last.ckpt is step 4's). ckpt_path="last" on the node resumes from step 8 and ends where an
    uninterrupted fit ends, bit for bit; the view never shows step 8."""
    import pytorch_lightning as pl

    def fit(max_epochs: int, io=None, ckpt_path=None, seed: int = 0):
        torch.manual_seed(seed)
        model = _Regressor()
        callbacks = [] if io is None else [S3ModelCheckpoint(config=s3_config, save_top_k=-1, save_last=True,
                                                             every_n_epochs=1)]
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=max_epochs, logger=False,
                             plugins=[io or S3CheckpointIO(config=s3_config)], default_root_dir=uri,
                             callbacks=callbacks, enable_checkpointing=bool(callbacks), enable_progress_bar=False,
                             enable_model_summary=False)
        trainer.fit(model, ckpt_path=ckpt_path)
        return model.state_dict()

    whole = fit(3)
    node = tmp_path / "node"
    fit(2, S3CheckpointIO(config=s3_config, async_save=True, local_dir=node, s3_every=2))
    view = CheckpointFileSystem(s3_config)
    names = sorted(os.path.basename(e["name"]) for e in view.ls(f"{uri}/checkpoints"))
    assert names == ["epoch=0-step=4.ckpt", "last.ckpt"], names
    resumed_io = S3CheckpointIO(config=s3_config, async_save=True, local_dir=node, s3_every=2)
    _assert_tree_equal(fit(3, resumed_io, ckpt_path="last", seed=7), whole)  # another init: the checkpoint decides
    stats = resumed_io.last_load_stats
    assert (stats["step"], stats["tier"], stats["s3_bytes"]) == (8, "local", 0), stats


def test_s3_every_is_refused_on_several_nodes():
    """Rank 0's node-only checkpoints are not on the other nodes: they would resume from S3's older one."""
    import pytorch_lightning as pl

    io = S3CheckpointIO(config=None, local_dir="/dev/shm/unused", s3_every=2)
    trainer = pl.Trainer(accelerator="cpu", devices=1, num_nodes=2, strategy="ddp", plugins=[io], logger=False,
                         default_root_dir="s3://b/run")
    with pytest.raises(ConfigError, match=r"keeps checkpoints on global rank 0's node only, and this job runs on 2 "
                                          r"nodes"):
        S3ModelCheckpoint(save_last=True).setup(trainer, None, "fit")


def test_fit_resumed_from_an_s3_path_ends_bitwise_where_an_uninterrupted_fit_ends(s3_config, uri):
    import pytorch_lightning as pl

    plugins = []

    def fit(max_epochs: int, ckpt_path=None, callbacks=(), seed: int = 0):
        torch.manual_seed(seed)
        model = _Regressor()
        plugins.append(S3CheckpointIO(config=s3_config, async_save=True))
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=max_epochs, logger=False,
                             plugins=plugins[-1:], default_root_dir=uri,
                             callbacks=list(callbacks), enable_checkpointing=bool(callbacks),
                             enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(model, ckpt_path=ckpt_path)
        return model.state_dict()

    whole = fit(2)
    fit(1, callbacks=[S3ModelCheckpoint(config=s3_config, save_top_k=-1, every_n_epochs=1)])
    assert plugins[-1].last_writer.config.staging == "blocking"  # background staging is opt-in, not the callback's
    # another init: only the checkpoint (weights, Adam's moments, the loop's position) can make them meet
    resumed = fit(2, ckpt_path=f"{uri}/checkpoints/epoch=0-step=4.ckpt", seed=7)
    _assert_tree_equal(resumed, whole)


@pytest.mark.multiproc
def test_example_fits_with_ddp_keeps_top_k_and_last_and_resumes_from_last(s3_server, tmp_path):
    bucket = "lightning-example"
    s3_server.create_bucket(bucket)
    env = {**_env(), **s3_server.env()}
    done = subprocess.run([sys.executable, os.path.join(EXAMPLES, "lightning_s3.py"), "--uri", f"s3://{bucket}/run",
                           "--width", "64"], capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    _no_warnings(out)  # DCP's "torch.distributed is disabled" too: saves and loads use a group of one rank
    assert "# last.ckpt: step 8, 6 tensors identical to the trained model" in out
    assert "Restored all states from the checkpoint at s3dcp://lightning-example/run/checkpoints/last.ckpt" in out
    assert "# resumed and trained to step 12" in out
    fs = CheckpointFileSystem(s3_server.s3_config())
    kept = sorted(os.path.basename(e["name"]) for e in fs.ls(f"s3://{bucket}/run/checkpoints") if e["type"] == "file")
    top_k = out.split("top-k ")[-1].splitlines()[0]  # of the resumed fit
    assert kept == sorted(["last.ckpt", *eval(top_k)]), (kept, top_k)  # noqa: S307 - our own print of a list


def test_an_async_save_opted_into_background_staging_overlaps_forward_and_backward_and_no_optimizer_step(
        s3_config, uri, monkeypatch):
    """With S3Config(staging="background") the plugin stages in the background: the next step's
    training_step (forward, in Lightning's closure) runs while the staging thread (slowed here)
    copies, no optimizer step runs during the copy, and every checkpoint loads as the weights of
    its step."""
    import pytorch_lightning as pl

    from s3dcp.saving import background

    steps, seen, saved, copying = [0], [], {}, []

    def seam(phase):
        if phase == "copying":
            seam.at = steps[0]
            time.sleep(0.5)  # a slow copy: an optimizer step that did not wait would land in it
        elif phase == "copied":
            seen.append(steps[0] - seam.at)

    monkeypatch.setattr(background, "_seam", seam)

    class Wide(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256))

        def training_step(self, batch, batch_idx):
            copying.append(any(not lease.landed.is_set() for lease in list(background._IN_FLIGHT)))
            return self.net(batch[0]).square().mean()

        def on_train_batch_end(self, outputs, batch, batch_idx):  # before the callback saves this step
            saved[self.global_step] = {k: v.clone() for k, v in self.state_dict().items()}

        def configure_optimizers(self):
            optimizer = torch.optim.Adam(self.parameters(), lr=1e-2)
            optimizer.register_step_post_hook(lambda *_: steps.__setitem__(0, steps[0] + 1))
            return optimizer

        def train_dataloader(self):
            x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=8)

    io = S3CheckpointIO(config=s3_config.replace(staging="background"), async_save=True)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, plugins=[io], default_root_dir=uri,
                         callbacks=[S3ModelCheckpoint(config=s3_config, save_top_k=-1, every_n_train_steps=1)],
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Wide())
    assert io.last_writer.config.staging == "background"
    assert seen == [0, 0, 0]  # three saves, no optimizer step while any of them copied
    assert copying == [False, True, True]  # steps 2 and 3 ran their forward while the last save copied
    for step in (1, 2, 3):
        loaded = io.load_checkpoint(f"{uri}/checkpoints/epoch=0-step={step}.ckpt")
        _assert_tree_equal(loaded["state_dict"], saved[step])


# ---------------------------------------------------------------------- helpers
def _Regressor():
    import pytorch_lightning as pl

    class Regressor(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-2)

        def train_dataloader(self):
            x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :2].sin()), batch_size=8)

    return Regressor()


def _key(uri: str) -> tuple[str, str]:
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return bucket, key


def _tensors(tree) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _tensors(v)]
    return []



@pytest.mark.multiproc
def test_example_uses_a_configured_endpoint_and_runs_again(s3_server, demo_bucket, tmp_path):
    """With an endpoint configured (as "Try it locally" leaves one) and no --root: s3://demo, a new
    run prefix each time (it used to exit 1 asking for --root)."""
    env = {**_env(), **s3_server.env()}
    roots = []
    for _ in range(2):  # a second run on the same store starts from nothing too
        done = subprocess.run([sys.executable, os.path.join(EXAMPLES, "lightning_s3.py"), "--width", "64"],
                              capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
        out = done.stdout + done.stderr
        assert done.returncode == 0, out
        _no_warnings(out)
        line = next(x for x in done.stdout.splitlines() if x.startswith("# the configured S3 endpoint"))
        assert line.startswith(f"# the configured S3 endpoint {s3_server.endpoint_url}; checkpoints under "
                               "s3://demo/lightning/"), line
        roots.append(line.rpartition(" ")[2])
        assert "# last.ckpt: step 8, 6 tensors identical to the trained model" in out
        assert "# resumed and trained to step 12" in out
        time.sleep(1.1)  # the run prefix has one-second resolution
    assert roots[0] != roots[1]


@pytest.mark.parametrize("async_save", [False, True])
def test_a_failed_save_leaves_no_local_copy(s3_config, tmp_path, async_save):
    io = S3CheckpointIO(config=s3_config, local_dir=tmp_path / "local", async_save=async_save)
    with pytest.raises(S3DCPError):
        io.save_checkpoint(lightning_checkpoint(3), "s3://no-such-bucket-here/run/epoch=0-step=1.ckpt")
        io.wait()
    assert not (tmp_path / "local" / "epoch=0-step=1.ckpt").exists()


def test_a_modules_ordered_state_dict_is_stored_as_raw_items_and_comes_back_ordered():
    """A LightningModule's state_dict is an OrderedDict: its tensors are items of their own, read
    straight into place on load (before, only plain dicts were walked, and the whole model was
    pickled into the rest item on the training thread)."""
    from collections import OrderedDict

    from s3dcp.interop.lightning_dict import REST, join, pickled, split

    model = torch.nn.Linear(4, 3)
    checkpoint = {"state_dict": model.state_dict(), "epoch": 2, "optimizer_states": [{"state": {}}]}
    tensors, rest = split(checkpoint)
    assert sorted(tensors) == ["state_dict/bias", "state_dict/weight"]
    assert torch.load(io.BytesIO(pickled(rest).numpy().tobytes()), weights_only=False)["epoch"] == 2
    back = join(rest, tensors)
    assert type(back["state_dict"]) is OrderedDict and list(back["state_dict"]) == ["weight", "bias"]
    assert all(torch.equal(back["state_dict"][k], v) for k, v in model.state_dict().items())
    assert REST not in tensors
