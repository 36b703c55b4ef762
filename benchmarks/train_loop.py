"""The main job: a training loop that checkpoints, in four ways, and what each costs it.

    python benchmarks/train_loop.py                 # embedded S3 server; about a minute on a quiet 2-core machine
    python benchmarks/train_loop.py --nproc 2       # two ranks (gloo), each holding half the state
    python benchmarks/train_loop.py --endpoint https://s3.us-east-1.amazonaws.com --bucket my-bucket

A small MLP (sized so that weights + AdamW state = --state-mib per run) trains on synthetic
data on the CPU and checkpoints, in each mode:

    monolithic   gather to rank 0, torch.save, boto3 upload (what the seed scenario did)
    fs-sync      dcp.save with DCP's FileSystemWriter to local disk
    s3-sync      dcp.save with S3StorageWriter
    s3-async     dcp.async_save with S3StorageWriter, staging in the background (the training loop
                 waits only for staging, before its next optimizer step)

The modes run interleaved, in rounds: each round gives every mode one checkpoint followed by
--every training steps, in a rotated order, so a busy spell of the machine hits every mode
alike. A mode's round ends when its checkpoint is durable: an upload still running then is
time the loop would have waited for at its next checkpoint (back-pressure) and is counted
as stalled. Each mode keeps its own model, optimizer and clock; the timeline plot draws every
mode against its own clock (the time it ran, other modes' turns left out).

Stall = the time a checkpoint blocks the loop. Reported per mode: median stall, the fraction of
the mode's time stalled, step time with and without an upload running in the background,
checkpoint bytes, time until durable and GB/s. Results go to JSON and (with matplotlib) to two
PNG plots in --out.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import io
import os
import shutil
import socket
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from common import (  # noqa: E402
    MiB, add_common_args, boto3_client_for, environment_info, median, print_table, results_path,
    s3_target, unique_prefix, write_json,
)

MODES = ("monolithic", "fs-sync", "s3-sync", "s3-async")
WIDTH = 1024  # hidden size: each layer is WIDTH x WIDTH fp32 weights (+ bias)

# DCP says this on every single-process save; a one-rank run is what it means.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")

HOW_TO_READ = """\
How to read this: every mode trained the same model and checkpointed it the same number of
times; the modes took turns (rounds, rotated order), so machine noise is spread over all of
them. "stall s" is how long one checkpoint call held the training loop (median, slowest rank);
"stalled %" adds the time spent waiting for a previous upload still running (back-pressure) and
divides by the mode's own run time. "step s (upload)" is a training step while an async upload
runs beside it: what the upload takes from training on this machine (with the embedded server,
the S3 server's work too shares these cores). "durable s" runs from the checkpoint call until the
checkpoint is committed. The "x" columns are ratios of median stalls measured in this run
(two significant digits). In the timeline plot, each row is one mode on its own clock: blue
are steps, light blue steps with an upload in flight, red the loop standing still, and the
green lane below each row is each upload from the checkpoint call until durable."""


@dataclass
class ModeResult:
    """One mode on one rank, on the mode's own clock (seconds it ran; other modes' turns left out)."""

    mode: str
    steps: list = field(default_factory=list)  # (start_s, seconds, upload_in_flight) per step
    stalls: list = field(default_factory=list)  # (start_s, seconds, kind) kind: "checkpoint" | "backpressure"
    uploads: list = field(default_factory=list)  # (call_s, durable_s) per checkpoint
    wall_s: float = 0.0  # the mode's own run time
    checkpoint_bytes: int = 0


def build(layers: int, seed: int):
    torch.manual_seed(seed)
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU()]
    model = torch.nn.Sequential(*blocks)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, optimizer


def state_of(model, optimizer, rank: int) -> dict:
    # Each rank holds a different part of the job's state (its own layers): the keys say whose.
    return {f"rank{rank}": {"model": model.state_dict(), "optim": optimizer.state_dict()}}


def bytes_of(state) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(bytes_of(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(bytes_of(v) for v in state)
    return 0


def train_step(model, optimizer, batch, target, before_optimizer=None):
    optimizer.zero_grad(set_to_none=True)
    loss = torch.nn.functional.mse_loss(model(batch), target)
    loss.backward()
    if before_optimizer is not None:
        before_optimizer()  # background staging: the last save's copy is complete before the state changes
    optimizer.step()


# ---------------------------------------------------------------------------- checkpoint modes
class Checkpointer:
    """One mode's checkpoint call: ``save`` returns when the loop may go on, ``pending`` says
    whether an upload still runs, ``finish`` waits for it; ``durable_at`` is when the last
    checkpoint became durable (perf_counter seconds).

    An async save's time is taken by a callback of DCP's future, and ``finish`` waits for that
    callback's own future (``_durable``), not for DCP's: ``future.result()`` may return before
    the callbacks have run, and would then leave the previous checkpoint's time in place."""

    def __init__(self, mode: str, args, config, bucket: str, scratch: str, rank: int, world: int):
        self.mode, self.args, self.config, self.bucket = mode, args, config, bucket
        self.scratch, self.rank, self.world = scratch, rank, world
        self.future = None  # DCP's future of the upload in flight
        self.staged = None  # DCP's staging_completion of a background stage not waited for yet
        self._durable: concurrent.futures.Future | None = None  # its perf_counter time once durable
        self.durable_at = 0.0
        self.boto3 = boto3_client_for(config) if mode == "monolithic" and rank == 0 else None

    def save(self, state: dict, name: str) -> None:
        from s3dcp import S3StorageWriter

        if self.mode == "monolithic":
            self._monolithic(state, name)
        elif self.mode == "fs-sync":
            dcp.save(state, storage_writer=dcp.FileSystemWriter(os.path.join(self.scratch, name)))
        elif self.mode == "s3-sync":
            dcp.save(state, storage_writer=S3StorageWriter(self._uri(name), config=self.config))
        else:
            config = self.config.replace(staging="background")
            self._track(dcp.async_save(state, storage_writer=S3StorageWriter(self._uri(name), config=config)))
            return
        self.durable_at = time.perf_counter()

    def _track(self, response) -> None:
        """Follow an async save's future: its done time lands in ``self._durable``."""
        self.staged = getattr(response, "staging_completion", None)
        future = getattr(response, "upload_completion", response)
        durable: concurrent.futures.Future = concurrent.futures.Future()
        self.future, self._durable = future, durable
        future.add_done_callback(lambda _f: durable.set_result(time.perf_counter()))

    def wait_staged(self) -> float:
        """Before the optimizer step: wait for a background stage; the seconds waited."""
        staged, self.staged = self.staged, None
        if staged is None:
            return 0.0
        t = time.perf_counter()
        staged.result()
        return time.perf_counter() - t

    def pending(self) -> bool:
        return self._durable is not None and not self._durable.done()

    def finish(self) -> None:
        """Wait until the upload in flight is durable (raising its error); set ``durable_at``."""
        if self.future is not None:
            future, durable, self.future, self._durable = self.future, self._durable, None, None
            self.durable_at = durable.result()  # set by the callback: never the previous checkpoint's time
            future.result()

    def _uri(self, name: str) -> str:
        return f"s3://{self.bucket}/{self.args.prefix}/{self.mode}/{name}"

    def _monolithic(self, state: dict, name: str) -> None:
        gathered = [None] * self.world if self.rank == 0 else None
        if self.world > 1:
            dist.gather_object(state, gathered, dst=0)
        else:
            gathered = [state]
        if self.rank == 0:
            merged = {}
            for part in gathered:
                merged.update(part)
            buf = io.BytesIO()
            torch.save(merged, buf)
            buf.seek(0)
            self.boto3.upload_fileobj(buf, self.bucket, f"{self.args.prefix}/{self.mode}/{name}.pt")
        if self.world > 1:
            dist.barrier()


