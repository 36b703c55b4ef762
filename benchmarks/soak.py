"""Endurance: a training loop that checkpoints N times, and whether this process stays flat.

    python benchmarks/soak.py                         # 300 cycles of a 32 MiB state, embedded S3
    python benchmarks/soak.py --cycles 1000 --state-mib 128
    python benchmarks/soak.py --cycles 20 --state-mib 64 --load-every 6 --verify-every 6 --sync-every 3 --gc-every 6
    python benchmarks/soak.py --endpoint https://s3.us-east-1.amazonaws.com --bucket my-bucket

One cycle of the loop (``c`` = cycle number = checkpoint step):

    train step: every tensor of the state changes (so every checkpoint's checksums differ)
    manager.save(c, state)            async, CheckpointManager(keep_last=2): retention deletes c-2
    every --sync-every:    a synchronous dcp.save of a fresh state of transposed (non-contiguous)
                           tensors to a directory of its own, then deleted; right after the
                           async save, so it always runs beside that save's upload (its copies
                           need an arena of their own: one allocated in cycle 2, whatever the
                           machine's pace, not later when an upload happens to be slow)
    every --load-every:    dcp.load of checkpoint c-1 into a FRESH state dict through a reader
                           with a config of its own (as when credentials rotate: each config
                           gets a native client), compared with what was saved, then dropped
    every --verify-every:  ``s3dcp verify <checkpoint c-1> --json``, in-process
    manager.wait()         checkpoint c committed, retention done
    every --gc-every:      s3dcp.gc(run, older_than_s=0): nothing is in flight and no save
                           failed, so it must delete nothing
    sample                 RSS, Python threads, OS threads, open fds, staging arenas

Cycles 1 and 2 run every operation (loads and verifies from cycle 2), so what a first call
allocates is already there when the measuring starts. Every sample is taken once the save's
thread has ended, RSS after ``gc.collect()`` and ``malloc_trim(0)`` (memory in use, not memory
glibc keeps free for reuse; the RSS before that is recorded too).

Growth is judged on the lowest value over the last W cycles against the lowest over the W
cycles after cycle 2 (W: whole periods of the operations, >= 5 cycles; both ends hold the same
mix). A leak lifts every later sample; what is let go a few seconds later (part buffers the CRT
trims when idle) lifts only some, not the lowest. Idle native clients, which linger for the next
client of their config, are released and their threads awaited before each sample: how many
linger depends on the pace of the cycles, not on leaks. Pass criteria, printed with the result
(exit status 1 if one fails):

    RSS growth after cycle 2   growth beyond one step (cycles 3..N, spikes smoothed by a median
                               of 5, the largest single rise, up to 16 MiB, taken out: a leak
                               rises again and again, glibc steps once) <= 5% of the state's
                               bytes; and RSS held at the end (the median of the last W cycles
                               over cycle 2's) <= max(5% of the state, 16 MiB): glibc's heap
                               moves in one-time steps of several MiB (CI saw +6 MiB at cycle 6
                               and +8 MiB at cycle 12, then flat), which a small state's 5%
                               cannot hold. Or, in a long run (>= 60 cycles after its middle),
                               glibc's plateau: without MALLOC_ARENA_MAX each thread that
                               allocates (the CRT's event loops of each native client, copy and
                               save threads) gets an arena of its own (16 on 2 cores by cycle 2),
                               and what loads and verifies leave scattered in them stays; RSS steps
                               up for tens of cycles, then moves in a band. It passes when the
                               second half's last half has a median RSS within 5% of the state of
                               its first half's and the thread arenas' heaps
                               (malloc_info, sampled each cycle) grew at least as much as the RSS
                               held; a leak keeps lifting the second half
    threads flat               Python's: growth 0; the OS's: growth <= 1 (CRT host resolver)
    open fds flat              files, pipes, event fds other than sockets: growth <= 2
    sockets bounded            at most 2 x max_concurrency per native client held (the CRT pools
                               connections, opening one when a request finds none idle, up to the
                               highest concurrency seen: the count rises for a while, then stays)
    staging arenas flat        no arena allocated after cycle 2
    every checkpoint verified  every save committed, every load equal to what was saved, every
                               verify OK, gc deleted nothing, no operation raised
    ran every cycle            the run stops early (FAIL) once RSS grew by --stop-at-growth-mib

Only this process is measured: the embedded SeaweedFS server is a process of its own.
Results: a table (a sample of the cycles), JSON with every cycle, and a PNG of RSS, threads and
fds over the cycles (with matplotlib) in --out.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import statistics
import sys
import threading
import time
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import psutil  # noqa: E402
import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from common import (  # noqa: E402
    MiB, add_common_args, environment_info, print_table, release_memory, results_path, s3_target, unique_prefix,
    write_json,
)

RSS_GROWTH_LIMIT = 0.05  # of the state's bytes: the trend over the run (what grows per checkpoint)
RSS_STEP_SLACK_BYTES = 16 * MiB  # a one-time step may be this large if the trend is flat (glibc)
# How much a count may grow (see summarize) without counting as growth: the CRT resolves host
# names on threads that come and go, and its connection pools open and close sockets.
SLACK = {"py_threads": 0, "os_threads": 1, "other_fds": 2}
# A run this long after its middle can tell glibc's plateau from a leak (see judge).
PLATEAU_MIN_CYCLES = 60
SOCKETS_PER_SLOT = 2  # sockets bound: per request slot (max_concurrency) of each native client
MIN_WINDOW = 5  # cycles
TENSOR_BYTES = 4 * MiB  # the state is made of fp32 tensors of (at most) this size


# ---------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class SoakSettings:
    """What one soak run does; ``every`` values count cycles (0: never)."""

    cycles: int = 300
    state_bytes: int = 32 * MiB
    load_every: int = 10  # > the few seconds the CRT keeps a load's part buffers (see summarize)
    verify_every: int = 10
    sync_every: int = 5
    gc_every: int = 10
    keep_last: int = 2
    config_per_load: bool = True  # each load's reader gets an S3Config of its own
    stop_at_growth_bytes: int | None = 1024 * MiB  # stop early once RSS grew this much past cycle 2

    def __post_init__(self) -> None:
        if self.cycles < 3:
            raise ValueError(f"cycles={self.cycles} must be >= 3: cycle 2 is the baseline")
        if self.state_bytes < TENSOR_BYTES:
            raise ValueError(f"state_bytes={self.state_bytes} must be >= {TENSOR_BYTES // MiB} MiB")
        for name in ("load_every", "verify_every", "sync_every", "gc_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0 (0: never)")
        if self.keep_last < 2:
            raise ValueError(f"keep_last={self.keep_last} must be >= 2: cycle c reads checkpoint c-1 "
                             "while c uploads, and retention must not delete it under the reader")

    def due(self, every: int, cycle: int, *, first: int = 1) -> bool:
        """Whether an operation run every ``every`` cycles runs in ``cycle`` (always in the
        warm-up cycles ``first``..2, so the baseline has seen it)."""
        return every > 0 and cycle >= first and (cycle <= 2 or cycle % every == 0)


# ---------------------------------------------------------------------------- the state
def make_state(state_bytes: int, seed: int = 0) -> dict:
    """Weights and two optimizer moments (fp32 tensors of <= 4 MiB) plus a step counter."""
    gen = torch.Generator().manual_seed(seed)
    elems = state_bytes // 4 // 3
    model, moments = {}, {}
    i = 0
    while elems > 0:
        n = min(elems, TENSOR_BYTES // 4)
        model[f"layer{i}.weight"] = torch.randn(n, generator=gen)
        moments[i] = {"exp_avg": torch.zeros(n), "exp_avg_sq": torch.zeros(n)}
        elems -= n
        i += 1
    return {"model": model, "optim": {"state": moments, "step": 0}}


def train_step(state: dict, step: int) -> None:
    """A stand-in for one optimizer step: every tensor changes, in place."""
    for i, w in enumerate(state["model"].values()):
        m = state["optim"]["state"][i]
        m["exp_avg"].mul_(0.9).add_(w, alpha=0.1)
        m["exp_avg_sq"].mul_(0.99).addcmul_(w, w, value=0.01)
        w.sub_(m["exp_avg"] * 1e-3)
    state["optim"]["step"] = step


def fresh_like(state: Any) -> Any:
    """A state dict of the same structure with newly allocated, uninitialised tensors."""
    if isinstance(state, torch.Tensor):
        return torch.empty_like(state)
    if isinstance(state, dict):
        return {k: fresh_like(v) for k, v in state.items()}
    return state


def fingerprint(state: Any) -> dict:
    """CRC32 of every tensor's bytes (and the plain values), by path: compares a state with a
    loaded one without keeping a copy of it."""
    out: dict = {}

    def walk(value: Any, path: str) -> None:
        if isinstance(value, torch.Tensor):
            out[path] = zlib.crc32(value.contiguous().view(torch.uint8).numpy())
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{path}/{k}")
        else:
            out[path] = value

    walk(state, "")
    return out


def transposed_state(state_bytes: int, seed: int) -> dict:
    """A fresh state of non-contiguous tensors (transposed 2-D views): DCP's synchronous save
    copies each into a contiguous buffer before the upload."""
    gen = torch.Generator().manual_seed(seed)
    side = int((TENSOR_BYTES // 4) ** 0.5)
    count = max(1, state_bytes // (side * side * 4))
    return {f"t{i}": torch.randn(side, side, generator=gen).t() for i in range(count)}


# ---------------------------------------------------------------------------- measuring
def sample() -> dict:
    """This process now: RSS, threads (Python's and the OS's), open fds, staging arenas.

    ``rss_bytes`` is taken after a garbage collection and ``malloc_trim``: memory still in use,
    not freed memory glibc keeps for reuse (whose amount depends on the order of frees, not on
    leaks); ``rss_untrimmed_bytes`` is the RSS before that.

    Idle native clients (which linger ``_IDLE_LINGER_S`` for the next checkpoint's client of
    their config, at most ``_MAX_IDLE`` of them) are released first, and their CRT threads and
    sockets awaited: how many linger at a sample depends on the cycle's pace, not on leaks. A
    client still held after its reader or writer is done is not idle, and is counted."""
    from s3dcp.s3 import native as native_mod
    from s3dcp.s3.native import close_native_clients, native_clients
    from s3dcp.saving.staging import shared_pool

    me = psutil.Process()
    untrimmed = me.memory_info().rss
    released = close_native_clients(idle_only=True, wait_s=5.0)
    release_memory()
    pool = shared_pool()
    kinds = _fd_kinds()
    names: dict[str, int] = {}
    for task in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ():
        with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/comm") as f:
            name = f.read().strip()
            names[name] = names.get(name, 0) + 1
    return {
        "rss_bytes": me.memory_info().rss,
        "rss_untrimmed_bytes": untrimmed,
        "py_threads": threading.active_count(),
        "os_threads": me.num_threads(),
        "fds": me.num_fds(),
        "sockets": kinds.get("socket", 0),
        "other_fds": me.num_fds() - kinds.get("socket", 0),
        "socket_bound": SOCKETS_PER_SLOT * sum(n.limit for n in list(native_mod._NATIVE.values())),
        "native_clients": native_clients(),
        "idle_native_clients_released": released,
        "arenas": pool.allocations,
        "arena_bytes": pool.bytes_allocated,
        "arenas_in_use": pool.in_use,
        **_rss_kinds(),  # Linux: anonymous vs file-backed (evictable, shared libraries) resident bytes
        "malloc": malloc_arenas(),  # glibc: its arenas, to tell the allocator's memory from ours
        "os_thread_names": dict(sorted(names.items())),  # Linux: which threads, to tell what grew
        "fd_kinds": kinds,  # Linux: sockets, pipes, files..., to tell what grew
    }


def _rss_kinds() -> dict[str, int]:
    """``rss_anon_bytes`` and ``rss_file_bytes`` from /proc/self/status (empty elsewhere): file
    pages (the code of torch and the CRT) come and go with the machine's memory pressure, so a
    loaded machine moves the RSS by tens of MiB that are neither ours nor a leak."""
    out: dict[str, int] = {}
    with contextlib.suppress(OSError), open("/proc/self/status") as f:
        for line in f:
            key = {"RssAnon:": "rss_anon_bytes", "RssFile:": "rss_file_bytes"}.get(line.split(":")[0] + ":")
            if key:
                out[key] = int(line.split()[1]) * 1024
    return out


def malloc_arenas() -> dict[str, int] | None:
    """glibc's malloc arenas now (``malloc_info``): how many, and the bytes their heaps hold
    from the OS: the main arena's (``main_heap_bytes``) and the thread arenas' mmapped heaps
    (``thread_heap_bytes``). glibc gives a thread that allocates an arena of its own (up to 8 per
    core); what the threads of a load or a save (the CRT's event loops, the sender's threads) leave
    scattered in them stays there, unreturnable, until reused. None when the C library is not
    glibc."""
    import ctypes
    import re

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.open_memstream.restype = ctypes.c_void_p
        libc.open_memstream.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_size_t)]
        libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
        libc.fclose.argtypes = [ctypes.c_void_p]
        libc.free.argtypes = [ctypes.c_void_p]
    except (OSError, AttributeError):
        return None
    buf, size = ctypes.c_char_p(), ctypes.c_size_t()
    stream = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
    if not stream:
        return None
    try:
        failed = libc.malloc_info(0, stream) != 0
    finally:
        libc.fclose(stream)
    text = ctypes.string_at(buf, size.value).decode("ascii", "replace")
    libc.free(ctypes.cast(buf, ctypes.c_void_p))
    if failed:
        return None
    heaps = re.findall(r'<heap nr="(\d+)">(.*?)</heap>', text, re.S)
    held = {int(nr): sum(int(m) for m in re.findall(r'<system type="current" size="(\d+)"/>', h)) for nr, h in heaps}
    return {"arenas": len(held), "heap_bytes": sum(held.values()), "main_heap_bytes": held.get(0, 0),
            "thread_heap_bytes": sum(v for nr, v in held.items() if nr != 0)}


def _fd_kinds() -> dict[str, int]:
    kinds: dict[str, int] = {}
    for fd in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else ():
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        kind = target.split(":", 1)[0] if ":" in target and not target.startswith("/") else "file"
        kinds[kind] = kinds.get(kind, 0) + 1
    return dict(sorted(kinds.items()))


@contextlib.contextmanager
def _aws_env(config):
    """The AWS variables that point an in-process ``s3dcp`` command at ``config``'s endpoint
    and credentials, restored afterwards (the command resolves its settings from them)."""
    values = {"AWS_ENDPOINT_URL_S3": config.endpoint_url, "AWS_REGION": config.region}
    if config.access_key_id is not None:
        values.update(AWS_ACCESS_KEY_ID=config.access_key_id, AWS_SECRET_ACCESS_KEY=config.secret_access_key,
                      AWS_SESSION_TOKEN=config.session_token)
    saved = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def verify(uri: str, config) -> dict:
    """``s3dcp verify URI --json`` in this process; its JSON report plus ``exit``."""
    from s3dcp import cli

    out, err = io.StringIO(), io.StringIO()
    with _aws_env(config), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["verify", uri, "--json", "--quiet"])
    try:
        report = json.loads(out.getvalue())
    except ValueError:
        report = {"ok": False, "error": err.getvalue().strip() or out.getvalue().strip()}
    report["exit"] = code
    return report


@dataclass
class Cycle:
    """One cycle's operations and the sample taken at its end."""

    cycle: int
    stall_s: float = 0.0  # manager.save blocked the loop this long
    cycle_s: float = 0.0
    loaded: bool | None = None  # None: no load this cycle; else: equal to what was saved
    verified: bool | None = None
    sync_saved: bool | None = None
    gc_deleted: int | None = None
    errors: list = field(default_factory=list)
    sample: dict = field(default_factory=dict)

    def row(self) -> dict:
        d = asdict(self)
        d.update(d.pop("sample"))
        return d


