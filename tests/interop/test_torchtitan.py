"""torchtitan's own checkpoint manager with an ``s3://`` folder (S3CheckpointManager), 2 gloo ranks,
a small FSDP2 model with torchtitan's optimizer, lr-scheduler and dataloader containers, against
the real server: async saves, retention counting committed checkpoints, incremental references,
resume bitwise, model-only export dtype at the last step, pinned-memory mode and load_step,
initial_load_path from S3, and the Hugging Face export at the end read back with initial_load_in_hf.
The example (``examples/torchtitan_s3.py`` under torchrun) is killed mid-run and resumes with the
same losses bit for bit.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import uuid

import pytest
import torch

if sys.version_info < (3, 11):  # torchtitan 0.3 needs 3.11; the [test] extra installs it from there on
    pytest.skip("torchtitan needs Python >= 3.11", allow_module_level=True)

from test_examples import EXAMPLES, _env, _losses, _no_warnings  # noqa: E402
from test_multiprocess import Job, _assert_bitwise, run_jobs  # noqa: E402

pytestmark = pytest.mark.multiproc

WORLD = 2
STEPS = 6  # saves at 2, 4, 6 (interval 2)


# ------------------------------------------------------------------ the job (runs in each rank)
def _tiny():
    import torch.nn as nn

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 32)
            self.b = nn.Linear(32, 4)
            self.register_buffer("table", torch.arange(64.0).reshape(8, 8) / 64)  # never changes

        def forward(self, x):
            return self.b(torch.relu(self.a(x @ self.table)))

    return Tiny()


class _Steps:
    """The trainer's own state (torchtitan passes ``states={"train_state": trainer}``)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, sd: dict) -> None:
        self.step = int(sd["step"])


class _Adapter:
    """A state-dict adapter in the shape of torchtitan's: native names <-> "model."-prefixed ones."""

    fqn_to_index_mapping = None
    hf_assets_path = None

    def to_hf(self, sd):
        return {f"model.{k}": v for k, v in sd.items()}

    def from_hf(self, sd):
        return {k.removeprefix("model."): v for k, v in sd.items()}


def _components(rank: int, world: int, seed: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DistributedSampler, TensorDataset
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer, ParamGroupConfig

    torch.manual_seed(seed)
    model = _tiny()
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model.a, model.b):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizers = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})],
        implementation="for-loop").build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=20)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(96, 8, generator=g)
    data = TensorDataset(x, (x[:, :4] * 2).sin())
    loader = ParallelAwareDataloader(data, dp_rank=rank, dp_world_size=world, batch_size=4,
                                     sampler=DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False))
    return model, optimizers, schedulers, loader


def _manager(folder: str, cfg, components, steps: _Steps, **settings):
    from s3dcp.interop.torchtitan import S3CheckpointManager

    model, optimizers, schedulers, loader = components
    config = S3CheckpointManager.Config(enable=True, folder=folder, **settings)
    return config.build(dataloader=loader, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
                        states={"train_state": steps}, sd_adapter=_Adapter(), base_folder="/unused",
                        s3_config=cfg)


def _train(components, batches, steps: _Steps, manager, until: int) -> list[str]:
    model, optimizers, schedulers, _ = components
    losses = []
    while steps.step < until:
        steps.step += 1
        x, y = next(batches)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if manager is not None:  # as torchtitan's trainer: async_with_pinned_mem stages in the background
            manager.maybe_wait_for_staging()
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        losses.append(loss.item().hex())
        if manager is not None:
            manager.save(steps.step)
    return losses


def _snapshot(components, steps: _Steps) -> dict:
    model, optimizers, schedulers, loader = components
    return {"model": {k: v.full_tensor().clone() if hasattr(v, "full_tensor") else v.clone()
                      for k, v in model.state_dict().items()},
            "optim": {k: (v.full_tensor().clone() if hasattr(v, "full_tensor") else
                          v.clone() if isinstance(v, torch.Tensor) else v)
                      for k, v in optimizers.state_dict().items()},
            "lr": schedulers.state_dict(), "step": steps.step}


