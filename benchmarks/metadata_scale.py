"""How big and how slow is a checkpoint's ``.metadata`` at scale: s3dcp v1 (JSON), v2 (columnar), v3
(columnar, compressed header) and DCP's own pickle of the same :class:`Metadata`, in two shapes.

    python benchmarks/metadata_scale.py                      # both: 1,024 ranks x 900, 1 rank x 20,000 unique
    python benchmarks/metadata_scale.py --shape sharded --ranks 256 --tensors 300 --v1-ranks 256
    python benchmarks/metadata_scale.py --shape unique --unique-tensors 50000

The synthetic checkpoint is what ``dcp.save`` of an FSDP2 (DTensor, ``Shard(0)``) training state
records. ``--tensors F`` counts state-dict tensors: ``F // 3`` parameters of a Llama-like stack
(``model.layers.N.self_attn.q_proj.weight`` ..., embedding and head), each with the two Adam
states ``optim.state.<param>.exp_avg`` / ``.exp_avg_sq`` (the remainder ``F % 3`` adds parameters
without optimizer state). Every tensor is sharded over all ``R`` ranks along dim 0, so the
checkpoint has ``R x F`` chunks (the seed's 1,024 x 900 = 921,600), one storage item each, packed
per rank into 512 MiB objects as the writer does, each item with a crc32c (and per-16 MiB-block
checksums where an item is larger), plus a few bytes items (``optim.param_groups.*``), DCP's flatten
mapping in ``planner_data`` and ``storage_meta``.

The second shape (``--shape unique``) is one rank of ``--unique-tensors`` (default 20,000)
uniquely named small tensors: an MoE whose experts are separate modules
(``model.layers.N.mlp.experts.E.w1.weight`` ..., 64 experts a layer, plus attention and router)
with Adam states, each tensor one whole chunk. There nothing repeats across ranks for the columns
to share: the names and ``planner_data`` are most of the object, which is what version 3 compresses.

What is measured, all in this one process (timings are noisy on a shared machine; compare the
ratios, which are measured in the same run):

- bytes of the encoded object;
- encode seconds;
- decode seconds "full": every ChunkStorageMetadata, MetadataIndex and ItemLocation built;
- decode seconds "load": what ``dcp.load`` with :class:`s3dcp.S3StorageReader` needs on every rank:
  the whole ``state_dict_metadata`` (DCP's planner matches every chunk box), and the storage
  locations of one rank's items (rank 0: ``F`` items) looked up in the lazy ``storage_data``;
- peak memory: Python allocations during decode (``tracemalloc``; numpy buffers included), off
  with ``--no-memory`` (it slows every step down).

v1 is JSON and at the default shape takes minutes and gigabytes, so by default it runs at a smaller
shape (``--v1-ranks``, default 128, same tensors) and its figures are shown beside the pickle of that
same smaller Metadata. ``--v1-ranks 0`` skips it.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import pickle
import random
import sys
import time
import tracemalloc
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from s3dcp.format import layout  # noqa: E402
from s3dcp.format.layout import ItemLocation  # noqa: E402
from s3dcp.format.metadata import decode_metadata, encode_metadata  # noqa: E402
from s3dcp.format.metadata.v3 import worth_it as v3_worth_it  # noqa: E402

MiB = 1024 * 1024
BLOCK_SIZE_BYTES = 16 * MiB  # s3dcp.format.integrity.BLOCK_SIZE_BYTES
OBJECT_TARGET_BYTES = 512 * MiB  # S3Config.object_size_target_bytes default

# (name, shape) of one transformer layer, Llama-70B-like (hidden 8192, MLP 28672, 8 KV heads).
HIDDEN, MLP, KV, VOCAB = 8192, 28672, 1024, 131072  # vocabulary padded to a multiple of 1,024
LAYER = [
    ("input_layernorm.weight", (HIDDEN,)),
    ("self_attn.q_proj.weight", (HIDDEN, HIDDEN)),
    ("self_attn.k_proj.weight", (KV, HIDDEN)),
    ("self_attn.v_proj.weight", (KV, HIDDEN)),
    ("self_attn.o_proj.weight", (HIDDEN, HIDDEN)),
    ("post_attention_layernorm.weight", (HIDDEN,)),
    ("mlp.gate_proj.weight", (MLP, HIDDEN)),
    ("mlp.up_proj.weight", (MLP, HIDDEN)),
    ("mlp.down_proj.weight", (HIDDEN, MLP)),
]


def parameters(count: int) -> list[tuple[str, tuple[int, ...]]]:
    """``count`` parameter names and shapes: embedding, layers, final norm and head."""
    params = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    layer = 0
    while len(params) < count - 2:
        params += [(f"model.layers.{layer}.{name}", shape) for name, shape in LAYER]
        layer += 1
    params = params[: max(count - 2, 1)]
    params += [("model.norm.weight", (HIDDEN,)), ("lm_head.weight", (VOCAB, HIDDEN))]
    return params[:count]


EXPERTS = 64
MOE_LAYER = [("input_layernorm.weight", (1024,)), ("self_attn.qkv_proj.weight", (3072, 1024)),
             ("self_attn.o_proj.weight", (1024, 1024)), ("post_attention_layernorm.weight", (1024,)),
             ("mlp.router.weight", (EXPERTS, 1024))]
MOE_LAYER += [(f"mlp.experts.{e}.{w}.weight", shape) for e in range(EXPERTS)
              for w, shape in (("w1", (256, 1024)), ("w2", (1024, 256)), ("w3", (256, 1024)))]


def moe_parameters(count: int) -> list[tuple[str, tuple[int, ...]]]:
    """``count`` parameters of an MoE whose experts are unstacked: every expert weight its own tensor."""
    params = [("model.embed_tokens.weight", (32768, 1024))]
    layer = 0
    while len(params) < count:
        params += [(f"model.layers.{layer}.{name}", shape) for name, shape in MOE_LAYER]
        layer += 1
    return params[:count]


def tensors(count: int, params: Callable[[int], list] = parameters) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """``count`` state-dict tensors: parameters (bf16) with their two Adam states (fp32)."""
    n_params = count // 3 + (1 if count % 3 else 0)
    out = []
    for i, (name, shape) in enumerate(params(n_params)):
        out.append((name, shape, torch.bfloat16))
        if len(out) < count:
            out.append((f"optim.state.{name}.exp_avg", shape, torch.float32))
        if len(out) < count:
            out.append((f"optim.state.{name}.exp_avg_sq", shape, torch.float32))
    return out[:count]


def shard0(shape: tuple[int, ...], ranks: int, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, sizes) of ``rank``'s ``Shard(0)`` chunk, as DTensor splits (torch.chunk; tail may be empty)."""
    per = math.ceil(shape[0] / ranks)
    start = min(rank * per, shape[0])
    rows = min(per, shape[0] - start)
    return (start,) + (0,) * (len(shape) - 1), (rows,) + shape[1:]