def run_soak(config, base_uri: str, settings: SoakSettings, *,
             progress: Callable[[Cycle], None] | None = None) -> list[Cycle]:
    """Run ``settings.cycles`` cycles (see the module docstring) checkpointing under
    ``base_uri``; returns every cycle. Leaves only the last ``keep_last`` checkpoints."""
    from s3dcp import CheckpointManager, S3StorageReader, S3StorageWriter, gc
    from s3dcp.lifecycle.manager import delete_checkpoint
    from s3dcp.uri import parse_s3_uri

    state = make_state(settings.state_bytes)
    cycles: list[Cycle] = []
    from torch.distributed.checkpoint.api import CheckpointException

    from s3dcp import unwrap_error

    saved: dict[int, dict] = {}  # step -> fingerprint of what was saved (the last two)
    with CheckpointManager(base_uri, config=config, keep_last=settings.keep_last) as manager:
        for c in range(1, settings.cycles + 1):
            cyc = Cycle(c)
            t0 = time.perf_counter()

            def attempt(what: str, fn: Callable[[], Any]) -> Any:
                try:
                    return fn()
                except (Exception, CheckpointException) as e:  # noqa: BLE001 - recorded; the criteria report it
                    e = unwrap_error(e)  # plain dcp.save raises DCP's CheckpointException, a BaseException
                    cyc.errors.append(f"{what}: {type(e).__name__}: {' '.join(str(e).split())[:300]}")
                    return None

            train_step(state, c)
            saved[c] = fingerprint(state)
            saved.pop(c - 2, None)
            attempt("save", lambda: manager.save(c, state))
            cyc.stall_s = time.perf_counter() - t0
            committed = c - 1 if c > 1 and not cycles[-1].errors else None
            if settings.due(settings.sync_every, c):  # at once: beside the async save's upload, every time
                def sync_save() -> bool:
                    uri = f"{base_uri.rstrip('/')}/sync/cycle-{c:08d}"
                    dcp.save(transposed_state(settings.state_bytes, seed=c),
                             storage_writer=S3StorageWriter(uri, config=config))
                    delete_checkpoint(manager.client, parse_s3_uri(uri))
                    return True
                cyc.sync_saved = bool(attempt("sync save", sync_save))

            if committed is not None and settings.due(settings.load_every, c, first=2):
                def load() -> bool:
                    own = config
                    if settings.config_per_load:  # as when credentials rotate: a new native client
                        own = config.replace(request_timeout_s=(config.request_timeout_s or 600.0) + c / 1000)
                    fresh = fresh_like(state)
                    dcp.load(fresh, storage_reader=S3StorageReader(manager.uri(committed), config=own))
                    return fingerprint(fresh) == saved[committed]
                cyc.loaded = bool(attempt("load", load))
            if committed is not None and settings.due(settings.verify_every, c, first=2):
                report = attempt("verify", lambda: verify(manager.uri(committed), config)) or {}
                cyc.verified = bool(report.get("ok")) and report.get("exit") == 0
                if not cyc.verified and report:
                    cyc.errors.append(f"verify {manager.uri(committed)}: {report}")

            attempt("commit", manager.wait)
            if settings.due(settings.gc_every, c):
                report = attempt("gc", lambda: gc(base_uri, older_than_s=0, client=manager.client))
                if report is not None:
                    cyc.gc_deleted = len(report.deleted) + len(report.aborted_uploads)
                    if cyc.gc_deleted:
                        cyc.errors.append(f"gc deleted {report.deleted[:5]} {report.aborted_uploads[:5]}")
            cyc.cycle_s = time.perf_counter() - t0
            _wait_for_save_threads()
            cyc.sample = sample()
            cycles.append(cyc)
            if progress is not None:
                progress(cyc)
            if (settings.stop_at_growth_bytes is not None and c > 2
                    and cyc.sample["rss_bytes"] - cycles[1].sample["rss_bytes"] > settings.stop_at_growth_bytes):
                break  # the "ran every cycle" criterion says why
    return cycles


