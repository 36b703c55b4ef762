"""Shared helpers for the s3dcp benchmarks.

    with s3_target(args) as target:      # --endpoint/--bucket, or an embedded SeaweedFS server
        client = S3Client(target.config)
        m = measure(lambda: client.put(target.bucket, "k", buf).result(), server_pid=target.server_pid)
        m.wall_s, m.cpu_s, m.server_cpu_s

Everything here is independent of any one benchmark: target selection, CPU/wall measurement
(in one process, or barrier-bracketed across torch.distributed ranks), interleaved repeats,
peak-RSS sampling, aligned text tables and JSON results. Credentials are never printed or
written: :meth:`Target.describe` is the only view of a target meant for output.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as _dt
import json
import math
import os
import platform
import re
import statistics
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

import psutil

MiB = 1024 * 1024
GiB = 1024 * MiB

__all__ = [
    "MiB", "GiB", "Target", "s3_target", "add_common_args", "Measurement", "measure", "DistMeasurement",
    "dist_measure", "interleaved", "median", "summarize", "print_table", "write_json", "results_path",
    "peak_rss_sampler", "environment_info", "gbps", "per_gib", "unique_prefix", "delete_prefix",
    "boto3_client_for", "release_memory",
]


# ---------------------------------------------------------------------------- target
@dataclass
class Target:
    """Where a benchmark sends its bytes. ``config`` holds the credentials: never print it whole
    (``S3Config``'s repr hides the keys, but don't rely on that either); use :meth:`describe`."""

    config: Any  # s3dcp.config.S3Config
    bucket: str
    endpoint_url: str
    server_pid: int | None = None  # local server process whose CPU we can measure, else None
    embedded: bool = False  # True: a SeaweedServer this process started (and will stop)
    run_id: str = field(default_factory=lambda: _dt.datetime.now().strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6])
    _boto3_factory: Callable[..., Any] | None = field(default=None, repr=False)

    def boto3_client(self, **config_overrides):
        """A boto3 S3 client for the same endpoint and credentials (path-style unless AWS)."""
        return self._boto3_factory(**config_overrides)

    def s3_client(self, **config_changes):
        """An :class:`s3dcp.s3.client.S3Client` for the target (``config_changes`` applied to the config)."""
        from s3dcp.s3.client import S3Client

        return S3Client(self.config.replace(**config_changes) if config_changes else self.config)

    def uri(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix.strip('/')}"

    def prefix(self, *parts: str) -> str:
        """A key prefix unique to this run: ``s3dcp-bench/<run id>/<parts...>``."""
        return "/".join(["s3dcp-bench", self.run_id, *[p.strip("/") for p in parts if p]])

    def describe(self) -> dict:
        """What may be printed or stored about the target (no credentials)."""
        return {
            "endpoint_url": self.endpoint_url,
            "bucket": self.bucket,
            "region": self.config.region,
            "embedded_seaweedfs": self.embedded,
            "server_pid_measured": self.server_pid is not None,
            "run_id": self.run_id,
        }


def add_common_args(parser: argparse.ArgumentParser, *, repeats: int = 3) -> argparse.ArgumentParser:
    """The options every benchmark takes."""
    g = parser.add_argument_group("target and output")
    g.add_argument("--endpoint", metavar="URL",
                   help="S3 endpoint to benchmark (credentials and region from the standard AWS "
                        "environment). Default: AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL when --bucket is "
                        "given, else an embedded SeaweedFS server on 127.0.0.1 started for this run")
    g.add_argument("--bucket", metavar="NAME",
                   help="bucket to use (must exist for an external endpoint; default 'bench' on the "
                        "embedded server)")
    g.add_argument("--server-pid", type=int, metavar="PID",
                   help="pid of a local S3 server behind --endpoint, to measure its CPU too")
    g.add_argument("--repeats", type=int, default=repeats, metavar="N",
                   help=f"timed repeats of every case, interleaved (default {repeats}); medians are reported")
    g.add_argument("--out", default="results/", metavar="DIR",
                   help="directory for the JSON results (default results/)")
    g.add_argument("--json", metavar="PATH",
                   help="write the JSON results to PATH instead of DIR/<benchmark>-<time>.json")
    return parser


@contextlib.contextmanager
def s3_target(args: argparse.Namespace, *, default_bucket: str = "bench", quiet: bool = False) -> Iterator[Target]:
    """The S3 target of a benchmark run (see ``add_common_args``).

    External: ``--endpoint`` (or the AWS endpoint variables together with ``--bucket``), with
    credentials from the AWS environment. Otherwise an embedded ``SeaweedServer`` with the bucket,
    stopped when the context exits (also on Ctrl-C and errors).
    """
    from s3dcp.config import S3Config

    endpoint = getattr(args, "endpoint", None)
    bucket = getattr(args, "bucket", None)
    if not endpoint and bucket:
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        if not bucket:
            raise SystemExit("error: --bucket is required with an external endpoint")
        config = S3Config(endpoint_url=endpoint).resolved()
        server_pid = getattr(args, "server_pid", None)
        if server_pid is not None and not psutil.pid_exists(server_pid):
            raise SystemExit(f"error: --server-pid {server_pid}: no such process")

        def factory(**overrides):
            return boto3_client_for(config, **overrides)

        target = Target(config=config, bucket=bucket, endpoint_url=config.endpoint_url,
                        server_pid=server_pid, embedded=False, _boto3_factory=factory)
        if not quiet:
            print(f"# target: external endpoint {config.endpoint_url}, bucket {bucket}; {_load_note()}", flush=True)
        yield target
        return

    from s3dcp.testing import SeaweedServer

    bucket = bucket or default_bucket
    server = SeaweedServer(buckets=[bucket])
    t0 = time.perf_counter()
    server.start()
    try:
        target = Target(config=server.s3_config(), bucket=bucket, endpoint_url=server.endpoint_url,
                        server_pid=server.pid, embedded=True, _boto3_factory=server.boto3_client)
        if not quiet:
            print(f"# target: embedded SeaweedFS at {server.endpoint_url} (pid {server.pid}, started in "
                  f"{time.perf_counter() - t0:.1f} s), bucket {bucket}; {_load_note()}", flush=True)
        yield target
    finally:
        server.stop()


def _load_note() -> str:
    try:
        one, five, _ = os.getloadavg()
    except OSError:
        return "load average unknown"
    return f"load average {one:.1f}/{five:.1f} on {os.cpu_count()} CPUs (other work skews wall times)"


def boto3_client_for(config, **overrides):
    """A boto3 S3 client for an S3Config's endpoint and credentials (picklable configs travel to
    spawned ranks; boto3 clients do not). Path-style unless the config says virtual-hosted."""
    import boto3
    from botocore.config import Config

    options: dict[str, Any] = dict(signature_version="s3v4", retries={"max_attempts": 5, "mode": "standard"})
    if config.use_path_style:
        options["s3"] = {"addressing_style": "path"}
    if _is_loopback_url(config.endpoint_url):
        options["proxies"] = {}  # loopback traffic must never go through a proxy from the environment
    options.update(overrides)
    kwargs: dict[str, Any] = dict(endpoint_url=config.endpoint_url, region_name=config.region,
                                  config=Config(**options))
    if config.access_key_id is not None:
        kwargs.update(aws_access_key_id=config.access_key_id, aws_secret_access_key=config.secret_access_key,
                      aws_session_token=config.session_token)
    session = boto3.session.Session(profile_name=config.profile) if config.profile else boto3.session.Session()
    return session.client("s3", **kwargs)


def _is_loopback_url(url: str) -> bool:
    from urllib.parse import urlsplit

    from s3dcp.config import is_loopback_host

    return is_loopback_host(urlsplit(url).hostname or "")


def unique_prefix(target: Target, *parts: str) -> str:
    """A fresh key prefix under the run's prefix (every save gets its own)."""
    return target.prefix(*parts, uuid.uuid4().hex[:8])