class ModeRun:
    """One mode's training state and its own clock, run one round at a time."""

    def __init__(self, mode: str, args, config, bucket: str, rank: int, world: int, layers: int) -> None:
        self.mode, self.args, self.rank = mode, args, rank
        self.model, self.optimizer = build(layers, seed=rank)
        gen = torch.Generator().manual_seed(100 + rank)
        self.batch = torch.randn(args.batch, WIDTH, generator=gen)
        self.target = torch.randn(args.batch, WIDTH, generator=gen)
        train_step(self.model, self.optimizer, self.batch, self.target)  # optimizer state exists from here on
        self.result = ModeResult(mode, checkpoint_bytes=bytes_of(self.state()))
        self.scratch = tempfile.mkdtemp(prefix=f"s3dcp-bench-{mode}-")
        self.ckpt = Checkpointer(mode, args, config, bucket, self.scratch, rank, world)
        if mode == "s3-async":
            from s3dcp import S3StorageWriter

            S3StorageWriter(config=config).warm_up(self.state())  # what a user does once, before training
        self.step = 1

    def state(self) -> dict:
        return state_of(self.model, self.optimizer, self.rank)

    def round(self, progress) -> None:
        """A checkpoint, --every training steps, then wait until the checkpoint is durable."""
        r, begin = self.result, time.perf_counter()

        def clock(t: float) -> float:  # perf_counter -> this mode's own time
            return r.wall_s + (t - begin)

        called = time.perf_counter()
        self.ckpt.save(self.state(), f"step-{self.step:06d}")
        r.stalls.append((clock(called), time.perf_counter() - called, "checkpoint"))
        checkpoint = len(r.stalls) - 1  # a background stage's wait before the next optimizer step adds to it
        for _ in range(self.args.every):
            t0 = time.perf_counter()
            in_flight = self.ckpt.pending()
            waited = []
            train_step(self.model, self.optimizer, self.batch, self.target,
                       before_optimizer=lambda: waited.append((time.perf_counter(), self.ckpt.wait_staged())))
            if waited and waited[0][1] > 0:  # part of the checkpoint's stall, not of the step
                start, seconds, kind = r.stalls[checkpoint]
                r.stalls[checkpoint] = (start, seconds + waited[0][1], kind)
            r.steps.append((clock(t0), time.perf_counter() - t0 - (waited[0][1] if waited else 0.0), in_flight))
            self.step += 1
            if progress is not None:
                progress.update(1)
        waited = time.perf_counter()
        self.ckpt.finish()  # the next checkpoint would wait for it here anyway (back-pressure)
        if self.ckpt.durable_at > waited:
            r.stalls.append((clock(waited), self.ckpt.durable_at - waited, "backpressure"))
        r.uploads.append((clock(called), clock(self.ckpt.durable_at)))
        r.wall_s = clock(max(time.perf_counter(), self.ckpt.durable_at))

    def close(self) -> None:
        shutil.rmtree(self.scratch, ignore_errors=True)


