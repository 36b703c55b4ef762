"""examples/torchsnapshot.py, examples/hf_finetune_start.py and examples/torch_checkpointing_s3.py run
as a user runs them: with no endpoint configured, with one configured (its s3://demo, as "Try it
locally" leaves it, or an --uri), and without a warning."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ts_entry_point import entry_point_dir

ROOT = Path(__file__).resolve().parents[2]


def run_example(name: str, *args: str, env: dict) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, str(ROOT / "examples" / name), *args], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, f"{name} exited {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert "Warning" not in result.stderr, result.stderr  # e.g. FSDP2's "returned a view tensor"
    return result


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    paths = [str(ROOT), *filter(None, [entry_point_dir()])]
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(extra)
    return env


def test_torchsnapshot_example_starts_its_own_server():
    out = run_example("torchsnapshot.py", env=clean_env()).stdout
    assert "# embedded S3 server on http://127.0.0.1:" in out
    assert "took s3dcp://demo/torchsnapshot/step-20 while training" in out
    assert "identical, bit for bit (step 10" in out


def test_hf_finetune_start_example_against_a_configured_endpoint(s3_server, bucket):
    env = clean_env(**s3_server.env())
    uri = f"s3://{bucket}/models/tiny-lm"
    first = run_example("hf_finetune_start.py", "--uri", uri, "--steps", "2", env=env).stdout
    assert f"published a stand-in pretrained model at {uri}" in first
    assert "rank 0/1: loaded 8 tensors" in first and "equal to the published weights" in first
    assert "step 2  loss" in first


def test_torchsnapshot_example_uses_a_configured_endpoint_and_takes_s3_uris(s3_server, demo_bucket):
    env = clean_env(**s3_server.env())
    for _ in range(2):  # re-runnable on one server: it used to exit 1 with CheckpointExistsError the second time
        out = run_example("torchsnapshot.py", env=env).stdout
        assert f"the configured S3 endpoint {s3_server.endpoint_url}; snapshots under s3dcp://demo/torchsnapshot" in out
        assert "identical, bit for bit (step 10" in out
    # s3:// is TorchSnapshot's aiobotocore plugin: the example says it uses s3dcp:// instead of failing
    out = run_example("torchsnapshot.py", "--uri", "s3://demo/snap", env=env).stdout
    assert "--uri s3://demo/snap: snapshots go to s3dcp://demo/snap" in out
    assert "took s3dcp://demo/snap/step-20 while training" in out and "identical, bit for bit" in out


def test_hf_finetune_start_example_starts_its_own_server_or_uses_the_configured_one(s3_server, demo_bucket):
    alone = run_example("hf_finetune_start.py", "--steps", "1", env=clean_env()).stdout
    assert "# embedded S3 server on http://127.0.0.1:" in alone and "step 1  loss" in alone
    configured = run_example("hf_finetune_start.py", "--steps", "1", env=clean_env(**s3_server.env())).stdout
    assert f"the configured S3 endpoint {s3_server.endpoint_url}; the model at s3://demo/models/tiny-lm" in configured
    assert "published a stand-in pretrained model at s3://demo/models/tiny-lm" in configured
    assert "equal to the published weights" in configured


def test_torch_checkpointing_example_saves_async_loads_bit_for_bit_and_resumes(s3_server, bucket):
    env = clean_env(**s3_server.env())
    uri = f"s3://{bucket}/run"
    first = run_example("torch_checkpointing_s3.py", "--uri", uri, "--steps", "10", env=env).stdout
    assert f"the configured S3 endpoint {s3_server.endpoint_url}; checkpoints under {uri}" in first
    assert f"saving {uri}/step_10" in first and f"committed {uri}/step_10" in first
    assert f"loaded {uri}/step_10 into a fresh model and optimizer: identical, bit for bit (step 10)" in first
    again = run_example("torch_checkpointing_s3.py", "--uri", uri, "--steps", "20", env=env).stdout
    assert f"resumed from {uri}/step_10 (step 10)" in again
    assert "kept ['step_20', 'step_30']; deleted ['step_10']" in again
    assert f"loaded {uri}/step_30 into a fresh model and optimizer: identical, bit for bit (step 30)" in again