def _assert_same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), (what, a.keys(), b.keys())
    for k in a:
        if isinstance(a[k], dict):
            _assert_same(a[k], b[k], f"{what}.{k}")
        elif isinstance(a[k], torch.Tensor):
            _assert_bitwise(b[k], a[k], f"{what}.{k}")
        else:
            assert a[k] == b[k], (f"{what}.{k}", a[k], b[k])


def _committed(cfg, folder: str) -> list[int]:
    from s3dcp import CheckpointManager

    return [i.step for i in CheckpointManager(folder, config=cfg, name_format="step-{step}").list() if i.committed]


@contextlib.contextmanager
def _titan_lines():
    """The s3dcp lines of torchtitan's log (its root logger, at INFO) while the block runs."""
    import logging

    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.INFO)
    root.addHandler(handler)
    try:
        yield lines
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        lines[:] = [line for line in lines if line.startswith("s3dcp: checkpoint step")]


def _worker(rank: int, world: int, bucket: str, cfg) -> dict:
    import torch.distributed as dist
    from safetensors.torch import load as load_safetensors

    from s3dcp import S3StorageReader
    from s3dcp.s3.client import S3Client

    out: dict = {}
    run = f"s3://{bucket}/run"

    # 1. async saves every 2 steps, 2 kept, incremental: then the state is remembered
    steps = _Steps()
    first = _components(rank, world, seed=0)
    batches = iter(first[3])
    m1 = _manager(run, cfg, first, steps, interval=2, async_mode="async", keep_latest_k=2, incremental=True,
                  last_save_model_only=True, export_dtype="bfloat16")
    out["losses"] = _train(first, batches, steps, m1, STEPS)
    m1.maybe_wait_for_saving()
    saved = _snapshot(first, steps)
    next_batch = next(batches)
    writer = m1._s3.last_writer  # the save of step 6 (incremental on step 4)
    out["inherited_bytes"] = writer.last_stats.inherited_bytes
    dist.barrier()
    out["kept"] = _committed(cfg, run)

    # 2. a new job's components (another init) resume from step 6: every state bitwise
    steps2 = _Steps()
    second = _components(rank, world, seed=1)
    m2 = _manager(run, cfg, second, steps2, interval=2, async_mode="async", keep_latest_k=2, incremental=True)
    assert m2.load() is True
    _assert_same(saved, _snapshot(second, steps2), "resumed")
    batches2 = iter(second[3])
    resumed_batch = next(batches2)
    for a, b in zip(next_batch, resumed_batch):  # the dataloader resumes where it was
        _assert_bitwise(b, a, "next batch")
    m2.close()

    # 3. the last step: model only, in the export dtype (first job continues to step 8)
    _train(first, iter([next_batch, next(batches)]), steps, None, STEPS + 2)
    m1.save(STEPS + 2, last_step=True)
    m1.close()
    model_now = _snapshot(first, steps)["model"]
    dest = {k: torch.zeros(v.shape, dtype=torch.bfloat16) for k, v in model_now.items()}
    import torch.distributed.checkpoint as dcp

    dcp.load(dest, storage_reader=S3StorageReader(f"{run}/step-{STEPS + 2}", config=cfg))
    for k, v in model_now.items():
        _assert_bitwise(dest[k], v.to(torch.bfloat16), f"last step {k}")
    dist.barrier()
    out["kept_after_last"] = _committed(cfg, run)

    # 4. pinned-memory async mode, keep everything, and load_step picks an older step
    pinned = f"s3://{bucket}/pinned"
    steps3 = _Steps()
    third = _components(rank, world, seed=2)
    m3 = _manager(pinned, cfg, third, steps3, interval=1, async_mode="async_with_pinned_mem", keep_latest_k=0)
    assert m3._s3.config.staging == "background"  # torchtitan waits for staging_completion in this mode
    _train(third, iter(third[3]), steps3, m3, 1)
    after_one = _snapshot(third, steps3)
    _train(third, iter(third[3]), steps3, m3, 3)
    m3.maybe_wait_for_staging()
    m3.close()
    dist.barrier()
    out["pinned_kept"] = _committed(cfg, pinned)
    steps4 = _Steps()
    fourth = _components(rank, world, seed=3)
    m4 = _manager(pinned, cfg, fourth, steps4, async_mode="async_with_pinned_mem")
    assert m4.load(step=1) is True
    _assert_same(after_one, _snapshot(fourth, steps4), "load_step=1")
    with pytest.raises(FileNotFoundError, match="step-7"):  # s3dcp's CheckpointNotFoundError, as torchtitan's
        m4.load(step=7)
    m4.close()

    # 5. a new run's folder is empty: initial_load_path (s3://) gives the model only
    steps5 = _Steps()
    fifth = _components(rank, world, seed=4)
    m5 = _manager(f"s3://{bucket}/fresh", cfg, fifth, steps5, initial_load_path=f"{run}/step-{STEPS}",
                  initial_load_model_only=True)
    assert m5.load() is True
    _assert_same(saved["model"], _snapshot(fifth, steps5)["model"], "initial_load_path model")
    assert steps5.step == 0  # model only: the trainer's step was not loaded
    m5.close()

    # 6. last_save_in_hf: exported to safetensors in step-N, then read back by initial_load_in_hf
    hf_run = f"s3://{bucket}/hf"
    m6 = _manager(hf_run, cfg, fifth, steps5, last_save_in_hf=True)
    m6.save(1, last_step=True)
    m6.close()
    dist.barrier()
    client = S3Client(cfg)
    index = json.loads(bytes(client.get(bucket, "hf/step-1/model.safetensors.index.json").result()))
    out["hf_names"] = sorted(index["weight_map"])
    files = {name: load_safetensors(bytes(client.get(bucket, f"hf/step-1/{name}").result()))
             for name in set(index["weight_map"].values())}
    exported = {k: t for tensors in files.values() for k, t in tensors.items()}
    for k, v in saved["model"].items():
        _assert_bitwise(exported[f"model.{k}"], v, f"hf {k}")
    steps7 = _Steps()
    seventh = _components(rank, world, seed=5)
    m7 = _manager(f"s3://{bucket}/fresh2", cfg, seventh, steps7, initial_load_path=f"{hf_run}/step-1",
                  initial_load_in_hf=True)
    assert m7.load() is True
    _assert_same(saved["model"], _snapshot(seventh, steps7)["model"], "initial_load_in_hf")
    m7.close()

    # 7. the local tier from torchtitan's config: saves at 2 (S3 too) and 4 (the node only); a new
    #    job resumes from 4, read from the node's copies, nothing from S3
    import tempfile

    local = os.path.join(tempfile.gettempdir(), f"titan-local-{bucket}")
    tiered = f"s3://{bucket}/tiered"
    steps8 = _Steps()
    eighth = _components(rank, world, seed=6)
    m8 = _manager(tiered, cfg, eighth, steps8, interval=2, async_mode="async", local_dir=local, s3_every=2)
    with _titan_lines() as lines:  # where torchtitan's log says each step went
        _train(eighth, iter(eighth[3]), steps8, m8, 4)
        m8.maybe_wait_for_saving()
        m8.close()
    out["tiered_log"] = lines
    at_four = _snapshot(eighth, steps8)
    dist.barrier()
    out["tiered_in_s3"] = _committed(cfg, tiered)
    steps9 = _Steps()
    ninth = _components(rank, world, seed=7)
    m9 = _manager(tiered, cfg, ninth, steps9, local_dir=local, s3_every=2)
    assert m9.load() is True
    _assert_same(at_four, _snapshot(ninth, steps9), "resumed from the local tier")
    out["tiered_stats"] = m9._s3.last_load_stats
    m9.close()

    # 8. a seed checkpoint (step 0: the model only) with the local tier: resumed model-only, as
    #    torchtitan does (the whole state's keys would be missing from it)
    seeded, seed_local = f"s3://{bucket}/seeded", f"{local}-seed"
    m10 = _manager(seeded, cfg, eighth, _Steps(), local_dir=seed_local, last_save_model_only=True)
    m10.save(0, last_step=True)
    m10.close()
    dist.barrier()
    steps11 = _Steps()
    eleventh = _components(rank, world, seed=8)
    m11 = _manager(seeded, cfg, eleventh, steps11, local_dir=seed_local)
    assert m11.load() is True
    _assert_same(at_four["model"], _snapshot(eleventh, steps11)["model"], "seed checkpoint")
    assert steps11.step == 0 and m11._s3.last_load_stats["step"] == 0
    m11.close()
    dist.barrier()
    if rank == 0:
        import shutil

        for directory in (local, seed_local):
            shutil.rmtree(directory, ignore_errors=True)
    return out