def run_modes(args, config, bucket: str, rank: int, world: int, layers: int, progress) -> list[ModeResult]:
    """Every mode, round after round, each round in a rotated order."""
    runs = [ModeRun(mode, args, config, bucket, rank, world, layers) for mode in args.modes]
    try:
        for index in range(args.rounds):
            shift = index % len(runs)
            for run in runs[shift:] + runs[:shift]:
                if progress is not None:
                    progress.set_postfix_str(run.mode)
                if world > 1:
                    dist.barrier()
                run.round(progress)
    finally:
        for run in runs:
            run.close()
    return [run.result for run in runs]


# ---------------------------------------------------------------------------- ranks
def worker(rank: int, world: int, port: int, args, config, bucket: str, layers: int, queue) -> None:
    try:
        if world > 1:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
        progress = None
        if rank == 0 and not args.no_progress:
            try:
                from tqdm import tqdm

                progress = tqdm(total=args.rounds * args.every * len(args.modes), unit="step", desc="training",
                                file=sys.stderr)
            except ImportError:
                progress = None
        # Warnings and log records while the bar is drawn would land inside it: collect them and
        # print them once the bar is gone.
        with warnings.catch_warnings(record=True) as caught, _logs_beside(progress):
            warnings.simplefilter("default")
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            try:
                results = run_modes(args, config, bucket, rank, world, layers, progress)
            finally:
                if progress is not None:
                    progress.close()
        if rank == 0:
            for text in dict.fromkeys(f"{w.category.__name__}: {w.message}" for w in caught):
                print(f"# warning during the run: {text}", file=sys.stderr)
        queue.put((rank, results, None))
    except BaseException as e:  # noqa: BLE001 - report to the parent, whatever it is
        import traceback

        queue.put((rank, None, "".join(traceback.format_exception(e))))
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def _logs_beside(progress):
    """Log records go through tqdm.write while the bar is shown (else they would cut into it)."""
    if progress is None:
        return contextlib.nullcontext()
    from tqdm.contrib.logging import logging_redirect_tqdm

    return logging_redirect_tqdm()


