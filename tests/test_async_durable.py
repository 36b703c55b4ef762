"""``benchmarks/async_durable.py`` end to end on a tiny state against the session's server: every
situation runs, each row holds every figure, and the CPU accounting adds up (the groups never
exceed what the process spent). Structure only, never timing."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "benchmarks"))

import async_durable  # noqa: E402


def test_thread_accounting_sums_to_the_process():
    before = async_durable.thread_cpu()
    x = 0
    for i in range(3_000_000):
        x += i
    after = async_durable.thread_cpu()
    groups = async_durable.cpu_by_group(before, after)
    assert groups["caller"] > 0
    assert sum(v for k, v in groups.items()) == pytest.approx(after["total"] - before["total"], abs=0.05)


@pytest.mark.timeout(300)
def test_every_situation_runs_and_reports_every_figure(s3_server, bucket, monkeypatch, tmp_path, capsys):
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    out = tmp_path / "async_durable.json"
    assert async_durable.main(["--endpoint", s3_server.endpoint_url, "--bucket", bucket, "--state-mib", "12",
                               "--batch", "4", "--repeats", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "async while training vs sync" in printed and f"results: {out}" in printed
    rows = {row["scenario"]: row for row in json.loads(out.read_text())["rows"]}
    assert list(rows) == list(async_durable.SCENARIOS)
    for scenario, row in rows.items():
        assert row["durable_s"] > 0 and row["busy"] > 0, scenario
        for figure in ("upload_cpu_s", "crt_cpu_s", "server_cpu_s", "caller_cpu_s"):
            assert row[figure] is None or row[figure] >= 0, (scenario, figure)
    assert rows["async, training"]["steps"] >= 1 and rows["sync"]["steps"] == 0
    assert rows["async, idle"]["stall_s"] <= rows["async, idle"]["durable_s"]