@pytest.fixture(scope="module")
def titan_job(s3_server, tmp_path_factory):
    bucket = f"titan-{uuid.uuid4().hex[:10]}"
    s3_server.create_bucket(bucket)
    job = Job("titan", _worker, WORLD, (bucket, s3_server.s3_config()))
    run_jobs(tmp_path_factory.mktemp("titan"), job)
    return job.results


def test_saves_resume_bitwise_keep_two_committed_and_reference_unchanged_items(titan_job):
    r0, r1 = titan_job  # each rank compared its resumed state with the saved one, bitwise
    assert len(r0["losses"]) == len(r1["losses"]) == STEPS and r0["losses"] != r1["losses"]  # its own batches
    assert r0["kept"] == [4, 6]  # keep_latest_k=2 of the committed 2, 4, 6
    # the unchanged buffer (replicated: DCP gives it to one rank) is a reference to step 4, not uploaded
    assert sum(r["inherited_bytes"] for r in titan_job) >= 8 * 8 * 4, [r["inherited_bytes"] for r in titan_job]


def test_last_step_is_model_only_in_export_dtype_and_counts_for_retention(titan_job):
    assert titan_job[0]["kept_after_last"] == [6, 8]


def test_pinned_mode_keeps_every_checkpoint_when_keep_latest_k_is_zero(titan_job):
    assert titan_job[0]["pinned_kept"] == [1, 2, 3]