def delete_prefix(client, bucket: str, prefix: str) -> int:
    """Delete every object under ``prefix`` with an s3dcp ``S3Client``; returns how many."""
    objects, _ = client.list(bucket, prefix.rstrip("/") + "/").result()
    keys = [o.key for o in objects]
    if keys:
        client.delete(bucket, keys).result()
    return len(keys)


# ---------------------------------------------------------------------------- measurement
def _cpu_s(proc: psutil.Process, children: bool = False) -> float:
    t = proc.cpu_times()
    total = t.user + t.system
    if children:
        total += t.children_user + t.children_system  # children already waited for
        for child in proc.children(recursive=True):  # children still running
            try:
                ct = child.cpu_times()
                total += ct.user + ct.system
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
    return total


class _ServerCpu:
    """CPU seconds of a (local) server process and its children; None when there is none."""

    def __init__(self, pid: int | None) -> None:
        self.proc = None
        if pid is not None:
            try:
                self.proc = psutil.Process(pid)
            except psutil.NoSuchProcess:
                self.proc = None

    def read(self) -> float | None:
        if self.proc is None:
            return None
        try:
            return _cpu_s(self.proc, children=True)
        except psutil.NoSuchProcess:
            return None


@dataclass
class Measurement:
    wall_s: float
    cpu_s: float  # this process (all threads), plus its children when asked
    server_cpu_s: float | None  # the local server, None when not measured
    value: Any = field(default=None, repr=False)  # what fn returned

    def to_dict(self) -> dict:
        return {"wall_s": self.wall_s, "cpu_s": self.cpu_s, "server_cpu_s": self.server_cpu_s}


