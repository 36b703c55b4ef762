"""Benchmark results never hold credentials: ``benchmarks/common.write_json`` leaves out what a
dataclass hides from its repr (S3Config's keys and token, at any depth) and hides values under
credential-like keys (an environment dict)."""

from __future__ import annotations

import json
import os
import sys

from s3dcp import S3Config

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "benchmarks"))

from common import Target, write_json  # noqa: E402

KEY_ID, SECRET, TOKEN = "AKIAEXAMPLEKEYID", "s3cr3t-never-written", "t0ken-never-written"


def test_results_never_hold_credentials(tmp_path):
    """Before: a dataclass went through dataclasses.asdict, so an S3Config in the results (or a
    Target, which holds one) wrote its access key, secret and session token."""
    config = S3Config(endpoint_url="http://127.0.0.1:9", access_key_id=KEY_ID, secret_access_key=SECRET,
                      session_token=TOKEN, part_size_bytes=8 << 20)
    target = Target(config=config, bucket="b", endpoint_url=config.endpoint_url)
    env = {"AWS_ACCESS_KEY_ID": KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_SESSION_TOKEN": TOKEN,
           "AWS_REGION": "us-east-1"}
    path = write_json(str(tmp_path / "results.json"), {"config": config, "target": target, "env": env,
                                                      "runs": [(config, 1.5)]})
    text = open(path).read()
    assert SECRET not in text and TOKEN not in text
    doc = json.loads(text)
    for shown in (doc["config"], doc["target"]["config"], doc["runs"][0][0]):
        assert shown["part_size_bytes"] == 8 << 20 and shown["endpoint_url"] == "http://127.0.0.1:9"
        assert not {"access_key_id", "secret_access_key", "session_token"} & set(shown)
    assert doc["env"] == {"AWS_ACCESS_KEY_ID": KEY_ID, "AWS_SECRET_ACCESS_KEY": "<hidden>", "AWS_SESSION_TOKEN": "<hidden>",
                          "AWS_REGION": "us-east-1"}
    assert doc["runs"][0][1] == 1.5 and doc["target"]["bucket"] == "b"
