"""Why an async checkpoint takes longer to become durable while the loop trains, measured.

    python benchmarks/async_durable.py                      # 256 MiB state, embedded server, ~1-2 min
    python benchmarks/async_durable.py --state-mib 512 --repeats 5

In ``train_loop.py`` an async save became durable in 1.90 s where a sync save took 1.15 s. The
candidates: the training steps take CPU from the upload (the client's CRT threads, s3dcp's own
threads and, with the embedded server, the server too all share the machine's cores); the GIL
(s3dcp's Python work waits for the training thread); back-pressure inside s3dcp. This runs one
save in each of these situations, interleaved, and counts where the CPU went in the save's
window (from the call until durable), thread by thread:

    sync                  dcp.save; nothing else runs
    async, idle           dcp.async_save; the caller waits (sleeping) until durable
    async, Python loop    the caller spins in pure Python (holding the GIL between switches)
    async, training       the caller trains until durable (as in train_loop.py)
    async, training 1 thr the same with torch.set_num_threads(1)
    training alone        the same number of steps with no save: what the steps cost alone

Columns: ``durable s`` (call to committed), ``upload CPU s`` (the CRT's threads plus s3dcp's and
DCP's Python threads: the client's work of the upload), ``server CPU s`` (embedded SeaweedFS),
``caller CPU s`` (the caller's thread and torch's intra-op threads: training), and ``busy`` (all
of it over the window: at 2.0 a 2-core machine had no idle core). If the upload's CPU stays what
the sync save spent and ``busy`` is at the core count, the extra time is the cores being shared;
if ``async, Python loop`` is slower than ``async, idle`` by more than its CPU share, the upload
waits for the GIL.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import threading
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from common import (  # noqa: E402
    MiB, add_common_args, environment_info, median, print_table, results_path, s3_target, write_json,
)
from train_loop import WIDTH, build, state_of, train_step  # noqa: E402

warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process: what it means

SCENARIOS = ("sync", "async, idle", "async, Python loop", "async, training", "async, training 1 thr",
             "training alone")
_TICK = os.sysconf("SC_CLK_TCK")


def thread_cpu() -> dict:
    """CPU seconds so far of this process: ``{tid: (group, seconds)}`` for its live threads, and
    ``"total"``: the whole process, threads that already exited included.

    Groups: ``caller`` (the main thread), ``crt`` (the CRT's event-loop and resolver threads,
    named ``Aws…``), ``python`` (other Python threads: DCP's async executor, s3dcp's copies and
    its socket transfers, s3dcp.s3.sender) and
    ``native`` (threads Python does not know: torch's intra-op pool)."""
    python = {t.native_id for t in threading.enumerate()}
    main = threading.main_thread().native_id
    out: dict = {}
    for name in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{name}/stat") as f:
                stat = f.read()
        except FileNotFoundError:  # exited meanwhile: counted in the total only
            continue
        comm, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        tid = int(name)
        group = ("caller" if tid == main else "crt" if comm.startswith("Aws")
                 else "python" if tid in python else "native")
        out[tid] = (group, (int(fields[11]) + int(fields[12])) / _TICK)  # utime + stime
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    out["total"] = (int(fields[11]) + int(fields[12])) / _TICK
    return out


def cpu_by_group(before: dict, after: dict) -> collections.Counter:
    """What each group spent between two :func:`thread_cpu` readings; ``exited``: threads that
    ended in between (the process's total less what the live threads account for)."""
    out: collections.Counter = collections.Counter()
    for tid, entry in after.items():
        if tid != "total":
            group, seconds = entry
            out[group] += seconds - (before[tid][1] if tid in before else 0.0)
    out["exited"] = max(0.0, after["total"] - before["total"] - sum(out.values()))
    return out


def server_cpu(pid: int | None) -> float:
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


class Bench:
    def __init__(self, args, target) -> None:
        from s3dcp import S3StorageWriter

        self.args, self.target = args, target
        layers = max(1, round(args.state_mib * MiB / (3 * 4 * (WIDTH * WIDTH + WIDTH))))  # weights + 2 AdamW moments
        self.model, self.optimizer = build(layers, seed=0)
        gen = torch.Generator().manual_seed(1)
        self.batch = torch.randn(args.batch, WIDTH, generator=gen)
        self.target_t = torch.randn(args.batch, WIDTH, generator=gen)
        self.threads = torch.get_num_threads()
        train_step(self.model, self.optimizer, self.batch, self.target_t)
        self.nbytes = sum(t.numel() * t.element_size() for t in _tensors(self.state()))
        S3StorageWriter(config=target.config).warm_up(self.state())
        self.count = 0
        self.steps_during_save: list[int] = []

    def state(self) -> dict:
        return state_of(self.model, self.optimizer, 0)

    def _writer(self):
        from s3dcp import S3StorageWriter

        self.count += 1
        return S3StorageWriter(self.target.uri(self.target.prefix("async-durable", f"c{self.count}")),
                               config=self.target.config)

    def run(self, scenario: str) -> dict:
        cpu0, srv0, t0 = thread_cpu(), server_cpu(self.target.server_pid), time.perf_counter()
        steps, returned = 0, None
        if scenario == "sync":
            dcp.save(self.state(), storage_writer=self._writer())
            durable = returned = time.perf_counter()
        elif scenario == "training alone":
            steps = median(self.steps_during_save) or 1
            for _ in range(int(steps)):
                train_step(self.model, self.optimizer, self.batch, self.target_t)
            durable = time.perf_counter()
        else:
            done = threading.Event()
            at: list[float] = []
            future = dcp.async_save(self.state(), storage_writer=self._writer())
            returned = time.perf_counter()
            future.add_done_callback(lambda _f: (at.append(time.perf_counter()), done.set()))
            if scenario.startswith("async, training"):
                torch.set_num_threads(1 if scenario.endswith("1 thr") else self.threads)
                while not done.is_set():
                    train_step(self.model, self.optimizer, self.batch, self.target_t)
                    steps += 1
                torch.set_num_threads(self.threads)
                self.steps_during_save.append(steps)
            elif scenario == "async, Python loop":
                x = 0
                while not done.is_set():
                    for i in range(10_000):
                        x += i
            done.wait()
            future.result()
            durable = at[0]
        window = durable - t0
        cpu1, srv1 = thread_cpu(), server_cpu(self.target.server_pid)
        d = cpu_by_group(cpu0, cpu1)
        total, exited = cpu1["total"] - cpu0["total"], d["exited"]
        return {
            "scenario": scenario, "durable_s": window, "stall_s": None if returned is None else returned - t0,
            "steps": steps,
            "upload_cpu_s": d["crt"] + d["python"] + exited,
            "crt_cpu_s": d["crt"], "python_cpu_s": d["python"] + exited,
            "caller_cpu_s": d["caller"] + d["native"],
            "server_cpu_s": srv1 - srv0,
            "busy": (total + srv1 - srv0) / window if window > 0 else None,
        }


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--state-mib", type=int, default=256, help="model + AdamW state size (default 256)")
    parser.add_argument("--batch", type=int, default=256, help="training batch size (default 256)")
    add_common_args(parser, repeats=3)
    args = parser.parse_args(argv)

    with s3_target(args) as target:
        bench = Bench(args, target)
        print(f"# state {bench.nbytes / MiB:.0f} MiB; torch threads {bench.threads}; cores {os.cpu_count()}; "
              f"load average {os.getloadavg()[0]:.1f}", flush=True)
        runs: dict[str, list[dict]] = {s: [] for s in SCENARIOS}
        order = list(SCENARIOS[:-1])
        for r in range(args.repeats):
            shift = r % len(order)
            for scenario in order[shift:] + order[:shift] + ["training alone"]:  # alone: after a training run
                runs[scenario].append(bench.run(scenario))
    rows = []
    sync = median(x["durable_s"] for x in runs["sync"])
    for scenario, results in runs.items():
        row = {"scenario": scenario}
        for key in results[0]:
            if key != "scenario":
                row[key] = median(x[key] for x in results)
        row["x_sync"] = row["durable_s"] / sync if scenario != "training alone" else None
        rows.append(row)
    print_table(rows, [("scenario", "scenario"), ("durable_s", "durable s", ".2f"), ("x_sync", "x sync", ".2f"),
                       ("upload_cpu_s", "upload CPU s", ".2f"), ("crt_cpu_s", "of it CRT", ".2f"),
                       ("server_cpu_s", "server CPU s", ".2f"), ("caller_cpu_s", "caller CPU s", ".2f"),
                       ("busy", "busy", ".2f"), ("steps", "steps", ".0f")],
                title=f"medians of {args.repeats}; window = call until durable ('training alone': the steps)")
    by = {row["scenario"]: row for row in rows}
    idle, train, alone = by["async, idle"], by["async, training"], by["training alone"]
    print(f"\nasync while training vs sync: +{train['durable_s'] - sync:.2f} s. The upload's own CPU: "
          f"{train['upload_cpu_s']:.2f} s while training, {idle['upload_cpu_s']:.2f} s idle, "
          f"{by['sync']['upload_cpu_s']:.2f} s sync; the server's: {train['server_cpu_s']:.2f} / "
          f"{idle['server_cpu_s']:.2f} / {by['sync']['server_cpu_s']:.2f} s.")
    print(f"The training steps in that window took {train['caller_cpu_s']:.2f} CPU s "
          f"({alone['caller_cpu_s']:.2f} s and {alone['durable_s']:.2f} s wall for the same steps alone); "
          f"the machine was {train['busy']:.2f} of {os.cpu_count()} cores busy.")
    print(f"GIL: a pure-Python caller made the save {by['async, Python loop']['durable_s'] / idle['durable_s']:.2f}x "
          f"the idle caller's time.")
    path = write_json(results_path(args, "async_durable"),
                      {"environment": environment_info(), "target": target.describe(), "args": vars(args),
                       "rows": rows, "runs": runs})
    print(f"# results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