SHAPES = {"sharded": parameters, "unique": moe_parameters}


def build_metadata(ranks: int, n_tensors: int, *, seed: int = 0, shape: str = "sharded") -> Metadata:
    """The Metadata ``dcp.save`` + :class:`s3dcp.S3StorageWriter` record for the synthetic state (see module doc)."""
    rng = random.Random(seed)
    specs = tensors(n_tensors, SHAPES[shape])
    props = {dt: TensorProperties(dtype=dt) for dt in (torch.bfloat16, torch.float32)}
    dtype_names = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
    sdm: dict[str, Any] = {}
    for fqn, shape, dtype in specs:
        chunks = []
        for r in range(ranks):
            offsets, sizes = shard0(shape, ranks, r)
            chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
        sdm[fqn] = TensorStorageMetadata(properties=props[dtype], size=torch.Size(shape), chunks=chunks)
    byte_items = ["optim.param_groups.0.lr", "optim.param_groups.0.betas", "optim.param_groups.0.eps",
                  "optim.param_groups.0.weight_decay", "optim.param_groups.0.params"]
    for fqn in byte_items:
        sdm[fqn] = BytesStorageMetadata()

    token = f"{rng.getrandbits(48):012x}"
    storage_data: dict[MetadataIndex, ItemLocation] = {}
    for r in range(ranks):
        items = []  # (key, nbytes, dtype name, shape)
        for fqn, shape, dtype in specs:
            offsets, sizes = shard0(shape, ranks, r)
            nbytes = math.prod(sizes) * dtype.itemsize
            items.append((MetadataIndex(fqn, torch.Size(offsets)), nbytes, dtype_names[dtype], sizes))
        if r == 0:
            items += [(MetadataIndex(fqn), 40 + i, None, None) for i, fqn in enumerate(byte_items)]
        for obj, group in enumerate(layout.pack([it[1] for it in items], OBJECT_TARGET_BYTES)):
            name = layout.object_name(r, obj, token)
            offset = 0
            for i in group:
                key, nbytes, dtype_name, sizes = items[i]
                blocks = ()
                if nbytes > BLOCK_SIZE_BYTES:
                    blocks = tuple(f"crc32c:{rng.getrandbits(32):08x}"
                                   for _ in range(math.ceil(nbytes / BLOCK_SIZE_BYTES)))
                storage_data[key] = ItemLocation(
                    object_name=name, offset=offset, length=nbytes,
                    checksum=f"crc32c:{rng.getrandbits(32):08x}", dtype=dtype_name,
                    shape=None if sizes is None else tuple(sizes),
                    block_size=BLOCK_SIZE_BYTES if blocks else 0, block_checksums=blocks,
                )
                offset += nbytes
    # DCP's flatten mapping: flat key -> path in the nested state dict.
    planner_data = {}
    for fqn in sdm:
        if fqn.startswith("optim.state."):
            param, _, state = fqn.removeprefix("optim.state.").rpartition(".")
            planner_data[fqn] = ("optim", "state", param, state)
        elif fqn.startswith("optim.param_groups."):
            _, _, group, key = fqn.split(".")
            planner_data[fqn] = ("optim", "param_groups", int(group), key)
        else:
            planner_data[fqn] = tuple(fqn.split(".", 1))
    return Metadata(
        state_dict_metadata=sdm,
        planner_data=planner_data,
        storage_data=storage_data,
        storage_meta=StorageMeta(checkpoint_id="s3://bucket/run7/step-1000", save_id=token, modules=[]),
        version="1.0.0",
    )