def measure(fn: Callable[[], Any], *, server_pid: int | None = None, children: bool = False) -> Measurement:
    """Run ``fn()`` once: wall seconds, this process's CPU seconds (user + system, every
    thread; plus child processes with ``children=True``) and the server's CPU seconds."""
    me = psutil.Process()
    server = _ServerCpu(server_pid)
    s0 = server.read()
    c0 = _cpu_s(me, children)
    t0 = time.perf_counter()
    value = fn()
    wall = time.perf_counter() - t0
    c1 = _cpu_s(me, children)
    s1 = server.read()
    return Measurement(wall, c1 - c0, None if s0 is None or s1 is None else s1 - s0, value)


@dataclass
class DistMeasurement:
    """One collective step measured on every rank (see :func:`dist_measure`)."""

    wall_s: float  # rank 0's view, barrier to barrier: the slowest rank decides
    cpu_s: list[float]  # per rank
    server_cpu_s: float | None
    peak_rss: list[int] | None = None  # per rank, bytes, when sampled
    rss_before: list[int] | None = None
    value: Any = field(default=None, repr=False)  # this rank's return value of fn

    @property
    def cpu_total_s(self) -> float:
        return sum(self.cpu_s)

    def to_dict(self) -> dict:
        return {"wall_s": self.wall_s, "cpu_s": self.cpu_s, "cpu_total_s": self.cpu_total_s,
                "server_cpu_s": self.server_cpu_s, "peak_rss": self.peak_rss, "rss_before": self.rss_before}


def dist_measure(fn: Callable[[], Any], *, server_pid: int | None = None, sample_rss: bool = False,
                 rss_interval_s: float = 0.01, gather_value: bool = False) -> DistMeasurement:
    """Run ``fn()`` on every rank of the default process group, bracketed by barriers.

    Every rank measures its own CPU (and peak RSS with ``sample_rss``); rank 0 measures wall
    time and the server's CPU (pass ``server_pid`` there). The figures are all-gathered, so
    every rank returns the same measurement (``value`` is this rank's return value, or every
    rank's, in rank order, with ``gather_value``). Without an initialised process group it
    measures this process alone.
    """
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    me = psutil.Process()
    server = _ServerCpu(server_pid)
    if distributed:
        dist.barrier()
    s0 = server.read()
    c0 = _cpu_s(me)
    t0 = time.perf_counter()
    sampler = peak_rss_sampler(rss_interval_s) if sample_rss else contextlib.nullcontext()
    with sampler as rss:
        value = fn()
        c1 = _cpu_s(me)  # before the barrier: a rank waiting for others is not working
        if distributed:
            dist.barrier()
    wall = time.perf_counter() - t0
    s1 = server.read()
    mine = {"cpu": c1 - c0, "wall": wall,
            "server": None if s0 is None or s1 is None else s1 - s0,
            "peak": rss.peak if sample_rss else None, "before": rss.before if sample_rss else None,
            "value": value if gather_value else None}
    if distributed:
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    else:
        everyone = [mine]
    return DistMeasurement(
        wall_s=everyone[0]["wall"],
        cpu_s=[e["cpu"] for e in everyone],
        server_cpu_s=next((e["server"] for e in everyone if e["server"] is not None), None),
        peak_rss=[e["peak"] for e in everyone] if sample_rss else None,
        rss_before=[e["before"] for e in everyone] if sample_rss else None,
        value=[e["value"] for e in everyone] if gather_value else value,
    )


