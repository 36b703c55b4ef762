"""The main job, ``benchmarks/train_loop.py``, end to end on a small state against the session's
server: every mode runs, the report and its JSON hold every figure, the files it names exist,
each upload ends after it began. Structure only, never timing."""

from __future__ import annotations

import concurrent.futures
import json
import os
import sys
import threading
import time
import types

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "benchmarks"))

import train_loop  # noqa: E402

ROUNDS = 2


@pytest.mark.timeout(300)
def test_the_main_job_runs_every_mode_and_reports_every_figure(s3_server, bucket, boto3_client, monkeypatch,
                                                               tmp_path, capsys):
    for name, value in s3_server.env().items():  # an external endpoint: credentials from the environment
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    out = tmp_path / "train_loop.json"
    # --state-mib 12: one 1024x1024 layer with its AdamW state
    assert train_loop.main(["--endpoint", s3_server.endpoint_url, "--bucket", bucket, "--state-mib", "12",
                            "--rounds", str(ROUNDS), "--every", "2", "--batch", "4", "--no-progress",
                            "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "How to read this" in printed and f"results: {out}" in printed
    for mode in train_loop.MODES:
        assert mode in printed

    report = json.loads(out.read_text())
    rows = {row["mode"]: row for row in report["rows"]}
    assert list(rows) == list(train_loop.MODES)
    for mode, row in rows.items():
        assert row["checkpoints"] == ROUNDS, mode
        for figure in ("stall_s", "stall_first_s", "stall_max_s", "stalled_pct", "checkpoint_mib",
                       "upload_s", "upload_gbps", "wall_s", "vs_monolithic", "vs_s3_sync"):
            assert isinstance(row[figure], (int, float)) and row[figure] > 0, (mode, figure, row[figure])
        # steps with and without an upload beside them: only s3-async has the former
        steps = [row["step_s"], row["step_upload_s"]] if mode == "s3-async" else [row["step_s"]]
        assert any(isinstance(s, float) and s > 0 for s in steps), (mode, steps)
        if mode != "s3-async":
            assert row["step_upload_s"] is None, mode
        assert row["stall_s"] <= row["stall_max_s"] and 0 < row["stalled_pct"] <= 100
        assert row["checkpoint_mib"] == pytest.approx(12, rel=0.01)
    assert rows["monolithic"]["vs_monolithic"] == 1 and rows["s3-sync"]["vs_s3_sync"] == 1

    (ranks,) = report["per_rank"]
    for result in ranks:
        assert len(result["uploads"]) == ROUNDS and len(result["steps"]) == ROUNDS * 2
        previous_end = 0.0
        for call_s, durable_s in result["uploads"]:  # each upload durable after its call, in order
            assert previous_end <= call_s <= durable_s <= result["wall_s"], (result["mode"], result["uploads"])
            previous_end = durable_s

    plots = [line.split("plot: ", 1)[1] for line in printed.splitlines() if line.startswith("plot: ")]
    assert sorted(os.path.basename(p) for p in plots) == ["train_loop-bars.png", "train_loop-timeline.png"]
    for path in plots:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"

    keys = [o["Key"] for o in boto3_client.list_objects_v2(Bucket=bucket).get("Contents", [])]
    prefix = report["settings"]["prefix"]
    for step in range(ROUNDS):
        name = f"step-{1 + step * 2:06d}"
        assert f"{prefix}/monolithic/{name}.pt" in keys
        for mode in ("s3-sync", "s3-async"):
            assert f"{prefix}/{mode}/{name}/.metadata" in keys, (mode, name, keys)


def test_a_durable_time_is_never_the_previous_checkpoints(monkeypatch, s3_config):
    """DCP's future wakes ``result()`` before it runs its callbacks: ``finish`` must not go
    by ``result()`` alone, or it reads the time the callback has not yet written."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.add_done_callback(lambda _f: time.sleep(0.5))  # an earlier callback, slow: runs first
    monkeypatch.setattr(train_loop.dcp, "async_save", lambda state, storage_writer: future)
    checkpointer = train_loop.Checkpointer("s3-async", types.SimpleNamespace(prefix="p"), s3_config, "bucket",
                                           "/tmp", 0, 1)
    checkpointer.durable_at = -1.0  # the previous checkpoint's
    checkpointer.save({}, "step-000001")
    assert checkpointer.pending()
    done_at: list[float] = []

    def complete() -> None:
        time.sleep(0.05)
        done_at.append(time.perf_counter())
        future.set_result("metadata")

    thread = threading.Thread(target=complete)
    thread.start()
    checkpointer.finish()
    durable_at = checkpointer.durable_at  # what the round reads next, at once
    thread.join()
    assert durable_at >= done_at[0]
    assert not checkpointer.pending()


def test_the_stall_bars_all_show_on_the_log_axis(monkeypatch, tmp_path):
    """Every bar of the stall chart stands at least a tenth of the axis high: matplotlib's own
    log limits, for bars from 0, put the bottom just under the smallest stall (a 0.02 s async
    stall beside seconds-long ones was a sliver, or off the axis)."""
    import math

    import matplotlib
    import matplotlib.figure

    matplotlib.use("Agg")
    limits: dict[str, list] = {}
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda fig, path, **kw: limits.setdefault(os.path.basename(path),
                                                                  [ax.get_ylim() for ax in fig.axes]))
    for stalls in ([1.32, 0.54, 1.03, 0.020], [4.03, 0.79, 2.63, 0.246], [0.9, 0.9, 0.9, 0.9]):
        rows = [{"mode": m, "stall_s": s, "upload_gbps": 0.1} for m, s in zip(train_loop.MODES, stalls)]
        limits.clear()
        train_loop.plot([[train_loop.ModeResult(mode=m) for m in train_loop.MODES]], rows, str(tmp_path / "t"))
        bottom, top = limits["t-bars.png"][0]
        for stall in stalls:
            assert math.log(stall / bottom) / math.log(top / bottom) >= 0.1, (stalls, stall, bottom, top)


def test_stall_benchmark_gives_a_verdict_against_its_goal():
    """stall.py printed its goal and no verdict: now one line per shape, and the whole."""
    import stall

    fast = {"stall_vs_memcpy_now": 1.05, "rss_spread_mib": 0.2, "state_mib": 512.0}
    met, lines = stall.verdict({"large": fast, "small": dict(fast, stall_vs_memcpy_now=1.07)})
    assert met and lines[-1] == "verdict: goal met"
    assert lines[0] == ("verdict large: PASS — warm stall 1.05x the memcpy timed right before it (<= 1.2x), "
                        "RSS spread 0.2 MiB (<= 5% of 512 MiB)")
    met, lines = stall.verdict({"large": dict(fast, stall_vs_memcpy_now=2.77), "small": dict(fast, rss_spread_mib=60)})
    assert not met and lines[0].startswith("verdict large: FAIL — warm stall 2.77x") and "(> 1.2x)" in lines[0]
    assert lines[1].startswith("verdict small: FAIL") and "(> 5% of 512 MiB)" in lines[1]
    assert lines[-1].startswith("verdict: goal NOT met")


@pytest.mark.timeout(300)
def test_the_overlap_benchmark_measures_every_mode_and_judges_background_staging(s3_server, bucket, monkeypatch,
                                                                               tmp_path):
    """benchmarks/overlap.py on a small state: every mode's segments are measured, the JSON
    holds each figure, and the verdict judges background staging. Structure only, never timing."""
    import overlap

    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    out = tmp_path / "overlap.json"
    modes = ["none", "blocking", "background", "whole-stage", "defaultstager"]
    assert overlap.main(["--endpoint", s3_server.endpoint_url, "--bucket", bucket, "--state-mib", "8",
                         "--shape", "small", "--rounds", "1", "--every", "2", "--batch", "2",
                         "--modes", ",".join(modes), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    small = report["results"]["small"]
    assert small["tensors"] >= 750 and [r["mode"] for r in small["rows"]] and set(small["modes"]) == set(modes)
    for mode in modes[1:]:
        figures = small["modes"][mode]
        assert figures["stall_median_s"] > 0 and figures["step_vs_none"] > 0, (mode, figures)
        assert figures["durable_after_median_s"] >= figures["staged_after_median_s"] > 0, (mode, figures)
    for mode in modes[1:4]:  # s3dcp's own staging: the slabs are files, sent from there
        assert 0 < small["modes"][mode]["first_sent_after_median_s"] < small["modes"][mode]["durable_after_median_s"]
    from s3dcp.s3.client import S3Client

    assert S3Client.put_file.__name__ == "put_file"  # the benchmark's recording is gone with it
    assert report["verdict"]["lines"][0].startswith("verdict small: ")
    met, lines = overlap.verdict({"large": {"modes": {"background": {"stall_median_s": 0.004, "step_vs_none": 1.05}}},
                                  "small": {"modes": {"background": {"stall_median_s": 0.03, "step_vs_none": 1.0}}}})
    assert not met and lines[0].startswith("verdict large: PASS") and lines[1].startswith("verdict small: FAIL")
