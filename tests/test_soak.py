"""Endurance: checkpoint cycles of a training loop leave this process as they found it.

Short versions of ``benchmarks/soak.py`` (async saves through CheckpointManager with retention,
loads into fresh state dicts, ``s3dcp verify``, synchronous saves of non-contiguous tensors,
``s3dcp.gc``), judged by the benchmark's own criteria: flatness, never timing. 12 cycles of a
32 MiB state in every run; 20 cycles of a 64 MiB state, which also catch a leak of under a MiB
per cycle, in the full set (``scripts/test --full``, CI).
"""

from __future__ import annotations

import logging
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "benchmarks"))

import soak  # noqa: E402

MiB = 1024 * 1024

# 64 MiB: one state leaked per cycle is 20x the limit (5% = 3.2 MiB). The operations run in
# cycles 1-2 (warm-up), 6, 12 and 18, so each end of the run holds one period of them: cycles
# 3-8 and 15-20. A run that has grown by 512 MiB stops: the leak is plain by then.
SETTINGS = soak.SoakSettings(cycles=20, state_bytes=64 * MiB, load_every=6, verify_every=6, sync_every=6,
                             gc_every=6, stop_at_growth_bytes=512 * MiB)
# The fewest cycles the judging takes (two windows of 5 after the 2 warm-up cycles): the
# operations run in cycles 1-2, 5 and 10, once in each window (cycles 3-7 and 8-12). A state
# leaked per cycle is 20x the limit here too (5% of 32 MiB = 1.6 MiB).
SHORT = soak.SoakSettings(cycles=12, state_bytes=32 * MiB, load_every=5, verify_every=5, sync_every=5,
                          gc_every=5, stop_at_growth_bytes=256 * MiB)


@pytest.fixture
def no_log_records_kept():
    """pytest keeps every log record a test emits until the test ends, and DCP logs a few
    dozen DEBUG records per save: memory the test harness holds, not the library."""
    logging.disable(logging.INFO)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)


