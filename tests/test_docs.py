"""The README and the pages in docs/ say what the code does: every S3Config field is in the
README's table, every command they show exists, and every command and snippet of the pages the
README links to runs as written against the session's server (``s3://bucket`` in a snippet
becomes a fresh bucket)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import tomllib

import pytest
import torch
import torch.distributed.checkpoint as dcp

import s3dcp
from s3dcp import CheckpointManager, S3StorageReader, S3StorageWriter, cli
from s3dcp.config import S3Config

from doc_pages import ROOT, all_blocks, aws_env, blocks, fresh_bucket, in_bucket, read, tiny_lightning_model  # noqa: F401

PAGES = ["docs/memory.md", "docs/incremental.md", "docs/format.md", "docs/interop.md", "docs/aws.md",
         "docs/troubleshooting.md", "docs/errors.md",
         "docs/benchmarks.md", "docs/trainers.md", "docs/compatibility.md", "docs/restore.md", "docs/restart.md",
         "docs/security.md"]


def test_every_s3config_field_is_in_the_configuration_table():
    text = read()
    table = text[text.index("| field | default | what |"):]
    table = table[:table.index("\n\n")]
    named = set(re.findall(r"`([a-z_0-9]+)`", "\n".join(line.split("|")[1] for line in table.splitlines()[2:])))
    assert {f.name for f in dataclasses.fields(S3Config)} - named == set()
    assert named - {f.name for f in dataclasses.fields(S3Config)} == set()


def test_every_command_the_readme_and_the_pages_show_exists(capsys):
    shown = set()
    for page in ["README.md", *PAGES]:
        shown |= set(re.findall(r"^(?:eval \"\$\()?s3dcp ([a-z]+)", read(page), flags=re.M))
        shown |= set(re.findall(r"`s3dcp ([a-z]+)[ `]", read(page)))
    assert {"ls", "server", "mb", "gc", "rm", "materialize", "inspect", "export", "verify"} <= shown
    for command in sorted(shown):
        assert cli.main([command, "--help"]) == 0, command
    capsys.readouterr()


def test_the_readme_links_every_page_and_every_link_resolves():
    readme = read()
    for page in PAGES:
        assert f"]({page})" in readme, page
    for page in ["README.md", *PAGES]:
        base = os.path.dirname(os.path.join(ROOT, page))
        for target in re.findall(r"\]\(([^)#]+)\)", read(page)):
            if "://" not in target:
                assert os.path.exists(os.path.join(base, target)), (page, target)


# Every fenced block of the pages, and the test below that runs it. A new block fails here until
# a test runs it.
RUN_BY = {
    "docs/memory.md": ["python"],                                 # test_the_cast_on_load_snippet
    "docs/incremental.md": ["python"],                            # test_the_incremental_snippet
    "docs/format.md": ["", "python", "python"],                   # test_the_bucket_layout, test_the_metadata_snippet
    "docs/interop.md": ["bash", "python", "python", "python", "bash"],  # the torchsnapshot, safetensors, export tests
    "docs/aws.md": [],
    "docs/troubleshooting.md": [],
    "docs/errors.md": [],
    "docs/benchmarks.md": [],
    "docs/trainers.md": ["", "python", "python", "python"],      # the trainers' tests
    "docs/compatibility.md": ["python"],                          # test_the_compat_settings
    "docs/restore.md": ["python", "text", "text"],                # test_the_cooperative_snippet; a diagram, a table
    "docs/restart.md": ["python"],                                # test_the_restart_snippet
    "docs/security.md": [],
}


def test_every_block_of_the_pages_is_run_by_a_test():
    assert {page: [lang for lang, _ in all_blocks(page)] for page in PAGES} == RUN_BY


# ------------------------------------------------------------------ docs/memory.md
def test_the_cast_on_load_snippet(aws_env, s3_server):
    (snippet,) = blocks("Loading a different sharding", "python", "docs/memory.md")
    bucket = fresh_bucket(s3_server)
    saved = torch.randn(4096, 4096)  # fp32, as the comment says
    s3dcp.save({"model": {"w": saved}}, f"s3://{bucket}/run7/step-1000")
    scope: dict = {}
    exec(in_bucket(snippet, bucket), scope)  # noqa: S102 - the page's own code
    assert scope["state"]["model"]["w"].dtype == torch.bfloat16
    assert torch.equal(scope["state"]["model"]["w"], saved.to(torch.bfloat16))
    assert scope["reader"].last_read_bytes >= saved.numel() * 4 and scope["reader"].last_read_s > 0


# ------------------------------------------------------------------ docs/incremental.md
def test_the_incremental_snippet(aws_env, s3_server):
    (snippet,) = blocks("Incremental checkpoints", "python", "docs/incremental.md")
    bucket = fresh_bucket(s3_server)
    frozen, lora = torch.randn(256, 256), torch.randn(8, 256)
    s3dcp.save({"frozen": frozen, "lora": lora}, f"s3://{bucket}/run7/step-1000", item_checksum="crc64nvme")
    state = {"frozen": frozen, "lora": lora + 1}
    scope = {"S3StorageWriter": S3StorageWriter, "CheckpointManager": CheckpointManager, "dcp": dcp,
             "cfg": S3Config(), "state_dict": state}
    exec(in_bucket(snippet, bucket), scope)  # noqa: S102
    stats = scope["w"].last_stats
    assert stats.inherited_bytes == frozen.numel() * 4 and 0 < stats.bytes < frozen.numel() * 4
    out = {"frozen": torch.zeros_like(frozen), "lora": torch.zeros_like(lora)}
    s3dcp.load(out, f"s3://{bucket}/run7/step-2000")
    assert torch.equal(out["frozen"], frozen) and torch.equal(out["lora"], lora + 1)
    scope["manager"].close()


# ------------------------------------------------------------------ docs/format.md
def test_the_bucket_layout(aws_env, s3_server, boto3_client):
    """The objects a save leaves are the ones the listing names (one rank here: ``__0_0.<id>.distcp``)."""
    layout = all_blocks("docs/format.md")[0][1]
    bucket = fresh_bucket(s3_server)
    s3dcp.save({"w": torch.ones(4)}, f"s3://{bucket}/run7/step-1000")
    keys = sorted(o["Key"] for o in boto3_client.list_objects_v2(Bucket=bucket)["Contents"])
    assert len(keys) == 2 and keys[0] == "run7/step-1000/.metadata", keys
    data = re.fullmatch(r"run7/step-1000/__0_0\.([0-9a-f]+)\.distcp", keys[1])
    assert data, keys
    lines = layout.splitlines()
    assert lines[0] == "s3://bucket/run7/step-1000/"
    named = [line.split()[0] for line in lines[1:]]
    shown = re.fullmatch(r"__0_0\.([0-9a-f]+)\.distcp", named[0])  # the page's save id: as long as a real one
    assert shown and len(shown.group(1)) == len(data.group(1)), (named[0], keys[1])
    assert ".metadata" in named and ".pending-references" in named


def test_the_metadata_snippet(aws_env, s3_server):
    snippet, format3 = blocks("Metadata at scale", "python", "docs/format.md")
    bucket = fresh_bucket(s3_server)
    s3dcp.save({"model": {"w": torch.randn(5, 3)}, "step": 7}, f"s3://{bucket}/run7/step-1000")
    md = S3StorageReader(f"s3://{bucket}/run7/step-1000").read_metadata()
    scope = {"md": md}
    exec(snippet, scope)  # noqa: S102 - its asserts are the check
    assert set(scope["md2"].state_dict_metadata) == set(md.state_dict_metadata)
    exec(format3, scope)  # noqa: S102 - the same checkpoint in format 3
    assert scope["small"] != scope["data"]


# ------------------------------------------------------------------ docs/interop.md
def _pyproject_extras() -> dict[str, str]:
    text = read("pyproject.toml")
    section = text[text.index("[project.optional-dependencies]"):]
    section = section[:section.index("\n[", 1)]
    return dict(re.findall(r"^(\w+) = (\[.*?\])", section, flags=re.M | re.S))


@pytest.fixture
def registered():
    """TorchSnapshot finds the s3dcp:// plugin as `pip install -e '.[torchsnapshot]'` declares it."""
    from ts_entry_point import entry_point_on_path

    with entry_point_on_path():
        yield