def run_ranks(args, config, bucket: str, layers: int) -> list[list[ModeResult]]:
    import torch.multiprocessing as mp

    if args.nproc == 1:
        import queue as q

        out = q.Queue()
        worker(0, 1, 0, args, config, bucket, layers, out)
        rank, results, error = out.get()
        if error:
            raise SystemExit(error)
        return [results]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args.nproc, port, args, config, bucket, layers, out))
             for r in range(args.nproc)]
    for p in procs:
        p.start()
    gathered = {}
    for _ in procs:
        rank, results, error = out.get(timeout=args.timeout_s)
        if error:
            for p in procs:
                p.kill()
            raise SystemExit(f"rank {rank} failed:\n{error}")
        gathered[rank] = results
    for p in procs:
        p.join(timeout=60)
    return [gathered[r] for r in range(args.nproc)]


# ---------------------------------------------------------------------------- report
def two_digits(x: float | None) -> float | None:
    """``x`` rounded to two significant digits (1.24 -> 1.2, 75.3 -> 75, 1234 -> 1200)."""
    return None if x is None else float(f"{x:.2g}")


def summarize(per_rank: list[list[ModeResult]]) -> list[dict]:
    rows = []
    for i, mode in enumerate(r.mode for r in per_rank[0]):
        results = [ranks[i] for ranks in per_rank]
        lead = results[0]

        def checkpoint_stalls(r: ModeResult) -> list[float]:
            return [d for _, d, kind in r.stalls if kind == "checkpoint"]

        per_ckpt = [checkpoint_stalls(r) for r in results]
        stalls = [max(s[k] for s in per_ckpt) for k in range(min(len(s) for s in per_ckpt))]  # slowest rank
        step_idle = [d for _, d, inflight in lead.steps if not inflight]
        step_busy = [d for _, d, inflight in lead.steps if inflight]
        total_bytes = sum(r.checkpoint_bytes for r in results)
        uploads = [max(r.uploads[k][1] - r.uploads[k][0] for r in results)
                   for k in range(min(len(r.uploads) for r in results))]
        wall = max(r.wall_s for r in results)
        stalled = max(sum(d for _, d, _ in r.stalls) for r in results)
        rows.append({
            "mode": mode,
            "checkpoints": len(stalls),
            "stall_s": median(stalls),
            "stall_first_s": stalls[0] if stalls else None,
            "stall_max_s": max(stalls) if stalls else None,
            "backpressure_s": max(sum(d for _, d, kind in r.stalls if kind == "backpressure") for r in results),
            "stalled_pct": 100.0 * stalled / wall if wall else None,
            "step_s": median(step_idle),
            "step_upload_s": median(step_busy) if step_busy else None,
            "checkpoint_mib": total_bytes / MiB,
            "upload_s": median(uploads),
            "upload_gbps": total_bytes / median(uploads) / 1e9 if uploads else None,
            "wall_s": wall,
        })
    base = next((r for r in rows if r["mode"] == "monolithic"), None)
    sync = next((r for r in rows if r["mode"] == "s3-sync"), None)
    for r in rows:
        r["vs_monolithic"] = base["stall_s"] / r["stall_s"] if base and r["stall_s"] else None
        r["vs_s3_sync"] = sync["stall_s"] / r["stall_s"] if sync and r["stall_s"] else None
    return rows