# ---------------------------------------------------------------------------- measurement
@dataclass
class Row:
    """One format at one shape: what it costs."""

    name: str
    ranks: int
    tensors: int
    chunks: int
    bytes: int
    encode_s: float
    decode_full_s: float
    decode_load_s: float
    peak_full_mib: float | None = None
    peak_load_mib: float | None = None
    shape: str = "sharded"


def rank_keys(md: Metadata, ranks: int, rank: int) -> list[MetadataIndex]:
    """The storage keys one rank reads on load, as DCP's planner builds them (index = chunk position)."""
    keys = []
    for fqn, item in md.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            keys.append(MetadataIndex(fqn, item.chunks[rank].offsets, rank))
    return keys


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """(result, seconds) of ``fn()``, after a full collection so earlier garbage is not billed to it."""
    gc.collect()
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def _gc_off(fn: Callable[[], Any]) -> Any:
    was = gc.isenabled()
    gc.disable()
    try:
        return fn()
    finally:
        if was:
            gc.enable()


def _seconds(fn: Callable[[], Any]) -> float:
    """Seconds ``fn()`` takes; its result is freed before the next measurement (not timed)."""
    return _timed(fn)[1]


def _peak_mib(fn: Callable[[], Any]) -> float:
    """Peak Python allocation while ``fn`` runs (its result kept alive, as a real load keeps it)."""
    gc.collect()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        out = fn()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    del out
    return peak / MiB