def _soak(settings: soak.SoakSettings, s3_server, bucket, tmp_path) -> None:
    """In a process of its own, as a training job is: this test process holds everything the
    suite has done so far, which would be measured too. With a fixed glibc mmap threshold
    (MALLOC_MMAP_THRESHOLD_=1 MiB): by default glibc raises the threshold once a large block is
    freed, and then keeps the CRT's freed part buffers in its I/O threads' arenas, a plateau of
    40-50 MiB (measured: +48 MiB by cycle 20 of 30, +40 at the end; with the fixed threshold
    +0.7 MiB) that 20 cycles cannot tell from a leak. Fixed, every large block goes back to the
    system when freed, so what stays is what s3dcp holds. benchmarks/soak.py judges the default
    environment over 300 cycles by its plateau rule (docs/memory.md)."""
    import json
    import subprocess

    config = s3_server.s3_config()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "MALLOC_"))}
    env.update(MALLOC_MMAP_THRESHOLD_=str(MiB), AWS_ACCESS_KEY_ID=config.access_key_id,
               AWS_SECRET_ACCESS_KEY=config.secret_access_key,
               AWS_REGION=config.region, PYTHONPATH=os.pathsep.join(sys.path))
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(os.path.dirname(os.path.abspath(soak.__file__)), "soak.py"),
         "--endpoint", config.endpoint_url, "--bucket", bucket,
         "--cycles", str(settings.cycles), "--state-mib", str(settings.state_bytes // MiB),
         "--load-every", str(settings.load_every), "--verify-every", str(settings.verify_every),
         "--sync-every", str(settings.sync_every), "--gc-every", str(settings.gc_every),
         "--stop-at-growth-mib", str(settings.stop_at_growth_bytes // MiB), "--json", str(out)],
        env=env, capture_output=True, text=True, timeout=280, check=False)
    result = json.loads(out.read_text())
    assert proc.returncode == 0 and result["passed"], f"soak failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-3000:]}"
    assert result["summary"]["cycles"] == settings.cycles


@pytest.mark.timeout(300)
def test_checkpoint_cycles_stay_flat(s3_server, bucket, tmp_path):
    _soak(SHORT, s3_server, bucket, tmp_path)


@pytest.mark.full
@pytest.mark.timeout(300)
def test_twenty_checkpoint_cycles_stay_flat(s3_server, bucket, tmp_path):
    _soak(SETTINGS, s3_server, bucket, tmp_path)


# ---------------------------------------------------------------------- the judging, no server
def _cycles(rss_mib: list[float], fds: list[int] | None = None, sockets: list[int] | None = None) -> list[soak.Cycle]:
    out = []
    for i, rss in enumerate(rss_mib):
        c = soak.Cycle(i + 1, loaded=True if i == 1 else None, verified=True if i == 1 else None)
        other, sock = fds[i] if fds else 14, sockets[i] if sockets else 6
        c.sample = {"rss_bytes": int(rss * MiB), "rss_untrimmed_bytes": int(rss * MiB), "py_threads": 2,
                    "os_threads": 8, "fds": other + sock, "other_fds": other, "sockets": sock,
                    "socket_bound": 32, "arenas": 1, "arena_bytes": 64 * MiB}
        out.append(c)
    return out


def _verdict(cycles: list[soak.Cycle]) -> dict[str, bool]:
    return {c.name: c.passed for c in soak.judge(soak.summarize(cycles, SETTINGS))}


def test_a_state_leaked_per_cycle_fails_and_transients_do_not():
    assert soak.window(SETTINGS, 20) == 6
    flat = [400.0] * 20
    assert all(_verdict(_cycles(flat)).values())

    # every 6th cycle holds 100 MiB more for two cycles (a CRT part buffer pool before its trim)
    spiky = [400.0 + (100 if i % 6 in (0, 1) else 0) for i in range(20)]
    assert _verdict(_cycles(spiky))["RSS growth after cycle 2"]

    for at in (5, 11, 17):  # glibc: +8 MiB once, early, mid-run (as CI saw at cycle 12) or late
        step = [400.0 + (8 if i >= at else 0) for i in range(20)]
        assert _verdict(_cycles(step))["RSS growth after cycle 2"], at
    wobble = [400.0 + (8 if (i // 4) % 2 else 0) for i in range(20)]  # steps up and back down
    assert _verdict(_cycles(wobble))["RSS growth after cycle 2"]
    two_steps = [400.0 + 4 * (i >= 8) + 4 * (i >= 14) for i in range(20)]  # two rises of 4 MiB
    assert not _verdict(_cycles(two_steps))["RSS growth after cycle 2"]
    big_step = [400.0 + (40 if i >= 5 else 0) for i in range(20)]  # 40 MiB kept from cycle 6 on
    assert not _verdict(_cycles(big_step))["RSS growth after cycle 2"]
    staircase = [400.0 + 4 * (i // 6) for i in range(20)]  # 4 MiB more every 6th cycle (a load's leak)
    assert not _verdict(_cycles(staircase))["RSS growth after cycle 2"]

    leaking = [400.0 + 64 * i for i in range(20)]  # one 64 MiB state per cycle
    assert not _verdict(_cycles(leaking))["RSS growth after cycle 2"]
    slow = [400.0 + 0.5 * i for i in range(20)]  # 0.5 MiB per cycle: 6 MiB between the ends
    assert not _verdict(_cycles(slow))["RSS growth after cycle 2"]

    fd_leak = [14 + i // 2 for i in range(20)]  # a file or pipe every other cycle
    verdict = _verdict(_cycles(flat, fds=fd_leak))
    assert not verdict["open fds other than sockets flat"] and verdict["RSS growth after cycle 2"]

    warming = [min(16, 3 + i) for i in range(20)]  # a connection pool growing to its working size
    assert all(_verdict(_cycles(flat, sockets=warming)).values())
    socket_leak = [3 + 2 * i for i in range(20)]  # two connections never closed per cycle
    assert not _verdict(_cycles(flat, sockets=socket_leak))["sockets bounded"]


def test_the_short_run_fails_a_leak_of_a_few_mib_per_cycle():
    """What the 12-cycle run can tell: a flat run passes, a state (or 4 MiB) kept per cycle fails."""
    assert soak.window(SHORT, SHORT.cycles) == 5

    def verdict(rss: list[float]) -> dict[str, bool]:
        return {c.name: c.passed for c in soak.judge(soak.summarize(_cycles(rss), SHORT))}

    assert all(verdict([400.0] * 12).values())
    assert verdict([400.0 + (8 if i >= 6 else 0) for i in range(12)])["RSS growth after cycle 2"]  # glibc's one step
    assert not verdict([400.0 + 32 * i for i in range(12)])["RSS growth after cycle 2"]
    assert not verdict([400.0 + 4 * i for i in range(12)])["RSS growth after cycle 2"]


def test_a_failed_operation_fails_the_run():
    cycles = _cycles([400.0] * 20)
    cycles[7].errors.append("verify: S3Error: boom")
    assert not _verdict(cycles)["every checkpoint verified"]
    cycles = _cycles([400.0] * 20)
    cycles[5].gc_deleted = 3  # gc must never delete a committed checkpoint's objects
    assert not _verdict(cycles)["every checkpoint verified"]


def test_a_long_run_tells_glibcs_plateau_from_a_leak():
    """With the CRT's transfers (transport="crt") and no MALLOC_ARENA_MAX the RSS of a 300-cycle
    run stepped up for ~90 cycles and then stayed (memory left in glibc's thread arenas); a leak
    keeps rising. Judged on the run's second
    half and on the arenas' own figures, never on a short run."""
    settings = soak.SoakSettings(cycles=300, state_bytes=128 * MiB)

    def verdict(rss: list[float], thread_heaps: list[float], settings=settings) -> bool:
        cycles = _cycles(rss)
        for c, heap in zip(cycles, thread_heaps):
            c.sample["malloc"] = {"arenas": 16, "heap_bytes": int((240 + heap) * MiB), "main_heap_bytes": 240 * MiB,
                                  "thread_heap_bytes": int(heap * MiB)}
        summary = soak.summarize(cycles, settings)
        return {c.name: c.passed for c in soak.judge(summary)}["RSS growth after cycle 2"]

    ramp = [min(1.0, i / 90) for i in range(300)]  # a step each load, up to cycle 90, then none
    plateau = [575 + 45 * r for r in ramp]
    arenas = [20 + 80 * r for r in ramp]
    assert verdict(plateau, arenas)
    assert not verdict(plateau, [20.0] * 300)  # RSS held that glibc's arenas do not account for
    leak = [575 + 0.1 * i for i in range(300)]  # 100 KiB a cycle, all along, arenas growing with it
    assert not verdict(leak, [20 + 0.2 * i for i in range(300)])
    late_step = [575 + 45 * r + (12 if i >= 250 else 0) for i, r in enumerate(ramp)]  # still rising late
    assert not verdict(late_step, [a + (24 if i >= 250 else 0) for i, a in enumerate(arenas)])
    # a short run cannot tell: 40 MiB kept from cycle 6 on fails, arenas or not
    big_step = [400.0 + (40 if i >= 5 else 0) for i in range(20)]
    assert not verdict(big_step, [20.0 + (80 if i >= 5 else 0) for i in range(20)], settings=SETTINGS)