def test_the_torchsnapshot_snippets(aws_env, s3_server, registered):
    install, take, retake = blocks("TorchSnapshot", "bash", "docs/interop.md") + blocks(
        "TorchSnapshot", "python", "docs/interop.md")
    assert shlex.split(install, comments=True) == ["pip", "install", "-e", ".[torchsnapshot]"]
    assert "torchsnapshot" in _pyproject_extras()["torchsnapshot"]  # what CI installs with [test]
    assert "torchsnapshot" in _pyproject_extras()["test"]
    bucket = fresh_bucket(s3_server)
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 6)).sum().backward()
    optimizer.step()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    exec(in_bucket(take, bucket), {"model": model, "optimizer": optimizer})  # noqa: S102
    from torchsnapshot import Snapshot

    other = torch.nn.Linear(6, 3)
    Snapshot(f"s3dcp://{bucket}/run7/snap-1000").restore({"model": other})
    assert all(torch.equal(other.state_dict()[k], v) for k, v in saved.items())

    for _ in range(2):  # the second take replaces the first instead of being refused
        exec(in_bucket(retake, bucket), {"Snapshot": Snapshot, "app_state": {"model": model}})  # noqa: S102
    with pytest.raises(s3dcp.CheckpointExistsError):
        Snapshot.take(f"s3dcp://{bucket}/run7/latest", {"model": model})


