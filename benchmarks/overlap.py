"""A checkpoint's visible stall in a training loop, for each way of staging, and what it costs the steps.

    python benchmarks/overlap.py                     # 512 MiB in few large tensors, then in ~1,000 small ones
    python benchmarks/overlap.py --shape large --state-mib 1024 --every 20 --rounds 4

A model trains on the CPU (forward, backward, AdamW step; weights + AdamW state = --state-mib)
and checkpoints every --every steps, in each mode, in rounds: a round gives every mode one
segment (a checkpoint, then --every steps), in a rotated order, so a busy spell of the machine
hits every mode alike; one model and optimizer train on through all of them. A first round
warms every mode up (arenas, caches, clients) and is not counted.

    none           no checkpoint: the step time without
    blocking       s3dcp, S3Config(staging="blocking"): async_save returns once the state is copied
    background     s3dcp, S3Config(staging="background"): async_save returns once the copy is
                   planned; the loop waits for staging_completion before its next optimizer step;
                   each object is sent as soon as its slab is in
    whole-stage    background staging whose objects are sent only once the whole stage is in (what
                   a planner other than DCP's own gets: write_data waits for every copy first)
    defaultstager  DCP's DefaultStager(use_async_staging=True, use_shared_memory=True) staging for
                   s3dcp's writer; the loop waits for staging_completion before its next optimizer step
    s3tc           s3torchconnector's S3StorageWriter through dcp.async_save as it documents it
                   (DCP's own stager, synchronous); skipped when it is not installed

Visible stall per checkpoint = the time the loop is blocked by its staging: inside async_save,
and waiting for staging before the optimizer step. An upload still running when the segment's
steps are done is waited for and reported apart ("upload wait": what the next checkpoint would
wait for, back-pressure, when --every steps are shorter than an upload on this machine). Step
time = the segment's steps (its stall included) / their number, against the "none" segments of
the same rounds. Durable after = from the async_save call until the upload is complete (the
checkpoint committed); 1st object sent after = from that call until s3dcp starts its first
object's upload (objects sent from files: not s3torchconnector's). Sending each object as its
slab comes in shows where a rank's state spans several objects (--object-mib). Goal (issue 40), for background: stall
<= 10 ms for 512 MiB and <= 25 ms for the small shape, step time with a checkpoint <= 1.1x
without. Exits 0 either way (a busy machine misses the goal without anything being wrong).

--split-cores runs the local S3 server on the last core and this process (the training loop,
torch's threads, the CRT's) on the others, as on a cluster whose S3 is elsewhere: the step
time ratio then measures what checkpointing costs the training process itself, not the
server's work on the same cores (6-9 CPU seconds per 512 MiB checkpoint for SeaweedFS here).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import psutil  # noqa: E402
import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner  # noqa: E402

from common import (  # noqa: E402
    MiB, add_common_args, delete_prefix, environment_info, median, print_table, results_path, s3_target,
    unique_prefix, write_json,
)
from compare import s3tc_available, s3tc_note, s3tc_writer  # noqa: E402

MODES = ("none", "blocking", "background", "whole-stage", "defaultstager", "s3tc")
GOALS_S = {"large": 0.010, "small": 0.025}  # the visible stall of background staging


def make_model(total_mib: int, shape: str) -> torch.nn.Module:
    """Weights of ``total_mib / 3`` (AdamW keeps two moments of each): ``large``, a stack of
    2048-wide linear layers (16 MiB weights); ``small``, 250 heads of sizes spread over three
    orders of magnitude (as benchmarks/stall.py's small shape) — with AdamW's moments and step
    counters about 1,000 tensors."""
    torch.manual_seed(0)
    per = total_mib * MiB // 3 // 4  # fp32 parameters
    if shape == "large":
        width = 2048
        layers = max(1, round(per / (width * width)))
        return torch.nn.Sequential(*[m for _ in range(layers) for m in (torch.nn.Linear(width, width), torch.nn.ReLU())])
    weights = [4.0 ** ((i * 7) % 10 / 2) for i in range(250)]
    rows = [max(1, int(w * per / sum(weights)) // 256) for w in weights]
    return _Heads(rows)


class _Heads(torch.nn.Module):
    def __init__(self, rows: list[int]) -> None:
        super().__init__()
        self.heads = torch.nn.ModuleList(torch.nn.Linear(256, r, bias=False) for r in rows)

    def forward(self, x):
        return sum(h(x).square().mean() for h in self.heads)


def _input(model, batch: int) -> torch.Tensor:
    width = 256 if isinstance(model, _Heads) else model[0].in_features
    return torch.randn(batch, width)


class Loop:
    """One model and optimizer that every mode's segments train on; the timing of each step."""

    def __init__(self, model, batch: int) -> None:
        self.model = model
        self.optim = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        self.x = _input(model, batch)

    def state(self) -> dict:
        return {"model": self.model.state_dict(), "optim": self.optim.state_dict()}

    def step(self, before_optimizer=None) -> float:
        """One training step; ``before_optimizer()`` runs between backward and the optimizer step
        (where a loop waits for staging) and returns the seconds it blocked."""
        loss = self.model(self.x)
        loss = loss if loss.dim() == 0 else loss.square().mean()
        loss.backward()
        blocked = before_optimizer() if before_optimizer is not None else 0.0
        self.optim.step()
        self.optim.zero_grad(set_to_none=False)
        return blocked


def _when_staged(response) -> list[float]:
    """A list that gets the time (perf_counter) staging completes (at once for a Future: DCP
    returns it once staged)."""
    stamp: list[float] = []
    staged = getattr(response, "staging_completion", None)
    if staged is None:
        stamp.append(time.perf_counter())
    else:
        staged.add_done_callback(lambda _f: stamp.append(time.perf_counter()))
    return stamp


_SENT: list[float] = []  # when each s3dcp object upload started (perf_counter), this segment


@contextlib.contextmanager
def _sends_recorded():
    """Note when s3dcp starts each object's upload (every object sent from a file: the
    staging slabs, DefaultStager's shared memory), for the "1st object sent" column."""
    from s3dcp.s3.client import S3Client

    put_file = S3Client.put_file

    def recorded(self, *args, **kwargs):
        _SENT.append(time.perf_counter())
        return put_file(self, *args, **kwargs)

    S3Client.put_file = recorded
    try:
        yield
    finally:
        S3Client.put_file = put_file
        _SENT.clear()


class OwnPlanner(DefaultSavePlanner):
    """DCP's planner under another name: s3dcp's writer sends nothing before the stage is whole."""


def segment(loop: Loop, mode: str, target, every: int, stager, config) -> dict:
    """A checkpoint in ``mode`` followed by ``every`` steps; what the loop waited for, and how long
    the segment took. ``config``: s3dcp's, for the s3dcp modes."""
    from s3dcp import S3StorageWriter

    prefix = unique_prefix(target, "overlap", mode)
    uri = target.uri(prefix)
    server = psutil.Process(target.server_pid) if target.server_pid else None
    server_cpu = _cpu_s(server)
    start = time.perf_counter()
    call_s = staged_s = durable_s = 0.0
    first_sent_s = None
    response = None
    _SENT.clear()
    if mode != "none":
        state = loop.state()
        if mode in ("blocking", "background"):
            writer = S3StorageWriter(uri, config=config.replace(staging=mode))
            response = dcp.async_save(state, storage_writer=writer)
        elif mode == "whole-stage":
            writer = S3StorageWriter(uri, config=config.replace(staging="background"))
            response = dcp.async_save(state, storage_writer=writer, planner=OwnPlanner())
        elif mode == "defaultstager":
            response = dcp.async_save(state, storage_writer=S3StorageWriter(uri, config=config), async_stager=stager)
        else:
            response = dcp.async_save(state, storage_writer=s3tc_writer(uri, target.config))
        call_s = time.perf_counter() - start
        staged_at = _when_staged(response)
        durable_at: list[float] = []
        getattr(response, "upload_completion", response).add_done_callback(
            lambda _f: durable_at.append(time.perf_counter()))
    waited = [0.0]

    def wait_staged() -> float:
        staged = getattr(response, "staging_completion", None)
        if staged is None:
            return 0.0
        t = time.perf_counter()
        staged.result()
        return time.perf_counter() - t

    first_s = 0.0
    for i in range(every):
        t = time.perf_counter()
        waited[0] += loop.step(wait_staged if i == 0 and response is not None else None)
        if i == 0:
            first_s = time.perf_counter() - t  # the step the copy runs beside (its wait included)
    steps_end = time.perf_counter()
    tail_s = 0.0
    if response is not None:
        getattr(response, "upload_completion", response).result()
        tail_s = time.perf_counter() - steps_end
        staged_s = staged_at[0] - start
        durable_s = durable_at[0] - start
        first_sent_s = min(_SENT) - start if _SENT else None
    server_cpu = _cpu_s(server) - server_cpu  # the local S3 server's share of the cores, upload included
    if response is not None:
        delete_prefix(target.s3_client(), target.bucket, prefix)
    return {"mode": mode, "call_s": call_s, "wait_staged_s": waited[0], "upload_wait_s": tail_s,
            "stall_s": call_s + waited[0], "staged_after_s": staged_s, "first_sent_after_s": first_sent_s,
            "durable_after_s": durable_s,
            "step_s": (steps_end - start) / every,
            "first_step_s": first_s, "rest_step_s": (steps_end - start - call_s - first_s) / max(1, every - 1),
            "server_cpu_s": server_cpu}


def _cpu_s(proc) -> float:
    """CPU seconds of ``proc`` and its children so far (0 without one)."""
    if proc is None:
        return 0.0
    try:
        return sum(sum(p.cpu_times()[:2]) for p in [proc, *proc.children(recursive=True)])
    except psutil.Error:
        return 0.0


def run_shape(args, target, shape: str, modes: list[str]) -> dict:
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    model = make_model(args.state_mib, shape)
    loop = Loop(model, args.batch)
    state = loop.state()
    loop.step()  # AdamW's moments exist from the first step on
    tensors = sum(1 for _ in _leaves(loop.state()))
    nbytes = sum(t.nbytes for t in _leaves(loop.state()))
    del state
    stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=True, use_async_staging=True,
                                          use_non_blocking_copy=False))
    config = target.config.replace(object_size_target_bytes=args.object_mib * MiB) if args.object_mib else target.config
    rows: list[dict] = []
    with contextlib.closing(stager), _sends_recorded():
        for r in range(args.rounds + 1):  # round 0 warms every mode up
            order = modes[r % len(modes):] + modes[:r % len(modes)]
            for mode in order:
                row = segment(loop, mode, target, args.every, stager, config)
                if r:
                    rows.append(row)
                print(f"# {shape} round {r}{' (warm-up)' if not r else ''} {mode:13s} stall {row['stall_s'] * 1e3:8.1f} ms "
                      f"(call {row['call_s'] * 1e3:.1f}, staging wait {row['wait_staged_s'] * 1e3:.1f}, upload wait "
                      f"{row['upload_wait_s'] * 1e3:.1f}); step {row['step_s'] * 1e3:.0f} ms", flush=True)
    base = median(r["step_s"] for r in rows if r["mode"] == "none")
    first_base = median(r["first_step_s"] for r in rows if r["mode"] == "none")
    rest_base = median(r["rest_step_s"] for r in rows if r["mode"] == "none")
    summary = {}
    for mode in modes:
        mine = [r for r in rows if r["mode"] == mode]
        summary[mode] = {
            "stall_median_s": median(r["stall_s"] for r in mine), "stall_max_s": max(r["stall_s"] for r in mine),
            "call_median_s": median(r["call_s"] for r in mine),
            "wait_staged_median_s": median(r["wait_staged_s"] for r in mine),
            "upload_wait_median_s": median(r["upload_wait_s"] for r in mine),
            "staged_after_median_s": median(r["staged_after_s"] for r in mine),
            "durable_after_median_s": median(r["durable_after_s"] for r in mine),
            "first_sent_after_median_s": median(sent) if (sent := [r["first_sent_after_s"] for r in mine
                                                                  if r["first_sent_after_s"] is not None]) else None,
            "step_median_s": median(r["step_s"] for r in mine),
            "step_vs_none": median(r["step_s"] for r in mine) / base if base else None,
            "first_step_vs_none": median(r["first_step_s"] for r in mine) / first_base if first_base else None,
            "rest_step_vs_none": median(r["rest_step_s"] for r in mine) / rest_base if rest_base else None,
            "server_cpu_median_s": median(r["server_cpu_s"] for r in mine),
        }
    return {"shape": shape, "tensors": tensors, "bytes": nbytes, "rows": rows, "modes": summary}


