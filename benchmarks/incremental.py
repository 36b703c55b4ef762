"""Incremental against full checkpoints, side by side, over a run of checkpoints.

    python benchmarks/incremental.py                         # both scenarios, 256 MiB, 10 checkpoints
    python benchmarks/incremental.py --scenario lora --state-mib 1024

Scenarios:
  lora       frozen base weights (~95% of the bytes) + LoRA adapters and their AdamW moments,
             which change at every checkpoint
  embedding  an embedding table chunked into many items (row blocks), ~1% of its rows updated
             between checkpoints, clustered in a few hot blocks (so changed rows touch few
             items), plus a small dense part that changes every time

For every checkpoint, the same state is saved twice with ``dcp.async_save``: as a full
checkpoint (``run-full/step-k``) and as an incremental one on the previous checkpoint
(``run-incr/step-k``). Per checkpoint: bytes uploaded, save time (async_save call to commit),
stall (async_save's return). At the end: load time of the last checkpoint of each run
(interleaved repeats, median) and the bytes each run stores in the bucket. Ratios are measured
in the same run; absolute times depend on the machine and the server.

Goals (issue 12) for the lora scenario: each incremental checkpoint uploads <= 6% of the
state's bytes and saves in <= 15% of a full save's time (both judged on the worst of
checkpoints 2..N, the median is printed too), the last one loads in <= 1.1x a full
checkpoint's time, and the run stores <= 1.6x one full checkpoint (a run of full ones stores 10x).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from common import (  # noqa: E402
    MiB, add_common_args, delete_prefix, environment_info, median, print_table, results_path, s3_target,
    unique_prefix, write_json,
)

_TENSOR_ELEMS = 4 * 1024 * 1024  # 16 MiB fp32 tensors for the frozen weights


def lora_state(total_mib: int, gen: torch.Generator) -> dict:
    """~95% frozen base weights, ~5% adapters + AdamW moments (each adapter byte has 2 moment bytes)."""
    frozen_elems = int(total_mib * MiB * 0.95) // 4
    adapter_elems = (total_mib * MiB // 4 - frozen_elems) // 3
    model, adapters = {}, {}
    i = 0
    while frozen_elems > 0:
        n = min(frozen_elems, _TENSOR_ELEMS)
        model[f"base.layer{i}.weight"] = torch.randn(n // 1024, 1024, generator=gen) if n >= 1024 else \
            torch.randn(n, generator=gen)
        frozen_elems -= n
        i += 1
    layers = max(1, i)
    per = adapter_elems // (2 * layers)
    for j in range(layers):
        model[f"lora.layer{j}.A"] = torch.randn(per // 16, 16, generator=gen)
        model[f"lora.layer{j}.B"] = torch.randn(16, per // 16, generator=gen)
        adapters.update({f"lora.layer{j}.A": model[f"lora.layer{j}.A"], f"lora.layer{j}.B": model[f"lora.layer{j}.B"]})
    optim = {name: {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)} for name, p in adapters.items()}
    return {"model": model, "optim": {"state": optim, "step": 0}}


def lora_step(state: dict, gen: torch.Generator) -> None:
    """One 'training step': adapters and their moments change, the base does not."""
    for name, moments in state["optim"]["state"].items():
        p = state["model"][name]
        g = torch.randn(p.shape, generator=gen)
        moments["exp_avg"].mul_(0.9).add_(g, alpha=0.1)
        moments["exp_avg_sq"].mul_(0.999).add_(g * g, alpha=0.001)
        p.add_(moments["exp_avg"], alpha=-1e-3)
    state["optim"]["step"] += 1


def embedding_state(total_mib: int, gen: torch.Generator, blocks: int) -> dict:
    dim = 64
    rows = int(total_mib * MiB * 0.99) // (4 * dim)
    rows -= rows % blocks
    per_block = rows // blocks
    table = {f"emb.block{b:04d}": torch.randn(per_block, dim, generator=gen) for b in range(blocks)}
    dense_elems = total_mib * MiB // 4 - rows * dim
    return {"model": {**table, "dense.weight": torch.randn(max(1, dense_elems), generator=gen)}, "step": 0}


def embedding_step(state: dict, gen: torch.Generator, changed_fraction: float = 0.01, hot_blocks: int = 4) -> None:
    """~1% of all rows change, in a few hot blocks; the dense part changes whole."""
    model = state["model"]
    blocks = [k for k in model if k.startswith("emb.")]
    rows_total = sum(model[k].shape[0] for k in blocks)
    hot = torch.randperm(len(blocks), generator=gen)[:hot_blocks].tolist()
    per_hot = max(1, int(rows_total * changed_fraction) // hot_blocks)
    for b in hot:
        t = model[blocks[b]]
        idx = torch.randperm(t.shape[0], generator=gen)[:min(per_hot, t.shape[0])]
        t[idx] += 0.01 * torch.randn(len(idx), t.shape[1], generator=gen)
    model["dense.weight"].add_(torch.randn(model["dense.weight"].shape, generator=gen), alpha=1e-3)
    state["step"] += 1


def nbytes(tree) -> int:
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(nbytes(v) for v in tree.values())
    return 0


def blank(tree):
    if isinstance(tree, torch.Tensor):
        return torch.empty_like(tree)
    if isinstance(tree, dict):
        return {k: blank(v) for k, v in tree.items()}
    return tree


def stored_bytes(client, bucket: str, prefix: str) -> int:
    objects, _ = client.list(bucket, prefix.rstrip("/") + "/").result()
    return sum(o.size for o in objects)


def run_scenario(name: str, args, target, pool) -> dict:
    from s3dcp import S3StorageReader, S3StorageWriter

    gen = torch.Generator().manual_seed(0)
    if name == "lora":
        state, step = lora_state(args.state_mib, gen), lora_step
    else:
        state, step = embedding_state(args.state_mib, gen, args.blocks), embedding_step
    total = nbytes(state)
    run = unique_prefix(target, "incremental", name)
    runs = {"full": f"{run}/run-full", "incr": f"{run}/run-incr"}
    client = target.s3_client()
    rows = []
    print(f"# {name}: state {total / MiB:.0f} MiB, {args.checkpoints} checkpoints", flush=True)
    for k in range(1, args.checkpoints + 1):
        step(state, gen)
        row = {"checkpoint": k}
        for mode in ("full", "incr"):
            base = target.uri(f"{runs['incr']}/step-{k - 1}") if mode == "incr" and k > 1 else None
            writer = S3StorageWriter(target.uri(f"{runs[mode]}/step-{k}"), config=target.config, client=client,
                                     pool=pool, incremental_from=base,
                                     item_checksum="crc64nvme" if mode == "incr" else None)
            t0 = time.perf_counter()
            response = dcp.async_save(state, storage_writer=writer)
            stall = time.perf_counter() - t0
            getattr(response, "upload_completion", response).result()
            row[f"{mode}_save_s"] = time.perf_counter() - t0
            row[f"{mode}_stall_s"] = stall
            row[f"{mode}_uploaded"] = writer.last_stats.bytes
            row[f"{mode}_mib"] = writer.last_stats.bytes / MiB
        row["incr_uploaded_pct"] = 100 * row["incr_uploaded"] / total
        row["save_ratio"] = row["incr_save_s"] / row["full_save_s"]
        rows.append(row)

    loads = {"full": [], "incr": []}
    last = args.checkpoints
    for _ in range(args.repeats):
        for mode in ("full", "incr"):
            dest = blank(state)
            reader = S3StorageReader(target.uri(f"{runs[mode]}/step-{last}"), config=target.config, client=client)
            t0 = time.perf_counter()
            dcp.load(dest, storage_reader=reader)
            loads[mode].append(time.perf_counter() - t0)
    assert all(torch.equal(a, b) for a, b in zip(_tensors(dest), _tensors(state))), "loaded state differs"
    stored = {mode: stored_bytes(client, target.bucket, prefix) for mode, prefix in runs.items()}
    later = rows[1:] or rows
    summary = {
        "state_bytes": total,
        "incr_uploaded_pct_max": max(r["incr_uploaded_pct"] for r in later),
        "incr_uploaded_pct_median": median(r["incr_uploaded_pct"] for r in later),
        "save_ratio_median": median(r["save_ratio"] for r in later),
        "save_ratio_max": max(r["save_ratio"] for r in later),
        "full_save_s_median": median(r["full_save_s"] for r in later),
        "incr_save_s_median": median(r["incr_save_s"] for r in later),
        "full_stall_s_median": median(r["full_stall_s"] for r in later),
        "incr_stall_s_median": median(r["incr_stall_s"] for r in later),
        "load_full_s": median(loads["full"]), "load_incr_s": median(loads["incr"]),
        "load_ratio": median(loads["incr"]) / median(loads["full"]),
        "load_ratio_best": min(loads["incr"]) / min(loads["full"]),  # fastest of each: less noise from a busy box
        "stored_full_bytes": stored["full"], "stored_incr_bytes": stored["incr"],
        "stored_full_x_one": stored["full"] / total, "stored_incr_x_one": stored["incr"] / total,
    }
    print_table(rows, [("checkpoint", "#"), ("full_mib", "full MiB", ".1f"),
                       ("incr_mib", "incr MiB", ".1f"), ("incr_uploaded_pct", "incr %", ".2f"),
                       ("full_save_s", "full save s", ".3f"), ("incr_save_s", "incr save s", ".3f"),
                       ("save_ratio", "incr/full", ".2f"), ("full_stall_s", "full stall s", ".3f"),
                       ("incr_stall_s", "incr stall s", ".3f")],
                title=f"{name}: per checkpoint (same state saved full and incremental)")
    s = summary
    print(f"{name}: checkpoints 2..{last}: incremental uploads {s['incr_uploaded_pct_median']:.2f}% of the state "
          f"(max {s['incr_uploaded_pct_max']:.2f}%), saves in {s['save_ratio_median']:.2f}x a full save's time "
          f"(max {s['save_ratio_max']:.2f}x), stall {s['incr_stall_s_median']:.3f} s vs "
          f"{s['full_stall_s_median']:.3f} s")
    print(f"{name}: load of checkpoint {last}: incremental {s['load_incr_s']:.3f} s, full {s['load_full_s']:.3f} s "
          f"({s['load_ratio']:.2f}x; fastest of each {s['load_ratio_best']:.2f}x); "
          f"stored by the run: incremental {s['stored_incr_x_one']:.2f}x one full "
          f"checkpoint, full {s['stored_full_x_one']:.2f}x\n", flush=True)
    if not args.keep:
        delete_prefix(client, target.bucket, run)
    return {"summary": summary, "rows": rows, "loads_s": loads}


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)


def crc_throughput() -> dict:
    """GB/s of the two item checksums over 64 MiB (the one extra pass an incremental save makes
    is this, replacing the crc32c pass of a full save)."""
    from awscrt import checksums

    buf = memoryview(torch.randn(16 * MiB).numpy()).cast("B")
    out = {}
    for name, fn in (("crc32c", checksums.crc32c), ("crc64nvme", checksums.crc64nvme)):
        fn(buf)
        t0 = time.perf_counter()
        for _ in range(3):
            fn(buf)
        out[f"{name}_gbps"] = 3 * buf.nbytes / (time.perf_counter() - t0) / 1e9
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", choices=("lora", "embedding", "both"), default="both")
    parser.add_argument("--state-mib", type=int, default=256, help="state size per scenario (default 256)")
    parser.add_argument("--checkpoints", type=int, default=10, help="checkpoints per run (default 10)")
    parser.add_argument("--blocks", type=int, default=256, help="embedding: row blocks (items) (default 256)")
    parser.add_argument("--keep", action="store_true", help="leave the checkpoints in the bucket")
    add_common_args(parser, repeats=3)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")

    from s3dcp import HostBufferPool

    crc = crc_throughput()
    print(f"# item checksum throughput: crc32c {crc['crc32c_gbps']:.1f} GB/s, "
          f"crc64nvme {crc['crc64nvme_gbps']:.1f} GB/s")
    results = {}
    with s3_target(args) as target:
        pool = HostBufferPool()
        for name in (("lora", "embedding") if args.scenario == "both" else (args.scenario,)):
            results[name] = run_scenario(name, args, target, pool)
    if "lora" in results:
        s = results["lora"]["summary"]
        # "each incremental checkpoint": judged on the worst one of checkpoints 2..N
        goals = {"uploads <= 6% of the state (worst checkpoint)": s["incr_uploaded_pct_max"] <= 6.0,
                 "save <= 15% of a full save (worst checkpoint)": s["save_ratio_max"] <= 0.15,
                 "load <= 1.1x a full checkpoint": s["load_ratio"] <= 1.1,
                 "run stores <= 1.6x one full checkpoint": s["stored_incr_x_one"] <= 1.6}
        for goal, met in goals.items():
            print(f"lora goal: {goal}: {'met' if met else 'NOT met'}")
        print(f"lora: incremental/full save time: worst {s['save_ratio_max']:.2f}x, median "
              f"{s['save_ratio_median']:.2f}x; uploaded: worst {s['incr_uploaded_pct_max']:.2f}%, median "
              f"{s['incr_uploaded_pct_median']:.2f}%")
        results["lora"]["goals"] = goals
    path = write_json(results_path(args, "incremental"), {
        "benchmark": "incremental", "environment": environment_info(), "target": target.describe(),
        "settings": {k: v for k, v in vars(args).items() if k != "endpoint"}, "crc": crc, "results": results})
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