def test_the_local_tier_from_torchtitans_config_resumes_from_the_nodes_copy(titan_job):
    for r in titan_job:
        assert r["tiered_in_s3"] == [2]  # s3_every=2: step 4 stayed on the node
        stats = r["tiered_stats"]
        assert stats["step"] == 4 and stats["tier"] == "local" and stats["job_bytes"]["s3"] == 0, stats
        # the log says where each step is: step 4 was logged "committed to s3://…/step-4" too
        two, four = r["tiered_log"]
        assert two.startswith("s3dcp: checkpoint step 2 committed to s3://") and "/tiered/step-2 (and kept on the " \
            "node, " in two, two
        assert four.startswith("s3dcp: checkpoint step 4 kept on the node (") and "step-4), not in S3: this rank " \
            "wrote " in four and "s3://" not in four, four


def test_config_refuses_incremental_with_local_dir_and_local_settings_without_it():
    from s3dcp.interop.torchtitan import S3CheckpointManager

    with pytest.raises(ValueError, match=r"checkpoint.incremental=True and checkpoint.local_dir cannot go together"):
        S3CheckpointManager.Config(enable=True, folder="s3://b/run", incremental=True, local_dir="/dev/shm/run")
    # these did nothing without local_dir (every step went to S3)
    with pytest.raises(ValueError, match=r"checkpoint.s3_every=3, local_replicas=1 is a setting of the local tier: "
                                         r"it needs checkpoint.local_dir"):
        S3CheckpointManager.Config(enable=True, folder="s3://b/run", s3_every=3, local_replicas=1)
    S3CheckpointManager.Config(enable=True, folder="s3://b/run", local_dir="/dev/shm/run", s3_every=3)