def log_axis_limits(values: list[float]) -> tuple[float, float]:
    """(bottom, top) of a log axis on which every bar of ``values`` shows: from a third of the
    smallest to three times the largest (matplotlib's own limits, for bars from 0, started
    above a 0.02 s stall when the others were seconds, hiding it)."""
    positive = [v for v in values if v and v > 0] or [1.0]
    return min(positive) / 3, max(positive) * 3


def plot(per_rank: list[list[ModeResult]], rows: list[dict], path_prefix: str) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("# matplotlib not installed (pip install 's3dcp[bench]'): no plots", file=sys.stderr)
        return []
    paths = []
    lead = per_rank[0]
    fig, ax = plt.subplots(figsize=(11, 1.0 * len(lead) + 1.6))
    for y, result in enumerate(lead):
        first = y == 0
        edges = dict(edgecolor="white", linewidth=0.4)  # one box per step
        ax.broken_barh([(s, d) for s, d, inflight in result.steps if not inflight], (y - 0.35, 0.5),
                       facecolors="#4C72B0", label="training step" if first else None, **edges)
        ax.broken_barh([(s, d) for s, d, inflight in result.steps if inflight], (y - 0.35, 0.5),
                       facecolors="#8FAADC", label="step, upload in background" if first else None, **edges)
        ax.broken_barh([(s, d) for s, d, kind in result.stalls if kind == "checkpoint"], (y - 0.4, 0.6),
                       facecolors="#DD5555", label="stalled: checkpoint call" if first else None)
        ax.broken_barh([(s, d) for s, d, kind in result.stalls if kind == "backpressure"], (y - 0.4, 0.6),
                       facecolors="#F0A030", label="stalled: waiting for the previous upload" if first else None)
        ax.broken_barh([(a, b - a) for a, b in result.uploads], (y + 0.2, 0.14),
                       facecolors="#55A868", label="upload, from call until durable" if first else None)
        # a floor of visibility: a 10 ms stall on a 30 s axis is thinner than a pixel
        for s, d, kind in result.stalls:
            if kind == "checkpoint":
                ax.plot([s, s], [y - 0.4, y + 0.2], color="#DD5555", linewidth=1.2)
    ax.set_yticks(range(len(lead)), [r.mode for r in lead])
    ax.invert_yaxis()
    ax.set_xlabel("seconds on the mode's own clock (rank 0; modes ran interleaved, each round one checkpoint)")
    ax.set_title("Training timeline per mode: red/orange is the loop standing still, green the upload")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=3, frameon=False, fontsize=8)
    fig.tight_layout()
    paths.append(f"{path_prefix}-timeline.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.6))
    modes = [r["mode"] for r in rows]
    a1.bar(modes, [r["stall_s"] for r in rows], color=["#999999", "#999999", "#DD8452", "#55A868"][:len(rows)])
    a1.set_yscale("log")
    a1.set_ylim(*log_axis_limits([r["stall_s"] for r in rows]))
    a1.set_ylabel("median stall per checkpoint (s, log)")
    for i, r in enumerate(rows):
        a1.annotate(f"{r['stall_s']:.2g}s", (i, r["stall_s"]), ha="center", va="bottom", fontsize=8)
    a2.bar(modes, [r["upload_gbps"] or 0 for r in rows], color="#4C72B0")
    a2.set_ylabel("checkpoint throughput (GB/s)")
    for ax in (a1, a2):
        ax.tick_params(axis="x", labelrotation=15)
    fig.tight_layout()
    paths.append(f"{path_prefix}-bars.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--state-mib", type=int, default=128,
                        help="checkpoint size per run: weights + AdamW state, all ranks together (default 128)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="checkpoints per mode; modes take turns, one checkpoint each per round (default 3)")
    parser.add_argument("--every", type=int, default=8, help="training steps after each checkpoint (default 8)")
    parser.add_argument("--batch", type=int, default=64, help="batch size (default 64)")
    parser.add_argument("--nproc", type=int, default=1, help="ranks, spawned with gloo on 127.0.0.1 (default 1)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    parser.add_argument("--timeout-s", type=float, default=1800, help="give up on a rank after this long")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_common_args(parser, repeats=1)
    args = parser.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(args.modes) - set(MODES)
    if unknown:
        parser.error(f"unknown mode(s) {sorted(unknown)}; choose from {MODES}")
    if args.rounds < 1 or args.every < 1:
        parser.error("--rounds and --every must be at least 1")
    per_layer = (WIDTH * WIDTH + WIDTH) * 4 * 3  # fp32 weight + bias, AdamW exp_avg and exp_avg_sq
    layers = max(1, round(args.state_mib * MiB / args.nproc / per_layer))

    started = time.perf_counter()
    with s3_target(args) as target:
        args.prefix = unique_prefix(target, "train_loop")
        print(f"# {args.nproc} rank(s) x {layers} layers of {WIDTH}x{WIDTH}; ~{layers * per_layer * args.nproc / MiB:.0f} MiB"
              f" per checkpoint; {len(args.modes)} modes take turns for {args.rounds} rounds of one checkpoint + "
              f"{args.every} steps", flush=True)
        per_rank = run_ranks(args, target.config, target.bucket, layers)
        rows = summarize(per_rank)
        shown = [dict(r, vs_monolithic=two_digits(r["vs_monolithic"]), vs_s3_sync=two_digits(r["vs_s3_sync"]))
                 for r in rows]
        print()
        print_table(shown, [
            ("mode", "mode"), ("checkpoints", "ckpts"), ("stall_s", "stall s", ".3f"),
            ("stall_first_s", "first s", ".3f"), ("stalled_pct", "stalled %", ".1f"),
            ("step_s", "step s", ".3f"), ("step_upload_s", "step s (upload)", ".3f"),
            ("checkpoint_mib", "MiB", ".0f"), ("upload_s", "durable s", ".2f"),
            ("upload_gbps", "GB/s", ".3f"), ("vs_monolithic", "x less stall vs monolithic", "g"),
            ("vs_s3_sync", "x vs s3-sync", "g"),
        ], title=f"Training with checkpoints ({args.nproc} rank(s), target {target.endpoint_url})")
        print()
        print(HOW_TO_READ)
        path = results_path(args, "train_loop")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        pictures = plot(per_rank, rows, os.path.splitext(path)[0])
        write_json(path, {
            "benchmark": "train_loop", "environment": environment_info(), "target": target.describe(),
            "settings": {k: v for k, v in vars(args).items() if k not in ("endpoint",)},
            "staging": {"s3-async": "background"},  # S3Config.staging of the mode (figures.py tells runs apart by it)
            "layers_per_rank": layers, "rows": rows, "total_wall_s": time.perf_counter() - started,
            "per_rank": [[{"mode": r.mode, "steps": r.steps, "stalls": r.stalls, "uploads": r.uploads,
                           "wall_s": r.wall_s, "checkpoint_bytes": r.checkpoint_bytes} for r in ranks]
                         for ranks in per_rank],
        })
        print(f"\nresults: {path}" + "".join(f"\nplot: {p}" for p in pictures))
    print(f"# total {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