def test_the_safetensors_reader_snippet(aws_env, s3_server, boto3_client):
    from safetensors.torch import save
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    (snippet,) = blocks("Start from Hugging Face safetensors", "python", "docs/interop.md")
    bucket = fresh_bucket(s3_server)
    published = {"weight": torch.randn(3, 6).to(torch.bfloat16), "bias": torch.randn(3)}
    boto3_client.put_object(Bucket=bucket, Key="models/llama/model.safetensors", Body=save(published))
    model = torch.nn.Linear(6, 3)
    exec(in_bucket(snippet, bucket), {"get_model_state_dict": get_model_state_dict, "model": model,  # noqa: S102
                                      "dcp": dcp})
    assert torch.equal(model.weight.detach(), published["weight"].float())  # bf16 file into fp32 parameters
    assert torch.equal(model.bias.detach(), published["bias"])


def test_the_export_commands(aws_env, s3_server, tmp_path, monkeypatch, capsys):
    from safetensors.torch import load_file

    (block,) = blocks("Export a checkpoint", "bash", "docs/interop.md")
    bucket = fresh_bucket(s3_server)
    model = {"w": torch.randn(8, 4), "b": torch.randn(4)}
    s3dcp.save({"model": model, "optim": {"m": torch.randn(8, 4)}, "step": 3}, f"s3://{bucket}/run7/step-1000")
    monkeypatch.chdir(tmp_path)
    lines = [shlex.split(in_bucket(line, bucket), comments=True) for line in block.splitlines() if line.strip()]
    assert [argv[:2] for argv in lines] == [["s3dcp", "export"]] * 2
    outputs = []
    for argv in lines:
        capsys.readouterr()
        assert cli.main(argv[1:]) == 0, argv
        outputs.append(capsys.readouterr().out)
    index = json.loads((tmp_path / "hf-model" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {"w", "b"}  # --only model. --strip-prefix model.
    loaded = {}
    for name in set(index["weight_map"].values()):
        loaded.update(load_file(tmp_path / "hf-model" / name))
    assert torch.equal(loaded["w"], model["w"]) and torch.equal(loaded["b"], model["b"])
    assert json.loads(outputs[1])  # --json: one JSON document
    out = {"model.w": torch.zeros(8, 4)}
    dcp.load(out, storage_reader=s3dcp.S3SafetensorsReader(f"s3://{bucket}/hf/step-1000/"))
    assert torch.equal(out["model.w"], model["w"])


# ------------------------------------------------------------------ docs/trainers.md
def test_the_trainer_extras_exist():
    lang, install = all_blocks("docs/trainers.md")[0]
    named = re.findall(r"pip install 's3dcp\[([\w-]+)\]'", install)
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert lang == "" and named == ["torchtitan", "lightning", "torch-checkpointing"]
    assert all(extras[name] for name in named)


def test_the_torchtitan_config(aws_env, s3_server):
    (snippet,) = blocks("torchtitan", "python", "docs/trainers.md")
    bucket = fresh_bucket(s3_server)
    found: dict = {}
    exec(in_bucket(snippet, bucket), found)  # noqa: S102 - the page's own code
    config = found["checkpoint"]
    assert (config.folder, config.async_mode, config.keep_latest_k, config.incremental) == \
        (f"s3://{bucket}/run", "async", 3, True)


def test_the_lightning_snippet_saves_every_100_steps_and_resumes_from_last(aws_env, s3_server, boto3_client):
    (snippet,) = blocks("Lightning", "python", "docs/trainers.md")
    bucket = fresh_bucket(s3_server)
    first: dict = {"model": tiny_lightning_model(50, batch_size=1, lr=0.01)}
    exec(in_bucket(snippet, bucket), first)  # noqa: S102 - 3 epochs of 50 steps: saved at step 100
    assert first["trainer"].global_step == 150
    keys = [o["Key"] for o in boto3_client.list_objects_v2(Bucket=bucket, Prefix="run/")["Contents"]]
    committed = {key.split("/")[-2] for key in keys if key.endswith("/.metadata")}
    assert "last.ckpt" in committed and any("step=100" in name for name in committed), committed
    again: dict = {"model": tiny_lightning_model(50, batch_size=1, lr=0.01)}
    exec(in_bucket(snippet, bucket), again)  # noqa: S102 - resumes from last.ckpt (step 100, an epoch's end)
    assert again["trainer"].global_step == 150
    assert torch.equal(again["model"].net.weight, first["model"].net.weight)


def test_the_torch_checkpointing_snippet_saves_async_keeps_the_last_and_loads(aws_env, s3_server):
    (snippet,) = blocks("torch-checkpointing", "python", "docs/trainers.md")
    bucket = fresh_bucket(s3_server)
    model = torch.nn.Linear(8, 4)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    scope: dict = {"model": model}
    exec(in_bucket(snippet, bucket), scope)  # noqa: S102 - the page's own code
    assert scope["loaded"]["step"] == 1000 and all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    storage = scope["storage_config"].create_storage()
    assert storage.committed("/") == ["step_1000"] and storage.ls("/") == ["step_1000"]
    assert storage.remap_path("step_1000") == f"s3://{bucket}/run/step_1000"


# ------------------------------------------------------------------ docs/compatibility.md
def test_the_compat_settings():
    (snippet,) = blocks("The setting", "python", "docs/compatibility.md")
    made: list = []
    exec(snippet, {"S3Config": lambda **kw: made.append(S3Config(endpoint_url="http://127.0.0.1:9", **kw))})  # noqa: S102
    assert [c.compat for c in made] == [None, "s3", "gcs", "basic"]
    # None is detected when the config is resolved: a loopback host is S3 (unless S3DCP_COMPAT says otherwise)
    assert [c.resolved({}).compat for c in made] == ["s3", "s3", "gcs", "basic"]


# ------------------------------------------------------------------ docs/restore.md
def test_the_cooperative_snippet(aws_env, s3_server):
    (snippet,) = blocks("Restore at scale", "python", "docs/restore.md")
    bucket = fresh_bucket(s3_server)
    saved = {"w": torch.randn(64, 8), "b": torch.arange(8.0)}
    s3dcp.save(saved, f"s3://{bucket}/run/step-1000")
    state_dict = {k: torch.zeros_like(v) for k, v in saved.items()}
    printed: list = []
    exec(in_bucket(snippet, bucket), {"S3StorageReader": S3StorageReader, "dcp": dcp, "s3dcp": s3dcp,  # noqa: S102
                                      "state_dict": state_dict, "print": printed.append})
    assert all(torch.equal(state_dict[k], v) for k, v in saved.items())
    (stats,) = printed  # one process: plain reads, and the figures say so
    assert stats.unique_bytes == stats.job_s3_bytes == saved["w"].nbytes + saved["b"].nbytes
    assert s3dcp.last_load_stats().job_s3_bytes == stats.job_s3_bytes


# ------------------------------------------------------------------ headline figures
def test_the_headline_figures_come_from_one_source_and_say_their_spread():
    """README.md and docs/benchmarks.md gave different stall.py figures and one train_loop.py
    ratio (68x) where runs gave 12x and 190x: both pages now carry what benchmarks/figures.py
    renders from docs/figures.json, the runs themselves, with the spread of each condition."""
    import sys

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import figures

    with open(os.path.join(ROOT, "docs", "figures.json"), encoding="utf-8") as f:
        source = json.load(f)
    expected = figures.render(source)
    readme, page = figures.blocks_in(read()), figures.blocks_in(read("docs/benchmarks.md"))
    assert readme == expected and page == {k: expected[k] for k in ("train_loop", "stall")}
    assert figures.main(["check"]) == 0
    for kind in ("train_loop", "stall"):
        for record in source[kind]:
            assert record["condition"] and record["source"] and record["when"], record
    shared = [r for r in source["train_loop"] if r["condition"] == "2 cores shared with other work"]
    ratios = sorted(r["x_less_stall"] for r in shared)
    assert len(shared) >= 3 and f"{ratios[0]:g}–{ratios[-1]:.0f}x on 2 cores shared" in " ".join(readme["train_loop"].split())
    assert "goal met" in expected["stall"] or "goal missed" in expected["stall"]  # a verdict, per condition


def test_a_results_file_becomes_a_record_of_its_figures():
    import sys

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import figures

    env = {"time": "2026-12-05T18:17:45", "cpu_count": 2, "load_avg_1_5_15min": [4.36, 2.5, 1.3]}
    rows = [{"mode": m, "stall_s": s, "checkpoint_mib": 132.0, "vs_monolithic": 4.029 / s, "stalled_pct": pct}
            for m, s, pct in (("monolithic", 4.029, 70.04), ("fs-sync", 0.79, 31), ("s3-sync", 2.632, 64),
                              ("s3-async", 0.246, 40))]
    record = figures.train_loop_record({"rows": rows, "environment": env, "total_wall_s": 171.5},
                                       condition="a test", source="x.json")
    assert record == {"when": "2026-12-05T18:17:45", "condition": "a test", "source": "x.json", "cpus": 2,
                      "load_avg_1min": 4.4, "job_s": 172, "state_mib": 132, "staging": "blocking",
                      "stall_s": {"monolithic": 4.029, "fs-sync": 0.79, "s3-sync": 2.632, "s3-async": 0.246},
                      "stalled_pct": {"monolithic": 70.0, "fs-sync": 31, "s3-sync": 64, "s3-async": 40},
                      "x_less_stall": 16.4}
    text = " ".join(figures.render_train_loop([record, dict(record, x_less_stall=6.9, load_avg_1min=7.2)]).split())
    assert "by 6.9–16x on a test (2 runs, load average 4–7, median 12x;" in text
    # a run of today's background staging goes first; the earlier runs are said to be of staging inside async_save
    later = figures.train_loop_record({"rows": rows, "environment": dict(env, time="2026-12-06T09:37:35"),
                                       "total_wall_s": 30, "staging": {"s3-async": "background"}},
                                      condition="a test", source="y.json")
    assert later["staging"] == "background"
    text = " ".join(figures.render_train_loop([record, dict(later, x_less_stall=560)]).split())
    assert ("by 560x on a test (1 run, load average 4; 0.246 s against 4.03 s per checkpoint). Counting the waits "
            "for the previous upload") in text, text
    assert "stood still 40% of its time against 70% for" in text, text
    assert "Staging inside `async_save` (before background staging): by 16x on a test" in text, text


# ------------------------------------------------------------------ docs/restart.md
def test_the_restart_snippet(aws_env, s3_server, tmp_path):
    """Run twice, as a job and its restart: the second run resumes from the node's copy of the
    newest step (not in S3: every 10th only goes there), reading nothing from S3."""
    (snippet,) = blocks("Restart from the nearest copy", "python", "docs/restart.md")
    bucket = fresh_bucket(s3_server)
    code = in_bucket(snippet, bucket).replace('"/dev/shm/run7"', repr(str(tmp_path / "run7")))
    state = {"w": torch.zeros(1000), "step": 0}

    def train_step():
        state["w"].add_(1)

    runs = []
    for _ in range(2):
        scope = {"cfg": S3Config(), "state": state, "train_step": train_step}
        exec(code, scope)  # noqa: S102 - the page's own code
        runs.append(scope)
    assert runs[0]["start"] == 0 and runs[1]["start"] == 300
    stats = runs[1]["manager"].last_load_stats
    assert stats["step"] == 300 and stats["tier"] == "local" and stats["s3_bytes"] == 0, stats
    assert torch.equal(state["w"], torch.full((1000,), 600.0))