def _wait_for_save_threads(timeout_s: float = 10.0) -> None:
    """Let the last save's thread end (it gives its staging arena back when it has), so every
    sample is taken at the same point: nothing of a save still running."""
    from s3dcp.saving.staging import shared_pool

    deadline = time.monotonic() + timeout_s
    while shared_pool().in_use and time.monotonic() < deadline:
        time.sleep(0.005)


# ---------------------------------------------------------------------------- judging
@dataclass(frozen=True)
class Criterion:
    name: str
    passed: bool
    measured: str  # the value, in words
    limit: str

    def line(self) -> str:
        return f"{'PASS' if self.passed else 'FAIL'}  {self.name}: {self.measured} (limit: {self.limit})"


def window(settings: SoakSettings, cycles_run: int) -> int:
    """Cycles looked at, at each end of the run: whole periods of the periodic operations (the
    least common multiple of the ``every`` values), at least ``MIN_WINDOW`` cycles, at most
    half of the cycles after cycle 2; both ends then hold the same mix of operations."""
    period = 1
    for every in (settings.load_every, settings.verify_every, settings.sync_every, settings.gc_every):
        if every > 0:
            period = math.lcm(period, every)
    w = period * math.ceil(MIN_WINDOW / period)
    return max(1, min(w, (cycles_run - 2) // 2))


def summarize(cycles: list[Cycle], settings: SoakSettings) -> dict:
    """Figures over the run. The *growth* of a quantity is its lowest value over the last
    ``window`` cycles minus its lowest value over the first ``window`` cycles after cycle 2.
    What leaks stays, so it lifts the low values with every cycle; what is let go a little later
    (part buffers the CRT trims a second after its last request, a connection closed when idle,
    a native client that lingers a few seconds in case it is needed again) lifts only some
    samples, and not the lowest."""
    w = window(settings, len(cycles))
    first, last = cycles[2:2 + w], cycles[-w:]
    base = cycles[1].sample

    out: dict[str, Any] = {
        "state_bytes": settings.state_bytes,
        "cycles": len(cycles),
        "cycles_asked": settings.cycles,
        "stop_at_growth_bytes": settings.stop_at_growth_bytes,
        "window_cycles": w,
    }
    for key in ("rss_bytes", "rss_untrimmed_bytes", "py_threads", "os_threads", "fds", "other_fds", "sockets",
                "arenas", "arena_bytes"):
        low_first = min(c.sample[key] for c in first)
        low_last = min(c.sample[key] for c in last)
        out[key] = {
            "cycle2": base[key],
            "first_window_low": low_first,
            "last_window_low": low_last,
            "growth": low_last - low_first,
            "max_after_cycle2": max(c.sample[key] for c in cycles[2:]),
            "end": cycles[-1].sample[key],
        }
    out["sockets_over_bound"] = sum(c.sample["sockets"] > c.sample["socket_bound"] for c in cycles[2:])
    between = max(1, len(cycles) - 2 - w)  # cycles from the first window's middle to the last's
    out["rss_growth_per_cycle_bytes"] = out["rss_bytes"]["growth"] / between
    out["rss_trend_bytes"] = growth_beyond_one_step([c.sample["rss_bytes"] for c in cycles[2:]])
    out["rss_held_bytes"] = statistics.median(c.sample["rss_bytes"] for c in last) - base["rss_bytes"]
    # the second half alone, its last half's median over its first half's: a leak keeps rising
    # there, glibc's plateau does not (it moves in a band of a few steps, whose lows are luck)
    late = cycles[max(2, len(cycles) // 2):]
    half = len(late) // 2
    out["late_cycles"] = len(late)
    out["rss_late_growth_bytes"] = (statistics.median(c.sample["rss_bytes"] for c in late[half:])
                                    - statistics.median(c.sample["rss_bytes"] for c in late[:half])
                                    ) if len(late) >= 2 * w else None
    heaps = [(c.sample.get("malloc") or {}).get("thread_heap_bytes") for c in [cycles[1], *last]]
    out["thread_heap_growth_bytes"] = (statistics.median(heaps[1:]) - heaps[0]) if None not in heaps else None
    out.update(
        saves=len(cycles),
        loads=sum(c.loaded is not None for c in cycles),
        loads_equal=sum(bool(c.loaded) for c in cycles),
        verifies=sum(c.verified is not None for c in cycles),
        verifies_ok=sum(bool(c.verified) for c in cycles),
        sync_saves=sum(c.sync_saved is not None for c in cycles),
        gc_runs=sum(c.gc_deleted is not None for c in cycles),
        gc_deleted=sum(c.gc_deleted or 0 for c in cycles),
        errors=[f"cycle {c.cycle}: {e}" for c in cycles for e in c.errors],
        median_stall_s=statistics.median(c.stall_s for c in cycles),
        median_cycle_s=statistics.median(c.cycle_s for c in cycles),
    )
    return out


def growth_beyond_one_step(values: list[float], step_bytes: float = RSS_STEP_SLACK_BYTES) -> float:
    """Net growth of a series once its spikes are smoothed out (the median of the five samples
    around each) and its largest single rise (at most step_bytes) is taken out. glibc moves the
    heap in one-time steps of several MiB, at any cycle; a leak rises again and again, so what
    remains after one step is what grows per checkpoint (a slow leak, a staircase of steps),
    however short the run."""
    n = len(values)
    if n < 2:
        return 0.0
    width = min(5, n)  # at the ends, the window stays whole inside the series
    smooth = [statistics.median(values[min(max(0, i - 2), n - width):][:width]) for i in range(n)]
    largest_rise = max([0.0, *(b - a for a, b in zip(smooth, smooth[1:]))])
    return smooth[-1] - smooth[0] - min(largest_rise, step_bytes)  # one step, of at most step_bytes


def judge(summary: dict) -> list[Criterion]:
    """The pass criteria (see the module docstring) applied to :func:`summarize`'s figures."""
    s = summary
    w = s["window_cycles"]
    rss = s["rss_bytes"]
    limit = RSS_GROWTH_LIMIT * s["state_bytes"]
    n = s["cycles"]
    ends = f"cycles 3-{2 + w} vs {n - w + 1}-{n}" if w > 1 else f"cycle 3 vs {n}"
    flat = s["rss_trend_bytes"] <= limit and s["rss_held_bytes"] <= max(limit, RSS_STEP_SLACK_BYTES)
    plateau = glibc_plateau(s, limit)
    return [
        Criterion("RSS growth after cycle 2", flat or plateau,
                  f"beyond one step {s['rss_trend_bytes'] / MiB:+.1f} MiB over the run = "
                  f"{s['rss_trend_bytes'] / s['state_bytes']:.1%} of the state; held at the end "
                  f"{s['rss_held_bytes'] / MiB:+.1f} MiB over cycle 2 (median of the last {w}); lowest "
                  f"{rss['growth'] / MiB:+.1f} MiB ({ends}); highest "
                  f"{(rss['max_after_cycle2'] - rss['cycle2']) / MiB:+.1f} MiB over cycle 2"
                  + _plateau_note(s, plateau),
                  f"beyond one step {limit / MiB:.1f} MiB = {RSS_GROWTH_LIMIT:.0%} of {s['state_bytes'] / MiB:.0f} MiB; "
                  f"held {max(limit, RSS_STEP_SLACK_BYTES) / MiB:.1f} MiB; or glibc's plateau: flat over the last "
                  f"{PLATEAU_MIN_CYCLES}+ cycles, what is held no more than its thread arenas grew"),
        _flat("Python threads", s, "py_threads", ends),
        _flat("OS threads", s, "os_threads", ends),
        _flat("open fds other than sockets", s, "other_fds", ends),
        Criterion("sockets bounded", s["sockets_over_bound"] == 0,
                  f"highest {s['sockets']['max_after_cycle2']} (cycle 2: {s['sockets']['cycle2']}, end: "
                  f"{s['sockets']['end']}); {s['sockets_over_bound']} samples above their bound",
                  f"{SOCKETS_PER_SLOT} x max_concurrency per native client held"),
        Criterion("staging arenas flat",
                  s["arenas"]["max_after_cycle2"] <= s["arenas"]["cycle2"]
                  and s["arena_bytes"]["max_after_cycle2"] <= s["arena_bytes"]["cycle2"],
                  f"{s['arenas']['cycle2']} allocated by cycle 2 ({s['arena_bytes']['cycle2'] / MiB:.0f} MiB), "
                  f"{s['arenas']['end']} at the end ({s['arena_bytes']['end'] / MiB:.0f} MiB)",
                  "no allocation after cycle 2"),
        Criterion("every checkpoint verified",
                  not s["errors"] and s["loads_equal"] == s["loads"] > 0 and s["verifies_ok"] == s["verifies"] > 0
                  and s["gc_deleted"] == 0,
                  f"{s['saves']} saves committed, {s['loads_equal']}/{s['loads']} loads equal, "
                  f"{s['verifies_ok']}/{s['verifies']} verifies OK, {s['sync_saves']} sync saves, "
                  f"{s['gc_runs']} gc runs deleted {s['gc_deleted']}, {len(s['errors'])} errors",
                  "all, at least one load and one verify, gc deletes nothing, no error"),
        Criterion("ran every cycle", n == s["cycles_asked"],
                  f"{n} of {s['cycles_asked']}" + ("" if n == s["cycles_asked"] else
                  f", stopped: RSS grew past {s['stop_at_growth_bytes'] / MiB:.0f} MiB over cycle 2"),
                  "all (a run stops once RSS grew past --stop-at-growth-mib)"),
    ]


def glibc_plateau(s: dict, limit: float) -> bool:
    """RSS held at the end is glibc's one-time plateau, not a leak: the run's second half is
    long enough (``PLATEAU_MIN_CYCLES``) and the median RSS of its last half is within ``limit``
    of its first half's (a leak keeps rising there; a 300-cycle run catches ~90 KiB a cycle),
    and the thread arenas' heaps grew at least as much as the RSS held (the memory is in the
    arenas glibc gives threads, which it keeps once touched, not in anything s3dcp holds). A
    short run, or one without glibc's figures, cannot tell, and is judged flat or not."""
    late, thread = s.get("rss_late_growth_bytes"), s.get("thread_heap_growth_bytes")
    return (s.get("late_cycles", 0) >= PLATEAU_MIN_CYCLES and late is not None and late <= limit
            and thread is not None and s["rss_held_bytes"] <= thread)


def _plateau_note(s: dict, plateau: bool) -> str:
    late, thread = s.get("rss_late_growth_bytes"), s.get("thread_heap_growth_bytes")
    if late is None or thread is None:
        return ""
    return (f"; second half ({s['late_cycles']} cycles) {late / MiB:+.1f} MiB (median of its last half over "
            f"its first's), glibc thread arenas "
            f"{thread / MiB:+.1f} MiB over cycle 2{': a plateau, not a leak' if plateau else ''}")


def _flat(name: str, s: dict, key: str, ends: str) -> Criterion:
    v = s[key]
    return Criterion(f"{name} flat", v["growth"] <= SLACK[key],
                     f"{v['growth']:+d} ({ends}: lowest {v['first_window_low']} -> {v['last_window_low']}; "
                     f"{v['cycle2']} at cycle 2, highest {v['max_after_cycle2']})",
                     f"+{SLACK[key]}")


# ---------------------------------------------------------------------------- output
def table_rows(cycles: list[Cycle], count: int = 12) -> list[dict]:
    """About ``count`` cycles to print: 1, 2, evenly spaced ones, the last."""
    picks = {0, 1, len(cycles) - 1}
    step = max(1, (len(cycles) - 2) // max(1, count - 3))
    picks.update(range(1, len(cycles), step))
    out = []
    base = cycles[1].sample["rss_bytes"]
    for i in sorted(picks):
        r = cycles[i].row()
        r["rss_mib"] = r["rss_bytes"] / MiB
        r["untrimmed_mib"] = r["rss_untrimmed_bytes"] / MiB
        r["growth_mib"] = (r["rss_bytes"] - base) / MiB
        r["arena_mib"] = r["arena_bytes"] / MiB
        r["ops"] = "".join(flag for flag, v in (("L", r["loaded"]), ("V", r["verified"]), ("S", r["sync_saved"]),
                                                ("G", r["gc_deleted"])) if v is not None)
        out.append(r)
    return out


def plot(cycles: list[Cycle], summary: dict, path: str) -> str | None:
    """RSS, threads and fds over the cycles, as a PNG; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("# matplotlib not installed (pip install 's3dcp[bench]'): no plot", file=sys.stderr)
        return None
    xs = [c.cycle for c in cycles]
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(10, 6), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    base = summary["rss_bytes"]["cycle2"] / MiB
    a1.plot(xs, [c.sample["rss_untrimmed_bytes"] / MiB for c in cycles], color="#A6BDDB", lw=0.8,
            label="RSS before malloc_trim")
    a1.plot(xs, [c.sample["rss_bytes"] / MiB for c in cycles], color="#4C72B0", lw=1.2, label="RSS")
    a1.axhline(base, color="#999999", lw=0.8, ls="--", label="cycle 2")
    held = max(RSS_GROWTH_LIMIT * summary["state_bytes"], RSS_STEP_SLACK_BYTES) / MiB
    a1.axhline(base + held, color="#DD5555", lw=0.8, ls="--",
               label=f"limit of RSS held at the end: +{held:.0f} MiB")
    a1.set_ylabel("RSS (MiB)")
    a1.set_title(f"Soak: {summary['cycles']} checkpoint cycles of a {summary['state_bytes'] / MiB:.0f} MiB state")
    a1.legend(loc="upper left", frameon=False)
    a2.plot(xs, [c.sample["os_threads"] for c in cycles], label="OS threads", color="#55A868")
    a2.plot(xs, [c.sample["py_threads"] for c in cycles], label="Python threads", color="#8172B2")
    a2.plot(xs, [c.sample["fds"] for c in cycles], label="open fds", color="#DD8452")
    a2.set_xlabel("cycle")
    a2.set_ylabel("count")
    a2.set_ylim(0, 1.4 * max(max(c.sample["fds"], c.sample["os_threads"]) for c in cycles))
    a2.legend(loc="upper left", frameon=False, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = SoakSettings()
    parser.add_argument("--cycles", type=int, default=d.cycles, help=f"checkpoint cycles (default {d.cycles})")
    parser.add_argument("--state-mib", type=int, default=d.state_bytes // MiB,
                        help=f"state size in MiB (default {d.state_bytes // MiB})")
    parser.add_argument("--load-every", type=int, default=d.load_every, metavar="K",
                        help=f"load into a fresh state every K cycles (default {d.load_every}; 0: never)")
    parser.add_argument("--verify-every", type=int, default=d.verify_every, metavar="K",
                        help=f"s3dcp verify every K cycles (default {d.verify_every}; 0: never)")
    parser.add_argument("--sync-every", type=int, default=d.sync_every, metavar="K",
                        help=f"synchronous save of non-contiguous tensors every K cycles (default {d.sync_every})")
    parser.add_argument("--gc-every", type=int, default=d.gc_every, metavar="K",
                        help=f"s3dcp.gc every K cycles (default {d.gc_every}; 0: never)")
    parser.add_argument("--keep-last", type=int, default=d.keep_last, help=f"retention (default {d.keep_last})")
    parser.add_argument("--same-config-for-loads", action="store_true",
                        help="loads use the run's S3Config (default: each load a config of its own, as "
                             "when credentials rotate, so each load makes a native client)")
    parser.add_argument("--stop-at-growth-mib", type=int, default=d.stop_at_growth_bytes // MiB, metavar="M",
                        help="stop (FAIL) once RSS grew by M MiB past cycle 2, to spare a shared machine "
                             f"(default {d.stop_at_growth_bytes // MiB}; 0: never)")
    add_common_args(parser, repeats=1)
    parser.set_defaults(out="results/soak")
    args = parser.parse_args(argv)
    try:
        settings = SoakSettings(cycles=args.cycles, state_bytes=args.state_mib * MiB, load_every=args.load_every,
                                verify_every=args.verify_every, sync_every=args.sync_every,
                                gc_every=args.gc_every, keep_last=args.keep_last,
                                config_per_load=not args.same_config_for_loads,
                                stop_at_growth_bytes=args.stop_at_growth_mib * MiB or None)
    except ValueError as e:
        parser.error(str(e))

    with s3_target(args) as target:
        base_uri = target.uri(unique_prefix(target, "soak"))
        print(f"# {settings.cycles} cycles of a {settings.state_bytes / MiB:.0f} MiB state under {base_uri}; "
              f"load every {settings.load_every}, verify every {settings.verify_every}, sync save every "
              f"{settings.sync_every}, gc every {settings.gc_every}, keep_last={settings.keep_last}; "
              f"MALLOC_ARENA_MAX={os.environ.get('MALLOC_ARENA_MAX', 'unset')}, "
              f"MALLOC_MMAP_THRESHOLD_={os.environ.get('MALLOC_MMAP_THRESHOLD_', 'unset')}", flush=True)
        started = time.perf_counter()
        tick = max(1, settings.cycles // 20)

        def progress(c: Cycle) -> None:
            if c.cycle % tick == 0 or c.cycle <= 2:
                print(f"#   cycle {c.cycle}: RSS {c.sample['rss_bytes'] / MiB:.0f} MiB, "
                      f"{c.sample['os_threads']} threads, {c.sample['fds']} fds, "
                      f"{time.perf_counter() - started:.0f} s" + (f", errors: {c.errors}" if c.errors else ""),
                      file=sys.stderr, flush=True)

        cycles = run_soak(target.config, base_uri, settings, progress=progress)
        wall_s = time.perf_counter() - started
        from s3dcp.s3.client import S3Client
        from s3dcp.lifecycle.directories import scan_directories
        from s3dcp.lifecycle.manager import delete_checkpoint
        from s3dcp.uri import parse_s3_uri

        client = S3Client(target.config)  # leave the bucket as we found it
        base = parse_s3_uri(base_uri)
        for directory in scan_directories(client, base):
            delete_checkpoint(client, parse_s3_uri(f"s3://{base.bucket}/{directory}"))

    summary = summarize(cycles, settings)
    summary["wall_s"] = wall_s
    criteria = judge(summary)
    print()
    print_table(table_rows(cycles), [
        ("cycle", "cycle"), ("ops", "ops"), ("rss_mib", "RSS MiB", ".1f"), ("growth_mib", "vs c2 MiB", "+.1f"),
        ("untrimmed_mib", "untrimmed", ".1f"),
        ("py_threads", "py thr"), ("os_threads", "OS thr"), ("fds", "fds"), ("arenas", "arenas"),
        ("arena_mib", "arena MiB", ".0f"), ("stall_s", "stall s", ".3f"), ("cycle_s", "cycle s", ".2f"),
    ], title=f"Soak: {len(cycles)} of {settings.cycles} cycles in {wall_s:.0f} s (ops: L load, V verify, S sync save, G gc)")
    print()
    for criterion in criteria:
        print(criterion.line())
    passed = all(c.passed for c in criteria)
    print(f"\n{'PASS' if passed else 'FAIL'}: {sum(c.passed for c in criteria)}/{len(criteria)} criteria")
    for error in summary["errors"][:10]:
        print(f"  {error}")

    path = results_path(args, "soak")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    picture = plot(cycles, summary, os.path.splitext(path)[0] + "-rss.png")
    write_json(path, {
        "benchmark": "soak", "environment": environment_info(), "target": target.describe(),
        "settings": asdict(settings), "summary": summary, "passed": passed,
        "criteria": [asdict(c) for c in criteria], "cycles": [c.row() for c in cycles],
    })
    print(f"\nresults: {path}" + (f"\nplot: {picture}" if picture else ""))
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