def _leaves(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _leaves(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _leaves(v)


def split_cores(server_pid: int | None) -> tuple[list[int], int]:
    """Pin every thread of the server to the last core of this process's, and every thread of
    this process (later ones inherit it) to the others; torch's threads to as many."""
    cores = sorted(os.sched_getaffinity(0))
    if server_pid is None or len(cores) < 2:
        raise SystemExit("error: --split-cores needs the embedded server (no --endpoint) and two cores or more")
    mine, theirs = cores[:-1], cores[-1]
    for pid, where in ((server_pid, {theirs}), (os.getpid(), set(mine))):
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                os.sched_setaffinity(int(tid), where)
            except (ProcessLookupError, PermissionError):
                pass  # a thread that ended meanwhile
    torch.set_num_threads(len(mine))
    return mine, theirs


def verdict(results: dict) -> tuple[bool, list[str]]:
    lines, met = [], True
    for shape, res in results.items():
        bg = res["modes"].get("background")
        if bg is None:
            continue
        goal = GOALS_S[shape]
        ok = bg["stall_median_s"] <= goal and bg["step_vs_none"] <= 1.1
        met &= ok
        lines.append(f"verdict {shape}: {'PASS' if ok else 'FAIL'} — background stall {bg['stall_median_s'] * 1e3:.1f} ms "
                     f"(goal <= {goal * 1e3:.0f} ms), step with a checkpoint {bg['step_vs_none']:.2f}x without "
                     f"(goal <= 1.1x)")
    lines.append(f"verdict: goal {'met' if met else 'NOT met'}")
    return met, lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--state-mib", type=int, default=512, help="weights + AdamW state (default 512)")
    parser.add_argument("--shape", choices=["large", "small", "both"], default="both",
                        help="few large tensors, ~1,000 small ones, or both (default)")
    parser.add_argument("--every", type=int, default=20, help="steps per checkpoint (default 20)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds after the warm-up one (default 3)")
    parser.add_argument("--batch", type=int, default=64,
                        help="rows per step (default 64: forward and backward outlast the copy, as the goal assumes)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    parser.add_argument("--object-mib", type=int, default=None,
                        help="s3dcp's object size target (default: S3Config's, 512 MiB)")
    parser.add_argument("--split-cores", action="store_true",
                        help="the embedded S3 server on the last core, this process on the others")
    add_common_args(parser, repeats=1)
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if "s3tc" in modes and not s3tc_available():
        print(f"# {s3tc_note()}")
        modes.remove("s3tc")
    if "none" not in modes:
        modes.insert(0, "none")
    load_before = os.getloadavg()
    results = {}
    with s3_target(args) as target:
        if args.split_cores:
            cores = split_cores(target.server_pid)
            print(f"# S3 server (pid {target.server_pid}) on core {cores[1]}; this process on cores {cores[0]}, "
                  f"{torch.get_num_threads()} torch threads", flush=True)
        for shape in (["large", "small"] if args.shape == "both" else [args.shape]):
            results[shape] = run_shape(args, target, shape, modes)
    load_after = os.getloadavg()
    print()
    for shape, res in results.items():
        print_table([{"mode": m, **v} for m, v in res["modes"].items()],
                    [("mode", "mode"), ("stall_median_s", "stall s", ".4f"), ("stall_max_s", "max", ".4f"),
                     ("call_median_s", "in async_save", ".4f"), ("wait_staged_median_s", "staging wait", ".4f"),
                     ("upload_wait_median_s", "upload wait", ".4f"), ("staged_after_median_s", "staged after", ".3f"),
                     ("first_sent_after_median_s", "1st object sent after", ".3f"),
                     ("durable_after_median_s", "durable after", ".3f"),
                     ("step_median_s", "step s", ".3f"), ("step_vs_none", "x none", ".2f"),
                     ("first_step_vs_none", "1st step x", ".2f"), ("rest_step_vs_none", "later steps x", ".2f"),
                     ("server_cpu_median_s", "server CPU s", ".1f")],
                    title=f"{shape}: {res['bytes'] / MiB:.0f} MiB in {res['tensors']} tensors, a checkpoint every "
                          f"{args.every} steps, medians of {args.rounds} rounds")
    print(f"# load average (1, 5, 15 min): before {', '.join(f'{x:.2f}' for x in load_before)}; after "
          f"{', '.join(f'{x:.2f}' for x in load_after)}; {os.cpu_count()} cores")
    met, lines = verdict(results)
    for line in lines:
        print(line)
    path = write_json(results_path(args, "overlap"), {
        "benchmark": "overlap", "environment": environment_info(), "target": target.describe(),
        "args": vars(args), "load_before": load_before, "load_after": load_after, "results": results,
        "verdict": {"goal_met": met, "lines": lines}})
    print(f"# results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
