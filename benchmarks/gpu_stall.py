"""The CUDA staging path: stall of async staging against the pinned device-to-host copy floor.

    python benchmarks/gpu_stall.py                  # 4 GiB of GPU tensors, 5 checkpoints, both modes
    python benchmarks/gpu_stall.py --state-gib 8 --checkpoints 10 --mode background

Needs no S3 server, awscrt or boto3 (it is meant to run in one short call on a GPU machine):
it drives s3dcp's stager directly and then "uploads" by writing the staged bytes to a local
file, as the S3 upload would read them. Two modes (``S3Config.staging``):

    blocking    stage() copies into the pinned pool with non_blocking copies on a side stream,
                synchronize_staging() waits for the event; the stall is both
    background  stage() returns at once (its small copies queued); a staging thread copies the
                rest on the side stream while the "training stream" runs --work-ms of matmuls
                that leave the state alone (the forward and backward stand-in); the loop then
                waits for the staging Future before it changes the state (the optimizer step).
                The stall is stage() plus that wait; the work's slowdown beside the copy is shown

It checks that the staged copy holds the values of the moment the save was called, although the
training stream changes the tensors right after staging completes, that no background stage
found a change (the lease's error), and that the pool is allocated once.

Exits 0 with a message where CUDA is absent.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--state-gib", type=float, default=4.0, help="GPU state size (default 4)")
    parser.add_argument("--checkpoints", type=int, default=5, help="checkpoints in a row (default 5)")
    parser.add_argument("--mode", choices=["blocking", "background", "both"], default="both",
                        help="S3Config.staging to measure (default both)")
    parser.add_argument("--work-ms", type=float, default=200.0,
                        help="background: the forward/backward stand-in run beside the copy (default 200 ms)")
    parser.add_argument("--json", metavar="PATH", help="write results as JSON")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_stall: CUDA is not available here; nothing to measure (skipped)")
        return 0

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from s3dcp.config import S3Config
    from s3dcp.saving.staging import HostBufferPool, StagingMixin
    from s3dcp.format.tensors import byte_view

    class Stager(StagingMixin):  # the staging half of S3StorageWriter, without the S3 half
        def __init__(self, pool, mode):
            self.config = S3Config(staging=mode)
            self._init_staging(pool, mode)

    dev = torch.device("cuda")
    per = 64 * 1024 * 1024 // 4  # 64 MiB fp32 tensors (and some bf16 ones)
    n = max(1, int(args.state_gib * 1024 / 64))
    gen = torch.Generator(device=dev).manual_seed(0)
    state = {f"w{i}": torch.randn(per, device=dev, generator=gen) for i in range(n)}
    state["bf16"] = torch.randn(per, device=dev, generator=gen).to(torch.bfloat16)
    state["step"] = 0
    nbytes = sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor))

    # Floor: device-to-host into pinned memory allocated once, non_blocking, one sync.
    pinned = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in state.items()
              if isinstance(v, torch.Tensor)}
    floors = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for k, dst in pinned.items():
            dst.copy_(state[k], non_blocking=True)
        torch.cuda.synchronize()
        floors.append(time.perf_counter() - t0)
    floor = min(floors)
    del pinned

    # The forward and backward stand-in: matmuls on tensors of their own, on the current stream.
    side_a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    side_b = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)

    def work() -> float:
        """Run ~--work-ms of matmuls that leave the state alone; their seconds, synchronised."""
        t0 = time.perf_counter()
        for _ in range(reps):
            side_a @ side_b  # noqa: B018 - the work is the point
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    reps = 1
    alone = work()
    reps = max(1, int(args.work_ms / 1e3 / max(alone, 1e-4)))
    alone = min(work() for _ in range(3))

    pool = HostBufferPool()
    assert pool.pin_memory, "the pool must pin memory where CUDA is available"
    rows = []
    modes = ["blocking", "background"] if args.mode == "both" else [args.mode]
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes:
            stager = Stager(pool, mode)
            for k in range(args.checkpoints):
                expected = {key: v.clone() for key, v in state.items() if isinstance(v, torch.Tensor)}
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                staged = stager.stage(state)
                work_s = None
                if mode == "blocking":
                    stager.synchronize_staging()
                    stall = time.perf_counter() - t0
                else:
                    returned = time.perf_counter() - t0
                    work_s = work()  # the forward and backward passes, beside the copy
                    t1 = time.perf_counter()
                    staged = staged.result()  # before the optimizer step
                    stall = returned + time.perf_counter() - t1
                staging = stager._lease
                for v in state.values():  # the optimizer step
                    if isinstance(v, torch.Tensor):
                        v.add_(1)
                t1 = time.perf_counter()
                with open(os.path.join(tmp, "upload.bin"), "wb") as f:  # the stand-in for the S3 upload
                    for key, v in staged.items():
                        if isinstance(v, torch.Tensor):
                            f.write(byte_view(v))
                write_s = time.perf_counter() - t1
                ok = staging.error is None and all(torch.equal(staged[key], expected[key].cpu()) for key in expected)
                assert all(staged[key].is_pinned() for key in expected), "staged tensors must live in pinned memory"
                staging.release()
                rows.append({"mode": mode, "checkpoint": k + 1, "stall_s": stall, "vs_floor": stall / floor,
                             "gbps": nbytes / stall / 1e9, "local_write_s": write_s, "correct": ok,
                             "work_vs_alone": work_s / alone if work_s is not None else None,
                             "pool_allocations": pool.allocations})
                del expected, staged

    print(f"GPU: {torch.cuda.get_device_name()}; state {nbytes / 2**30:.2f} GiB; pinned D2H floor "
          f"{floor:.3f} s ({nbytes / floor / 1e9:.1f} GB/s)")
    cached_pinned = torch.cuda.host_memory_stats().get("reserved_bytes.all.current", 0)
    print(f"pinned by the pool: {pool.bytes_allocated / 2**30:.2f} GiB for {nbytes / 2**30:.2f} GiB of state "
          f"({pool.bytes_allocated / nbytes:.3f}x); torch's caching pinned allocator holds "
          f"{cached_pinned / 2**30:.2f} GiB (the floor's buffers)")
    print(f"{'mode':>10}  {'#':>2}  {'stall s':>8}  {'x floor':>7}  {'GB/s':>6}  {'work x':>6}  {'correct':>7}  "
          f"{'allocs':>6}")
    for r in rows:
        work = f"{r['work_vs_alone']:.2f}" if r["work_vs_alone"] is not None else "-"
        print(f"{r['mode']:>10}  {r['checkpoint']:>2}  {r['stall_s']:>8.4f}  {r['vs_floor']:>7.2f}  {r['gbps']:>6.1f}  "
              f"{work:>6}  {str(r['correct']):>7}  {r['pool_allocations']:>6}")

    def warm(mode):  # the median stall of a mode's checkpoints after its first
        mine = sorted(r["stall_s"] for r in rows if r["mode"] == mode and r["checkpoint"] > 1)
        return mine[len(mine) // 2] if mine else None

    summary = {"state_bytes": nbytes, "pinned_bytes": pool.bytes_allocated, "floor_s": floor,
               "first_stall_s": rows[0]["stall_s"], "work_alone_s": alone,
               **{f"warm_stall_{m}_s": warm(m) for m in modes},
               "all_correct": all(r["correct"] for r in rows), "pool_allocations": pool.allocations}
    print(json.dumps(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "rows": rows, "device": torch.cuda.get_device_name()}, f, indent=2)
    return 0 if summary["all_correct"] and pool.allocations == 1 else 1


if __name__ == "__main__":
    raise SystemExit(main())