def data_gets(records) -> tuple[int, int]:
    """(bytes, GETs) of data objects (``.distcp``) in fault-proxy request records, bytes from their Range headers."""
    total = gets = 0
    for r in records:
        if r.method == "GET" and ".distcp" in r.target:
            gets += 1
            rng = r.header("range") or ""
            if rng.startswith("bytes="):
                lo, _, hi = rng[6:].partition("-")
                total += int(hi) - int(lo) + 1
    return total, gets


def release_memory() -> None:
    """Collect garbage and give freed heap back to the OS (glibc ``malloc_trim``), so the RSS
    before a measured step does not hide memory the step reuses from an earlier one."""
    import gc

    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def interleaved(runs: dict[str, Callable[[], Any] | tuple[Callable[[], Any], Callable[[], Any]]], repeats: int,
                *, server_pid: int | None = None, children: bool = False,
                progress: Callable[[str, int, Measurement], None] | None = None) -> dict[str, list[Measurement]]:
    """Run every case once per repeat, interleaved (A B C A B C ...), so drift (page cache,
    thermal, a neighbour's load) spreads over all cases instead of biasing one.

    A case is ``fn`` or ``(setup, fn)``: ``setup()`` runs untimed right before ``fn``.
    Returns ``{name: [Measurement per repeat]}``.
    """
    results: dict[str, list[Measurement]] = {name: [] for name in runs}
    for r in range(repeats):
        for name, case in runs.items():
            setup, fn = case if isinstance(case, tuple) else (None, case)
            if setup is not None:
                setup()
            m = measure(fn, server_pid=server_pid, children=children)
            results[name].append(m)
            if progress is not None:
                progress(name, r, m)
    return results


def median(values: Iterable[float | None]) -> float | None:
    """Median of the values that are not None (None if there are none)."""
    vals = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return statistics.median(vals) if vals else None


def summarize(measurements: Sequence[Measurement | DistMeasurement], nbytes: int) -> dict:
    """Medians of a case's repeats: wall, GB/s (10^9 B/s), CPU and server CPU per GiB."""
    wall = median(m.wall_s for m in measurements)
    cpu = median((m.cpu_total_s if isinstance(m, DistMeasurement) else m.cpu_s) for m in measurements)
    server = median(m.server_cpu_s for m in measurements)
    return {
        "wall_s": wall,
        "gbps": gbps(nbytes, wall),
        "cpu_s_per_gib": per_gib(cpu, nbytes),
        "server_cpu_s_per_gib": per_gib(server, nbytes),
        "wall_s_all": [m.wall_s for m in measurements],
        "bytes": nbytes,
    }


def gbps(nbytes: int, seconds: float | None) -> float | None:
    """Throughput in GB/s (10^9 bytes per second)."""
    return nbytes / seconds / 1e9 if seconds else None


def per_gib(seconds: float | None, nbytes: int) -> float | None:
    """Seconds per GiB moved."""
    return seconds / (nbytes / GiB) if seconds is not None and nbytes else None


# ---------------------------------------------------------------------------- memory
class _RssSampler:
    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.proc = psutil.Process()
        self.before = self.proc.memory_info().rss
        self.peak = self.before
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def _sample(self) -> None:
        rss = self.proc.memory_info().rss
        self.samples += 1
        if rss > self.peak:
            self.peak = rss

    @property
    def extra(self) -> int:
        """Peak RSS above the RSS at entry, in bytes."""
        return self.peak - self.before


@contextlib.contextmanager
def peak_rss_sampler(interval_s: float = 0.01) -> Iterator[_RssSampler]:
    """Sample this process's RSS every ``interval_s`` in a background thread; the yielded
    object has ``.peak``, ``.before`` and ``.extra`` (bytes), final after the block exits.
    A spike shorter than the interval can be missed; the final RSS is always sampled."""
    sampler = _RssSampler(interval_s)
    sampler._thread.start()
    try:
        yield sampler
    finally:
        sampler._stop.set()
        sampler._thread.join()
        sampler._sample()