def test_hf_export_at_the_end_has_the_adapters_names(titan_job):
    assert titan_job[0]["hf_names"] == ["model.a.bias", "model.a.weight", "model.b.bias", "model.b.weight",
                                        "model.table"]


def test_example_is_killed_and_resumes_with_identical_losses(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                os.path.join(EXAMPLES, "torchtitan_s3.py"), "--server-dir", str(tmp_path / "data"),
                "--steps", "6", "--interval", "2"]
    crashed = subprocess.run([*torchrun, "--crash-at-step", "5", "--loss-log", str(tmp_path / "first.jsonl")],
                             capture_output=True, text=True, env=_env(), timeout=300, cwd=tmp_path)
    assert crashed.returncode != 0 and "killed at step 5" in crashed.stderr, crashed.stdout + crashed.stderr
    first = {r["step"]: r["loss"] for r in _losses(tmp_path / "first.jsonl")}
    assert sorted(first) == list(range(1, 6))
    resumed = subprocess.run([*torchrun, "--loss-log", str(tmp_path / "second.jsonl")],
                             capture_output=True, text=True, env=_env(), timeout=300, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    second = _losses(tmp_path / "second.jsonl")
    start = second[0]["resumed_from"]
    assert start in (2, 4), start  # step 4 may still have been uploading when the job was killed
    assert [r["step"] for r in second] == list(range(start + 1, 7))
    assert {r["step"]: r["loss"] for r in second if r["step"] <= 5} == {s: first[s] for s in range(start + 1, 6)}
    assert "s3dcp: checkpoint step 6 committed" in resumed.stdout + resumed.stderr
    _no_warnings(crashed.stdout + crashed.stderr)
    _no_warnings(resumed.stdout + resumed.stderr)  # the resume loads torchtitan's lr schedulers
    # once step 6 is saved, --crash-at-step 5 is never reached: it says so (it used to print "resumed
    # from step 6" and exit 0, neither training nor crashing)
    again = subprocess.run([*torchrun, "--crash-at-step", "5"], capture_output=True, text=True, env=_env(),
                           timeout=300, cwd=tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert ("# nothing left to train: s3://demo/torchtitan already holds step 6, and --steps is 6; --crash-at-step 5 "
            "is never reached") in again.stdout, again.stdout


def test_example_uses_a_configured_endpoint_and_the_local_tier(s3_server, demo_bucket, boto3_client, tmp_path):
    """With an endpoint configured and no --folder: s3://demo/torchtitan there (it used to exit 1). With
    --local-dir and --s3-every 2 (the example used to ask for incremental saves, which the local tier
    refuses): step 2 goes to S3, step 4 stays on the node, and the resumed job reads step 4 from there."""
    node = tmp_path / "node"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           os.path.join(EXAMPLES, "torchtitan_s3.py"), "--steps", "4", "--interval", "2",
                           "--local-dir", str(node), "--s3-every", "2"],
                          capture_output=True, text=True, env={**_env(), **s3_server.env()}, timeout=300, cwd=tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert f"# the configured S3 endpoint {s3_server.endpoint_url}; checkpoints under s3://demo/torchtitan" \
        in done.stdout
    assert not (tmp_path / "s3dcp-example-data").exists()  # no embedded server was started
    _no_warnings(out)
    steps = {o["Key"].split("/")[1] for o in boto3_client.list_objects_v2(Bucket="demo", Prefix="torchtitan/")
             .get("Contents", [])}
    assert steps == {"step-2"}, steps
    assert out.count("s3dcp: checkpoint step 2 committed to s3://demo/torchtitan/step-2 (and kept on the node, "
                     f"{node / 'step-2'})") == 2, out  # a line per rank
    assert out.count(f"s3dcp: checkpoint step 4 kept on the node ({node / 'step-4'}), not in S3") == 2, out
    assert "step 4 committed" not in out
    assert "Loaded step 4 from the local tier in " in out and "'s3': 0}" in out, out
    assert "# resumed at step 4: " in done.stdout and " tensors identical" in done.stdout, done.stdout