def measure_formats(ranks: int, n_tensors: int, *, formats: list[str], memory: bool,
                    shape: str = "sharded") -> list[Row]:
    """Build the Metadata, encode it with each of ``formats`` ("pickle", "v1", "v2", "v3"), then decode each.

    The decodes are timed after the original Metadata is gone, as on a rank that loads: Python's
    cyclic GC walks every live object now and then, and millions of them left alive would make
    every decode look slower than it is. Correctness is checked afterwards against the pickle's
    decode (every field of every item, checksums included).
    """
    md = build_metadata(ranks, n_tensors, shape=shape)
    chunks = sum(len(t.chunks) for t in md.state_dict_metadata.values() if isinstance(t, TensorStorageMetadata))
    keys = rank_keys(md, ranks, ranks // 2)
    expected = [md.storage_data[k] for k in keys]
    encoders: dict[str, Callable[[], bytes]] = {
        "pickle": lambda: pickle.dumps(md),  # what DCP's FileSystemWriter writes
        "v1": lambda: encode_metadata(md, version=1),
        "v2": lambda: encode_metadata(md, version=2),
        "v3": lambda: encode_metadata(md, version=3),
    }
    blobs, encode_s = {}, {}
    for name in formats:
        if name in encoders:
            blobs[name], encode_s[name] = _timed(encoders[name])
    blobs["pickle-gc-off"], encode_s["pickle-gc-off"] = blobs["pickle"], encode_s["pickle"]
    md = encoders = None  # freed before the decodes are timed (see the docstring)
    gc.collect()

    def full(name: str) -> Callable[[], Any]:
        if name == "pickle":
            return lambda: pickle.loads(blobs[name])
        if name == "pickle-gc-off":  # for comparison: s3dcp's decode pauses the collector, DCP's unpickling does not
            return lambda: _gc_off(lambda: pickle.loads(blobs["pickle"]))
        return lambda: decode_metadata(blobs[name], lazy=False)

    def load(name: str) -> Callable[[], Any]:
        def run() -> Any:
            out = decode_metadata(blobs[name])  # v2, v3: storage_data decoded per lookup
            return out, [out.storage_data[k] for k in keys]
        return run

    rows = []
    for name in formats:
        decode_full_s = _seconds(full(name))
        lazy = name in ("v2", "v3")  # pickle and v1 have no lazy form: their load is the full decode, timed once
        decode_load_s = _seconds(load(name)) if lazy else decode_full_s
        row = Row(name, ranks, n_tensors, chunks, len(blobs[name]), encode_s[name], decode_full_s, decode_load_s,
                  shape=shape)
        if memory and name == "pickle-gc-off":  # the same objects as the plain unpickling
            row.peak_full_mib = row.peak_load_mib = next(r.peak_full_mib for r in rows if r.name == "pickle")
        elif memory:
            row.peak_full_mib = _peak_mib(full(name))
            row.peak_load_mib = _peak_mib(load(name)) if lazy else row.peak_full_mib
        rows.append(row)

    reference = pickle.loads(blobs["pickle"])
    for name in formats:
        if name.startswith("pickle"):
            continue
        decoded = full(name)()
        if decoded != reference:
            raise AssertionError(f"{name}: the decoded Metadata differs from the original")
        missing = sum(1 for loc in decoded.storage_data.values() if loc.checksum is None)
        if missing:
            raise AssertionError(f"{name}: {missing} item(s) lost their checksum")
        del decoded
        if load(name)()[1] != expected:
            raise AssertionError(f"{name}: the load path found other locations than the original")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=["both", "sharded", "unique"], default="both",
                        help="sharded: R ranks x F tensors; unique: 1 rank x --unique-tensors; both (default)")
    parser.add_argument("--ranks", type=int, default=1024, help="ranks R (default 1,024)")
    parser.add_argument("--tensors", type=int, default=900, help="state-dict tensors F (default 900)")
    parser.add_argument("--unique-tensors", type=int, default=20000,
                        help="tensors of the one-rank shape (default 20,000)")
    parser.add_argument("--v1-ranks", type=int, default=128,
                        help="ranks for the v1 (JSON) comparison, 0 to skip (default 128: v1 at 1,024 takes minutes)")
    parser.add_argument("--no-memory", action="store_true", help="skip the tracemalloc peak-memory pass")
    parser.add_argument("--out", default="results", help="directory for the JSON result (default results/)")
    parser.add_argument("--json", help="write the JSON result to this path instead")
    args = parser.parse_args(argv)
    if args.ranks < 1 or args.tensors < 1 or args.unique_tensors < 1 or args.v1_ranks < 0:
        parser.error("--ranks, --tensors and --unique-tensors must be >= 1, --v1-ranks >= 0")

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import environment_info, print_table, results_path, write_json

    memory = not args.no_memory
    binary = ["pickle", "pickle-gc-off", "v2", "v3"]
    rows, mains = [], {}
    if args.shape in ("both", "sharded"):
        print(f"{args.ranks} ranks x {args.tensors} tensors: DCP pickle and s3dcp v2, v3 ...", flush=True)
        rows += measure_formats(args.ranks, args.tensors, formats=binary, memory=memory)
        mains["sharded"] = (args.ranks, args.tensors)
        if args.v1_ranks:
            print(f"v1 (JSON) at {args.v1_ranks} ranks x {args.tensors} tensors, beside pickle of the same ...",
                  flush=True)
            rows += measure_formats(args.v1_ranks, args.tensors, formats=["pickle", "v1", "v2"], memory=memory)
    if args.shape in ("both", "unique"):
        print(f"1 rank x {args.unique_tensors} uniquely named tensors: DCP pickle and s3dcp v2, v3 ...", flush=True)
        rows += measure_formats(1, args.unique_tensors, formats=binary, memory=memory, shape="unique")
        mains["unique"] = (1, args.unique_tensors)

    names = {"pickle": "DCP pickle", "pickle-gc-off": "  same, GC paused", "v1": "s3dcp v1 JSON", "v2": "s3dcp v2",
             "v3": "s3dcp v3"}
    table = []
    for row in rows:
        base = next(r for r in rows if r.name == "pickle" and (r.ranks, r.tensors, r.shape) == (row.ranks, row.tensors,
                                                                                                 row.shape))
        table.append({
            "format": names[row.name], "shape": f"{row.ranks}x{row.tensors}" + (" unique" if row.shape == "unique" else ""),
            "chunks": row.chunks, "MB": row.bytes / 1e6,
            "bytes_x": row.bytes / base.bytes, "enc_s": row.encode_s, "full_s": row.decode_full_s,
            "full_x": row.decode_full_s / base.decode_full_s, "load_s": row.decode_load_s,
            "load_x": row.decode_load_s / base.decode_full_s, "peak_full": row.peak_full_mib,
            "peak_load": row.peak_load_mib, "key": (row.name, row.shape, row.ranks, row.tensors),
        })
    print()
    print_table(table, [
        ("format", "format"), ("shape", "R x F"), ("chunks", "chunks"), ("MB", "MB", ".3f"),
        ("bytes_x", "x pickle", ".3f"), ("enc_s", "encode s", ".2f"), ("full_s", "decode full s", ".3f"),
        ("full_x", "x pickle", ".3f"), ("load_s", "decode load s", ".3f"), ("load_x", "x pickle", ".3f"),
        ("peak_full", "peak full MiB", ".0f"), ("peak_load", "peak load MiB", ".0f"),
    ], title="checkpoint .metadata: bytes, encode and decode (full: every object; load: what dcp.load "
             "needs on one rank)")
    print("x pickle: ratio to DCP's pickle of the same Metadata, measured in this run. decode load = "
          "state_dict_metadata in full + one rank's storage locations looked up (pickle and v1 decode everything).\n"
          "s3dcp's decode pauses Python's cyclic GC (it builds no cycles); DCP's unpickling runs with it on, as "
          "dcp.load does. 'same, GC paused' shows how much of the gap that is.\n"
          "The writer's default (encode_metadata() without a version) is v3 where it saves >= 64 KiB and 1/8 of v2, "
          "else v2; its goals below are checked on that choice.")
    verdicts = {}
    for shape, (ranks, n) in mains.items():
        get = {t["key"][0]: t for t in table if t["key"][1:] == (shape, ranks, n)}
        chosen = "v3" if v3_worth_it(round(get["v2"]["MB"] * 1e6), round(get["v3"]["MB"] * 1e6)) else "v2"
        label = f"{ranks} x {n}" + (" unique" if shape == "unique" else "")
        print(f"{label}: the writer picks {chosen}; against the GC-paused pickle: {chosen} decode full "
              f"x{get[chosen]['full_s'] / get['pickle-gc-off']['full_s']:.3f}, "
              f"load x{get[chosen]['load_s'] / get['pickle-gc-off']['full_s']:.3f}")
        verdicts.update({
            f"{label}: bytes <= 1/4 of pickle ({chosen})": get[chosen]["bytes_x"] <= 0.25,
            f"{label}: decode (full) <= 1/2 of pickle ({chosen})": get[chosen]["full_x"] <= 0.5,
            f"{label}: decode (load) <= 1/2 of pickle ({chosen})": get[chosen]["load_x"] <= 0.5,
        })
    verdicts["every item checksummed and round-tripped"] = True  # measure_formats raises otherwise
    print("\ngoals:")
    for goal, ok in verdicts.items():
        print(f"  {'PASS' if ok else 'FAIL'}  {goal}")
    for t in table:
        del t["key"]
    path = write_json(results_path(args, "metadata_scale"), {
        "benchmark": "metadata_scale", "environment": environment_info(), "args": vars(args),
        "rows": [vars(r) for r in rows], "table": table, "goals": verdicts,
    })
    print(f"\nresult: {path}")
    return 0 if all(verdicts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