# ---------------------------------------------------------------------------- output
def _fmt(value: Any, spec: str | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and math.isnan(value):
        return "-"
    if spec and isinstance(value, (int, float)) and not isinstance(value, bool):
        return format(value, spec)
    return str(value)


def print_table(rows: Sequence[dict], columns: Sequence[str | tuple], *, title: str | None = None,
                file=None) -> str:
    """Print ``rows`` (dicts) as an aligned text table and return the text.

    A column is ``key``, ``(key, header)`` or ``(key, header, format_spec)`` such as
    ``("gbps", "GB/s", ".3f")``. Numbers are right-aligned, text left-aligned; None prints "-".
    """
    cols = []
    for c in columns:
        if isinstance(c, str):
            cols.append((c, c, None))
        else:
            key, header, spec = (tuple(c) + (None, None))[:3]
            cols.append((key, header or key, spec))
    cells = [[_fmt(row.get(key), spec) for key, _, spec in cols] for row in rows]
    numeric = [all(isinstance(row.get(key), (int, float)) or row.get(key) is None for row in rows)
               for key, _, _ in cols]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, (_, h, _) in enumerate(cols)]

    def line(values: Sequence[str]) -> str:
        out = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)]
        return "  ".join(out).rstrip()

    lines = []
    if title:
        lines.append(title)
    lines.append(line([h for _, h, _ in cols]))
    lines.append("  ".join("-" * w for w in widths))
    lines.extend(line(r) for r in cells)
    text = "\n".join(lines)
    print(text, file=file or sys.stdout, flush=True)
    return text


HIDDEN = "<hidden>"
# Keys whose values are credentials wherever they appear (an env dict: AWS_SECRET_ACCESS_KEY).
_SECRET_KEY = re.compile(r"secret|session_token|password|credential", re.IGNORECASE)


def _shown_fields(obj: Any) -> dict:
    """A dataclass as the fields its repr shows: one hidden from repr (S3Config's keys and
    token) is hidden from the results too, at any depth."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.repr}


def _scrubbed(obj: Any) -> Any:
    """``obj`` with every value under a credential-like key replaced by :data:`HIDDEN` (the
    encoder's ``default`` never sees dicts)."""
    if isinstance(obj, dict):
        return {k: HIDDEN if isinstance(k, str) and _SECRET_KEY.search(k) else _scrubbed(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_scrubbed(v) for v in obj]
    return obj


def _json_default(obj: Any):
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _scrubbed(obj.to_dict() if hasattr(obj, "to_dict") else _shown_fields(obj))
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    if hasattr(obj, "item"):  # numpy / torch scalars
        return obj.item()
    return str(obj)  # reprs hide keys too (S3Config, SeaweedServer)


def write_json(path: str, obj: Any) -> str:
    """Write ``obj`` as indented JSON (creating directories); returns the path. No credential is
    ever written: fields hidden from a dataclass's repr are left out, and values under
    credential-like keys (``secret``, ``session_token``, ``password``, ``credential``) are
    :data:`HIDDEN`."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(_scrubbed(obj), f, indent=2, default=_json_default, allow_nan=False)
        f.write("\n")
    os.replace(tmp, path)
    return path


def results_path(args: argparse.Namespace, name: str) -> str:
    """``--json`` if given, else ``<--out>/<name>-<timestamp>.json``."""
    if getattr(args, "json", None):
        return args.json
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return os.path.join(getattr(args, "out", None) or "results", f"{name}-{stamp}.json")


def environment_info() -> dict:
    """Versions and machine facts to store next to the numbers."""
    info: dict[str, Any] = {
        "time": _dt.datetime.now().isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_gib": round(psutil.virtual_memory().total / GiB, 1),
        "argv": sys.argv,
    }
    for mod in ("torch", "awscrt", "boto3", "botocore", "s3transfer", "s3dcp"):
        try:
            m = __import__(mod)
            info[mod] = getattr(m, "__version__", None) or _dist_version(mod)
        except Exception:  # noqa: BLE001 - informational only
            info[mod] = None
    try:
        info["load_avg_1_5_15min"] = os.getloadavg()  # when the results were written
    except OSError:
        pass
    return info


def _dist_version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # noqa: BLE001
        return None
