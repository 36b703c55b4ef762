"""Save and load of a synthetic training state, 1 and 2 ranks, through four paths:

    s3dcp       dcp.save / dcp.load with S3StorageWriter / S3StorageReader (the CRT moves the bytes)
    s3dcp-sockets  the same with the opt-in S3Config(transport="sockets")
    fs          dcp.save / dcp.load with FileSystemWriter / FileSystemReader to a local temp dir
    monolithic  gather the state to rank 0 (gather_object), torch.save to memory, boto3
                upload_fileobj; load: rank 0 download_fileobj + torch.load, then each rank gets
                its part (scatter_object_list: a kinder baseline than broadcasting everything)
                and copies it into its state
    raw         each rank S3Client.put of as many bytes as its shard (one buffer) and
                get_range_into back, through the CRT: the floor any S3 checkpoint path pays
    raw-sockets the same over s3dcp's own sockets (S3Config(transport="sockets"))
    ts-s3dcp    TorchSnapshot Snapshot.take / restore through s3dcp's plugin (s3dcp://, the CRT
                client); needs torchsnapshot (pip install -e '.[torchsnapshot]')
    ts-s3       TorchSnapshot's built-in s3:// plugin (aiobotocore), same state, same server;
                needs torchsnapshot and aiobotocore (not an s3dcp dependency: it pins botocore)
    s3dcp-cast  as s3dcp, but loaded into a state of other dtypes (fp32 <-> bf16), so every byte
                goes through the reader's bounce window: load time and RSS rise of a bounced load
    s3tc        dcp.save / dcp.load with s3torchconnector's DCP S3StorageWriter / S3StorageReader
                (its own CRT client), same state, same server; needs s3torchconnector
                (pip install -e '.[compare]'); the tables print s3dcp's time and client CPU
                as a ratio to it

The TorchSnapshot rows run by default when their packages import; the state is the same flat
set of tensors as a TorchSnapshot ``StateDict`` (one per rank).

    python benchmarks/throughput.py                              # 256 MiB, --nproc 1 2, 3 repeats
    python benchmarks/throughput.py --state-mib 32 --repeats 1
    python benchmarks/throughput.py --modes s3dcp raw --nproc 2
    python benchmarks/throughput.py --modes ts-s3dcp ts-s3 raw --state-mib 64
    python benchmarks/throughput.py --modes s3dcp s3tc raw --state-mib 512 --nproc 1

Each rank holds its own shard of the state (keys carry the rank, ``r<rank>.``): mixed large and
small tensors, fp32 and bf16 parameters, Adam-like ``exp_avg`` / ``exp_avg_sq`` (fp32) and a
0-d ``step`` per parameter, and a global ``step`` int. The shards add up to ``--state-mib``.
Ranks are spawned with torch.multiprocessing and talk gloo over 127.0.0.1.

Every save goes to a fresh prefix (deleted, untimed, after its load). Before every load the
destination state is zeroed (untimed) and after it compared with the saved state
(``torch.equal``, untimed), so no path can look fast by not moving the bytes. A small warm-up
round (untimed) runs every path once first. Cases run interleaved (s3dcp, fs, monolithic,
raw, s3dcp, ...); medians are reported.

On the embedded SeaweedFS (which shares the CPUs with the ranks) writes are server-bound;
client CPU s/GiB is the figure that shows how much of the machine each path costs the trainer.
For s3dcp and s3tc it is also printed by phase of DCP's call order (benchmarks/phases.py), next
to the floor of a save measured in the same run (the wire and item checksums, the socket
copies; parts go to the socket from the tensors' memory).
"""

from __future__ import annotations

import argparse
import datetime
import io
import os
import shutil
import socket
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (  # noqa: E402
    MiB,
    add_common_args,
    boto3_client_for,
    delete_prefix,
    dist_measure,
    environment_info,
    gbps,
    median,
    per_gib,
    print_table,
    release_memory,
    results_path,
    s3_target,
    write_json,
)

from phases import LOAD_ORDER, LOAD_PHASES, SAVE_ORDER, SAVE_PHASES, clocked, floor_cpu_s_per_gib  # noqa: E402

MODES = ("s3dcp", "s3dcp-sockets", "s3dcp-cast", "fs", "monolithic", "raw", "raw-sockets", "ts-s3dcp", "ts-s3",
         "s3tc")


def available_modes() -> list[str]:
    """Every mode whose packages import (the TorchSnapshot and s3torchconnector rows are optional)."""
    import importlib.util

    have = {name: importlib.util.find_spec(name) is not None
            for name in ("torchsnapshot", "aiobotocore", "s3torchconnector")}
    return [m for m in MODES
            if m != "s3dcp-cast"  # opt-in: --modes s3dcp-cast
            and (m != "s3tc" or have["s3torchconnector"])
            and (not m.startswith("ts-") or (have["torchsnapshot"] and (m != "ts-s3" or have["aiobotocore"])))]
HIDDEN = 1024
LAYERS = 8


# ---------------------------------------------------------------------------- synthetic state
def build_state(rank: int, nbytes: int, seed: int):
    """One rank's shard of a training state of about ``nbytes`` bytes of tensors.

    Per layer: a large fp32 matrix, a bf16 matrix half its height, an fp32 bias and a bf16 norm
    weight; each parameter has fp32 exp_avg and exp_avg_sq and a 0-d fp32 step (as torch's Adam).
    What the layers leave of ``nbytes`` goes into one fp32 buffer.
    """
    import torch

    g = torch.Generator().manual_seed(seed)
    # bytes per layer for r rows of the big matrix (and r//2 of the bf16 one), moments included
    per_row = HIDDEN * (4 + 8) + HIDDEN * (2 + 8) // 2
    fixed = HIDDEN * (4 + 8) + HIDDEN * (2 + 8) + 4 * 4  # bias, norm, 4 steps
    rows = max(2, (nbytes // LAYERS - fixed) // per_row)
    model, optim = {}, {}

    def param(name, shape, dtype):
        p = torch.randn(*shape, generator=g).to(dtype)
        model[name] = p
        optim[name] = {
            "exp_avg": torch.randn(*shape, generator=g) * 1e-3,
            "exp_avg_sq": torch.rand(*shape, generator=g) * 1e-6,
            "step": torch.tensor(float(1000 + rank)),
        }

    r = f"r{rank}"
    for i in range(LAYERS):
        param(f"{r}.layers.{i}.attn.weight", (rows, HIDDEN), torch.float32)
        param(f"{r}.layers.{i}.mlp.weight", (rows // 2, HIDDEN), torch.bfloat16)
        param(f"{r}.layers.{i}.attn.bias", (HIDDEN,), torch.float32)
        param(f"{r}.layers.{i}.norm.weight", (HIDDEN,), torch.bfloat16)
    state = {"model": model, "optim": {"state": optim}, "step": 1000}
    left = nbytes - tree_nbytes(state)
    if left >= 4:
        model[f"{r}.buffers.filler"] = torch.randn(left // 4, generator=g)
    return state


def tree_items(tree, path=()):
    """(path, leaf) pairs of a nested dict."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from tree_items(v, path + (k,))
    else:
        yield path, tree


def tree_nbytes(tree) -> int:
    import torch

    return sum(v.numel() * v.element_size() for _, v in tree_items(tree) if isinstance(v, torch.Tensor))


def tree_like(tree):
    """Same structure, zeroed tensors (pages faulted in), ints zeroed."""
    import torch

    if isinstance(tree, dict):
        return {k: tree_like(v) for k, v in tree.items()}
    if isinstance(tree, torch.Tensor):
        return torch.zeros_like(tree)
    return 0


def tree_zero(tree) -> None:
    import torch

    for k, v in list(tree.items()):
        if isinstance(v, dict):
            tree_zero(v)
        elif isinstance(v, torch.Tensor):
            v.zero_()
        else:
            tree[k] = 0


def tree_copy_into(dest, src) -> None:
    """Copy ``src``'s values into ``dest``'s tensors in place (same structure)."""
    import torch

    for k, v in src.items():
        if isinstance(v, dict):
            tree_copy_into(dest[k], v)
        elif isinstance(v, torch.Tensor):
            dest[k].copy_(v)
        else:
            dest[k] = v


def tree_equal(a, b) -> str | None:
    """None when equal, else where they differ."""
    import torch

    la, lb = dict(tree_items(a)), dict(tree_items(b))
    if la.keys() != lb.keys():
        return f"keys differ: {sorted(set(la) ^ set(lb))[:3]}"
    for path, x in la.items():
        y = lb[path]
        if isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)):
                return ".".join(map(str, path))
        elif x != y:
            return ".".join(map(str, path))
    return None


def merge_states(states):
    full = {"model": {}, "optim": {"state": {}}, "step": states[0]["step"]}
    for s in states:
        full["model"].update(s["model"])
        full["optim"]["state"].update(s["optim"]["state"])
    return full


def split_state(full, rank):
    mine = f"r{rank}."
    return {"model": {k: v for k, v in full["model"].items() if k.startswith(mine)},
            "optim": {"state": {k: v for k, v in full["optim"]["state"].items() if k.startswith(mine)}},
            "step": full["step"]}


# ---------------------------------------------------------------------------- the four paths
class Path:
    """One way to save and load a rank's state; ``where`` is a fresh location per save."""

    def __init__(self, ctx, state, dest):
        self.ctx, self.state, self.dest = ctx, state, dest

    def save(self, where):
        raise NotImplementedError

    def load(self, where):
        raise NotImplementedError

    def reset(self):
        tree_zero(self.dest)

    def check(self) -> str | None:
        return tree_equal(self.state, self.dest)

    def cleanup(self, where):  # all ranks call it after a barrier
        if self.ctx["rank"] == 0:
            delete_prefix(self.ctx["client"], self.ctx["bucket"], where)


class S3DCPPath(Path):
    def save(self, where):
        import torch.distributed.checkpoint as dcp
        from s3dcp import S3StorageWriter

        writer, clock = clocked(S3StorageWriter(f"s3://{self.ctx['bucket']}/{where}", config=self.ctx["cfg"]),
                                SAVE_PHASES)
        clock.start()
        dcp.save(self.state, storage_writer=writer)
        return {"upload_s": writer.last_stats.upload_s, "objects": writer.last_stats.objects, "phases": clock.stop()}

    def load(self, where):
        import torch.distributed.checkpoint as dcp
        from s3dcp import S3StorageReader

        reader, clock = clocked(S3StorageReader(f"s3://{self.ctx['bucket']}/{where}", config=self.ctx["cfg"]),
                                LOAD_PHASES)
        clock.start()
        dcp.load(self.dest, storage_reader=reader)
        return {"read_s": reader.last_read_s, "phases": clock.stop(), "walls": clock.walls(),
                "verify_s": reader.items.verify_s}


class S3DCPCastPath(S3DCPPath):
    """Loads into tensors of another dtype (fp32 -> bf16, others -> fp32): nothing lands in
    place, every byte is bounced and cast."""

    def __init__(self, ctx, state, dest):
        super().__init__(ctx, state, _cast_like(state))

    def check(self):
        return tree_equal(_cast_like(self.state, copy=True), self.dest)


def _cast_like(tree, copy=False):
    import torch

    if isinstance(tree, dict):
        return {k: _cast_like(v, copy) for k, v in tree.items()}
    if isinstance(tree, torch.Tensor):
        dtype = torch.bfloat16 if tree.dtype == torch.float32 else torch.float32
        return tree.to(dtype) if copy else torch.zeros(tree.shape, dtype=dtype)
    return tree if copy else 0


class FSPath(Path):
    def _dir(self, where):
        return os.path.join(self.ctx["tmpdir"], where)

    def save(self, where):
        import torch.distributed.checkpoint as dcp

        dcp.save(self.state, storage_writer=dcp.FileSystemWriter(self._dir(where)))

    def load(self, where):
        import torch.distributed.checkpoint as dcp

        dcp.load(self.dest, storage_reader=dcp.FileSystemReader(self._dir(where)))

    def cleanup(self, where):
        if self.ctx["rank"] == 0:
            shutil.rmtree(self._dir(where), ignore_errors=True)


class MonolithicPath(Path):
    """The common baseline: one torch.save file of the whole state, written by rank 0."""

    def _key(self, where):
        return f"{where}/state.pt"

    def save(self, where):
        import torch
        import torch.distributed as dist

        rank, world = self.ctx["rank"], self.ctx["world"]
        if world > 1:
            gathered = [None] * world if rank == 0 else None
            dist.gather_object(self.state, gathered, dst=0)
        else:
            gathered = [self.state]
        if rank == 0:
            buf = io.BytesIO()
            torch.save(merge_states(gathered), buf)
            del gathered
            buf.seek(0)
            self.ctx["boto3"].upload_fileobj(buf, self.ctx["bucket"], self._key(where), Config=self.ctx["tcfg"])

    def load(self, where):
        import torch
        import torch.distributed as dist

        rank, world = self.ctx["rank"], self.ctx["world"]
        parts = None
        if rank == 0:
            buf = io.BytesIO()
            self.ctx["boto3"].download_fileobj(self.ctx["bucket"], self._key(where), buf, Config=self.ctx["tcfg"])
            buf.seek(0)
            full = torch.load(buf, weights_only=True)
            del buf
            parts = [split_state(full, r) for r in range(world)]
            del full
        if world > 1:
            mine = [None]
            dist.scatter_object_list(mine, parts, src=0)
            mine = mine[0]
        else:
            mine = parts[0]
        del parts
        tree_copy_into(self.dest, mine)


class RawPath(Path):
    """The floor: the shard's byte count as one object, from one buffer, back into one buffer
    (as many bytes as the shard, so the same object count as s3dcp below 512 MiB a rank)."""

    def __init__(self, ctx, state, dest):
        import torch

        super().__init__(ctx, state, dest)
        n = tree_nbytes(state)
        g = torch.Generator().manual_seed(99 + ctx["rank"])
        self.src = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        self.dst = torch.zeros(n, dtype=torch.uint8)

    def _key(self, where):
        return f"{where}/raw-{self.ctx['rank']}.bin"

    # A new S3Client per step, as S3StorageWriter/Reader make one per save/load (both share the
    # process's native CRT client for this config, so the two paths see the same buffer pool).
    def save(self, where):
        from s3dcp.s3.client import S3Client
        from s3dcp.format.tensors import byte_view

        client = S3Client(self.ctx["cfg"])
        client.put(self.ctx["bucket"], self._key(where), byte_view(self.src)).result()
        client.close()

    def load(self, where):
        from s3dcp.s3.client import S3Client
        from s3dcp.format.tensors import byte_view

        client = S3Client(self.ctx["cfg"])
        client.get_range_into(self.ctx["bucket"], self._key(where), 0, byte_view(self.dst)).result()
        client.close()

    def reset(self):
        self.dst.zero_()

    def check(self):
        import torch

        return None if torch.equal(self.src, self.dst) else "raw bytes differ"


class TorchSnapshotPath(Path):
    """Snapshot.take / Snapshot.restore of the state as one StateDict per rank, through
    ``protocol`` (``s3dcp``: this project's plugin; ``s3``: TorchSnapshot's aiobotocore one)."""

    protocol = "s3dcp"

    def __init__(self, ctx, state, dest):
        super().__init__(ctx, state, dest)
        from importlib_metadata import entry_points  # what TorchSnapshot looks plugins up with

        if self.protocol == "s3dcp" and "s3dcp" not in {ep.name for ep in entry_points(group="storage_plugins")}:
            raise RuntimeError("TorchSnapshot does not know s3dcp:// here: the entry point is registered at install "
                               "time, so reinstall s3dcp (pip install -e '.[torchsnapshot]')")

    def _url(self, where):
        return f"{self.protocol}://{self.ctx['bucket']}/{where}"

    def _options(self):
        return {"config": self.ctx["cfg"]} if self.protocol == "s3dcp" else None

    def _flat(self, tree):
        return {".".join(path): leaf for path, leaf in tree_items(tree)}

    def save(self, where):
        from torchsnapshot import Snapshot, StateDict

        Snapshot.take(self._url(where), {"state": StateDict(**self._flat(self.state))},
                      storage_options=self._options())

    def load(self, where):
        from torchsnapshot import Snapshot, StateDict

        flat = StateDict(**self._flat(self.dest))  # tensors restore in place
        Snapshot(self._url(where), storage_options=self._options()).restore({"state": flat})
        for path, _ in tree_items(self.dest):  # non-tensor leaves come back as new objects
            parent = self.dest
            for k in path[:-1]:
                parent = parent[k]
            if not hasattr(parent[path[-1]], "copy_"):
                parent[path[-1]] = flat[".".join(path)]


class TorchSnapshotBuiltinS3Path(TorchSnapshotPath):
    protocol = "s3"

    def __init__(self, ctx, state, dest):
        super().__init__(ctx, state, dest)
        cfg = ctx["cfg"]  # aiobotocore reads the endpoint and credentials from the environment only
        os.environ.update({"AWS_ENDPOINT_URL_S3": cfg.endpoint_url, "AWS_REGION": cfg.region,
                           "AWS_DEFAULT_REGION": cfg.region})
        if cfg.access_key_id:
            os.environ.update({"AWS_ACCESS_KEY_ID": cfg.access_key_id, "AWS_SECRET_ACCESS_KEY": cfg.secret_access_key})
        if cfg.use_path_style:  # a local server: no bucket.host names
            path = os.path.join(ctx["tmpdir"], f"aws-config-{ctx['rank']}")
            with open(path, "w") as f:
                f.write("[default]\ns3 =\n    addressing_style = path\n")
            os.environ["AWS_CONFIG_FILE"] = path
            os.environ.pop("AWS_PROFILE", None)


class S3TorchConnectorPath(Path):
    """s3torchconnector's DCP writer and reader (see benchmarks/compare.py)."""

    def save(self, where):
        import torch.distributed.checkpoint as dcp
        from compare import s3tc_writer

        writer, clock = clocked(s3tc_writer(f"s3://{self.ctx['bucket']}/{where}", self.ctx["cfg"]), SAVE_PHASES)
        clock.start()
        dcp.save(self.state, storage_writer=writer)  # as compare.s3tc_save, clocked
        return {"phases": clock.stop()}

    def load(self, where):
        import torch.distributed.checkpoint as dcp
        from compare import s3tc_reader

        reader, clock = clocked(s3tc_reader(f"s3://{self.ctx['bucket']}/{where}", self.ctx["cfg"]), LOAD_PHASES)
        clock.start()
        dcp.load(self.dest, storage_reader=reader)  # as compare.s3tc_load, clocked
        return {"phases": clock.stop()}


class RawSocketsPath(RawPath):
    """The same raw transfer over s3dcp's own sockets (``S3Config(transport="sockets")``)."""

    def __init__(self, ctx, state, dest):
        from dataclasses import replace

        super().__init__(dict(ctx, cfg=replace(ctx["cfg"], transport="sockets")), state, dest)


class S3DCPSocketsPath(S3DCPPath):
    """s3dcp with the opt-in socket transport (``S3Config(transport="sockets")``)."""

    def __init__(self, ctx, state, dest):
        from dataclasses import replace

        super().__init__(dict(ctx, cfg=replace(ctx["cfg"], transport="sockets")), state, dest)


PATHS = {"s3dcp": S3DCPPath, "s3dcp-sockets": S3DCPSocketsPath, "s3dcp-cast": S3DCPCastPath, "fs": FSPath,
         "monolithic": MonolithicPath, "raw": RawPath, "raw-sockets": RawSocketsPath, "ts-s3dcp": TorchSnapshotPath,
         "ts-s3": TorchSnapshotBuiltinS3Path,
         "s3tc": S3TorchConnectorPath}


# ---------------------------------------------------------------------------- ranks
def _worker(rank: int, world: int, port: int, spec: dict) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if "ts-s3" in spec["modes"]:
        # botocore's CRT signer (used when awscrt is installed, as it is with s3dcp) fails on
        # TorchSnapshot's memoryview request bodies; botocore reads this before it is imported.
        os.environ["BOTO_DISABLE_CRT"] = "true"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=20))
    try:
        _run_rank(rank, world, spec)
    finally:
        dist.destroy_process_group()


def _run_rank(rank: int, world: int, spec: dict) -> None:
    import torch.distributed as dist
    from boto3.s3.transfer import TransferConfig
    from s3dcp.s3.client import S3Client

    cfg = spec["cfg"]
    ctx = {
        "rank": rank, "world": world, "cfg": cfg, "bucket": spec["bucket"], "tmpdir": spec["tmpdir"],
        "client": S3Client(cfg), "boto3": boto3_client_for(cfg, max_pool_connections=16),
        "tcfg": TransferConfig(multipart_threshold=cfg.effective_multipart_threshold_bytes,
                               multipart_chunksize=cfg.part_size_bytes, max_concurrency=10),
    }
    server_pid = spec["server_pid"] if rank == 0 else None
    base = f"{spec['prefix']}/np{world}"
    say = print if rank == 0 else (lambda *a, **k: None)

    def barrier():
        dist.barrier()

    def everyone_ok(problem):
        problems = [None] * world
        dist.all_gather_object(problems, problem)
        bad = [(r, p) for r, p in enumerate(problems) if p]
        if bad:
            raise RuntimeError(f"loaded state differs from the saved state: {bad}")

    def one_round(paths, tag, repeat, record):
        for mode, path in paths.items():
            where = f"{base}/{tag}/{mode}"
            release_memory()
            save = dist_measure(lambda: path.save(where), server_pid=server_pid, sample_rss=True,
                                gather_value=True)
            path.reset()
            release_memory()
            load = dist_measure(lambda: path.load(where), server_pid=server_pid, sample_rss=True,
                                gather_value=True)
            everyone_ok(path.check())
            barrier()
            path.cleanup(where)
            barrier()
            if record is not None:
                record.setdefault(mode, []).append({"save": save.to_dict(), "load": load.to_dict(),
                                                    "save_info": save.value, "load_info": load.value})
                n = spec["total_bytes"]
                say(f"  np={world} rep {repeat}: {mode:<10} save {save.wall_s:7.3f} s "
                    f"({gbps(n, save.wall_s):.3f} GB/s, cpu {save.cpu_total_s:5.2f} s)  "
                    f"load {load.wall_s:7.3f} s ({gbps(n, load.wall_s):.3f} GB/s, cpu {load.cpu_total_s:5.2f} s)"
                    "  verified", flush=True)

    if spec["warmup"]:
        small = build_state(rank, max(1 * MiB, spec["shard_bytes"] // 32), seed=7 + rank)
        warm = {m: PATHS[m](ctx, small, tree_like(small)) for m in spec["modes"]}
        one_round(warm, "warmup", -1, None)
        del warm, small
        say(f"  np={world}: warm-up round done (every path verified)", flush=True)

    t = time.perf_counter()
    state = build_state(rank, spec["shard_bytes"], seed=rank)
    dest = tree_like(state)
    paths = {m: PATHS[m](ctx, state, dest) for m in spec["modes"]}
    shard = tree_nbytes(state)
    shards = [None] * world
    dist.all_gather_object(shards, shard)
    spec["total_bytes"] = sum(shards)
    say(f"  np={world}: state built in {time.perf_counter() - t:.1f} s: {len(list(tree_items(state)))} "
        f"leaves per rank, shards {[round(s / MiB, 1) for s in shards]} MiB", flush=True)

    record: dict = {}
    for r in range(spec["repeats"]):
        one_round(paths, f"rep{r}", r, record)
    if rank == 0:
        write_json(spec["result_path"], {"shard_bytes": shards, "total_bytes": sum(shards), "runs": record})
    barrier()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------- report
def summarize_mode(runs: list[dict], total: int, shards: list[int]) -> dict:
    out: dict = {}
    for op in ("save", "load"):
        ms = [r[op] for r in runs]
        wall = median(m["wall_s"] for m in ms)
        out[f"{op}_s"] = wall
        out[f"{op}_gbps"] = gbps(total, wall)
        out[f"{op}_cpu_s_per_gib"] = per_gib(median(m["cpu_total_s"] for m in ms), total)
        out[f"{op}_server_cpu_s_per_gib"] = per_gib(median(m["server_cpu_s"] for m in ms), total)
        out[f"{op}_wall_s_all"] = [m["wall_s"] for m in ms]
        # peak RSS per rank (median over repeats), and its rise over the RSS before the step
        world = len(shards)
        peak = [median(m["peak_rss"][r] for m in ms) for r in range(world)]
        extra = [median(m["peak_rss"][r] - m["rss_before"][r] for m in ms) for r in range(world)]
        out[f"{op}_peak_rss_mib"] = [p / MiB for p in peak]
        out[f"{op}_rss_extra_mib"] = [e / MiB for e in extra]
        out[f"{op}_rss_extra_x_shard"] = [e / s for e, s in zip(extra, shards)]
        # client CPU by phase (summed over ranks), for the paths that clock them
        infos = [r[f"{op}_info"] for r in runs]
        if all(isinstance(i, dict) and "phases" in i for info in infos for i in info):
            for phase in SAVE_ORDER if op == "save" else LOAD_ORDER:
                out[f"{op}_cpu_{phase}_s_per_gib"] = per_gib(
                    median(sum(i["phases"][phase] for i in info) for info in infos), total)
        if all(isinstance(i, dict) and "walls" in i for info in infos for i in info):  # the slowest rank's
            for phase in LOAD_ORDER:
                out[f"{op}_wall_{phase}_s"] = median(max(i["walls"][phase] for i in info) for info in infos)
            out[f"{op}_wall_verify_s"] = median(max(i["verify_s"] for i in info) for info in infos)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="dcp save/load of a synthetic training state: s3dcp vs DCP filesystem vs a monolithic "
                    "torch.save + boto3 baseline vs raw S3Client transfer (and TorchSnapshot through s3dcp's "
                    "plugin and its own S3 plugin), on 1 and 2 ranks.")
    parser.add_argument("--state-mib", type=int, default=256, metavar="N",
                        help="total state size over all ranks (default 256)")
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2], metavar="N",
                        help="rank counts to run (default: 1 2)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=available_modes(),
                        help="default: all whose packages are installed")
    parser.add_argument("--part-mib", type=int, default=None, metavar="N",
                        help="part size for s3dcp, raw and boto3 (default: S3Config's)")
    parser.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up round")
    parser.add_argument("--tmpdir", default=None, help="where the fs path writes (default: system temp)")
    add_common_args(parser, repeats=3)
    args = parser.parse_args(argv)
    if "s3tc" in args.modes and "s3tc" not in available_modes():
        from compare import s3tc_note

        print(f"# {s3tc_note()}", flush=True)
        args.modes = [m for m in args.modes if m != "s3tc"]
    elif "s3tc" not in available_modes():
        from compare import s3tc_note

        print(f"# {s3tc_note()}", flush=True)

    import torch.multiprocessing as mp

    total = args.state_mib * MiB
    started = time.perf_counter()
    report: dict = {}
    with s3_target(args) as target, tempfile.TemporaryDirectory(prefix="s3dcp-bench-fs-", dir=args.tmpdir) as tmp:
        cfg = target.config
        if args.part_mib:
            cfg = cfg.replace(part_size_bytes=args.part_mib * MiB, multipart_threshold_bytes=args.part_mib * MiB)
        print(f"# throughput: {args.state_mib} MiB state, ranks {args.nproc}, modes {args.modes}, "
              f"{args.repeats} repeat(s), part {cfg.part_size_bytes // MiB} MiB, "
              f"object target {cfg.object_size_target_bytes // MiB} MiB, checksum {cfg.checksum}", flush=True)
        for world in args.nproc:
            spec = {
                "cfg": cfg, "bucket": target.bucket, "server_pid": target.server_pid,
                "prefix": target.prefix("throughput"), "tmpdir": tmp, "modes": args.modes,
                "repeats": args.repeats, "warmup": not args.no_warmup, "shard_bytes": total // world,
                "result_path": os.path.join(tmp, f"result-np{world}.json"),
            }
            t = time.perf_counter()
            mp.spawn(_worker, args=(world, _free_port(), spec), nprocs=world, join=True)
            import json

            with open(spec["result_path"]) as f:
                report[world] = json.load(f)
            print(f"# np={world} done in {time.perf_counter() - t:.0f} s", flush=True)

    rows = []
    for world, res in report.items():
        summaries = {m: summarize_mode(res["runs"][m], res["total_bytes"], res["shard_bytes"]) for m in args.modes}
        raw = summaries.get("raw")
        s3tc = summaries.get("s3tc")
        for mode in args.modes:
            s = summaries[mode]
            row = {"nproc": world, "mode": mode, "state_mib": res["total_bytes"] / MiB, **s}
            if raw:
                row["save_x_raw"] = s["save_s"] / raw["save_s"]
                row["load_x_raw"] = s["load_s"] / raw["load_s"]
            if s3tc:  # time and client CPU relative to s3torchconnector's DCP writer/reader
                for op in ("save", "load"):
                    row[f"{op}_x_s3tc"] = s[f"{op}_s"] / s3tc[f"{op}_s"]
                    row[f"{op}_cpu_x_s3tc"] = s[f"{op}_cpu_s_per_gib"] / s3tc[f"{op}_cpu_s_per_gib"]
            row["load_peak_rss_mib_max"] = max(s["load_peak_rss_mib"])
            row["load_rss_extra_x_shard_max"] = max(s["load_rss_extra_x_shard"])
            row["save_rss_extra_x_shard_max"] = max(s["save_rss_extra_x_shard"])
            if mode in ("s3dcp", "s3dcp-sockets", "s3dcp-cast"):
                infos = res["runs"][mode]
                row["s3dcp_upload_s_median"] = median(max(i["upload_s"] for i in r["save_info"]) for r in infos)
                row["s3dcp_read_s_median"] = median(max(i["read_s"] for i in r["load_info"]) for r in infos)
            rows.append(row)

    print()
    print_table(rows, [("nproc", "ranks"), ("mode", "mode"),
                       ("save_s", "save s", ".3f"), ("save_gbps", "save GB/s", ".3f"), ("save_x_raw", "save/raw", ".2f"),
                       ("load_s", "load s", ".3f"), ("load_gbps", "load GB/s", ".3f"), ("load_x_raw", "load/raw", ".2f"),
                       *([("save_x_s3tc", "save/s3tc", ".2f"), ("load_x_s3tc", "load/s3tc", ".2f")]
                         if "s3tc" in args.modes else [])],
                title=f"throughput: {args.state_mib} MiB state, median of {args.repeats} (x/raw, x/s3tc: time "
                      "relative to raw transfer and to s3torchconnector's DCP writer/reader, same run)")
    print()
    print_table(rows, [("nproc", "ranks"), ("mode", "mode"),
                       ("save_cpu_s_per_gib", "save cCPU s/GiB", ".2f"), ("load_cpu_s_per_gib", "load cCPU s/GiB", ".2f"),
                       ("save_server_cpu_s_per_gib", "save sCPU s/GiB", ".2f"),
                       ("load_server_cpu_s_per_gib", "load sCPU s/GiB", ".2f"),
                       *([("save_cpu_x_s3tc", "save cCPU/s3tc", ".2f"), ("load_cpu_x_s3tc", "load cCPU/s3tc", ".2f")]
                         if "s3tc" in args.modes else []),
                       ("load_peak_rss_mib_max", "load peak RSS MiB", ".0f"),
                       ("load_rss_extra_x_shard_max", "load RSS+ /shard", ".2f"),
                       ("save_rss_extra_x_shard_max", "save RSS+ /shard", ".2f")],
                title="cost: client CPU summed over ranks; server CPU of the local S3 server; RSS+ = peak RSS rise "
                      "over the step, worst rank, relative to its shard")
    phased = [r for r in rows if "save_cpu_write_s_per_gib" in r]
    floor = floor_cpu_s_per_gib()  # in this process, after the ranks have ended
    for row in phased:
        row["save_cpu_x_floor"] = row["save_cpu_s_per_gib"] / floor["save_floor"]  # both per GiB of the state
    if phased:
        print()
        print_table(phased, [("nproc", "ranks"), ("mode", "mode"),
                             *[(f"save_cpu_{p}_s_per_gib", f"save {p}", ".3f") for p in SAVE_ORDER],
                             ("save_cpu_s_per_gib", "save all", ".3f"),
                             *[(f"load_cpu_{p}_s_per_gib", f"load {p}", ".3f") for p in LOAD_ORDER],
                             ("load_cpu_s_per_gib", "load all", ".3f"), ("save_cpu_x_floor", "save/floor", ".1f")],
                    title="client CPU s/GiB by phase, summed over ranks (plan: the plugin's planning calls; "
                          "write/read: write_data/read_data until done; commit: finish; meta: read_metadata; "
                          "dcp: the rest, DCP's own planner and collectives; see benchmarks/phases.py)")
        print(f"# save floor, measured here: {floor['save_floor']:.3f} CPU s/GiB = wire crc32c {floor['crc32c']:.3f} "
              f"+ item crc64nvme {floor['crc64nvme']:.3f} + loopback socket send {floor['send']:.3f} (parts go from "
              f"the tensors' memory; a staging memcpy would add {floor['memcpy']:.3f}); save/floor: the save's CPU "
              "per GiB over it")
    walled = [r for r in rows if "load_wall_read_s" in r and "load_x_raw" in r]
    if walled:
        raw_s = {r["nproc"]: r["load_s"] for r in rows if r["mode"] == "raw"}
        sockets_s = {r["nproc"]: r["load_s"] for r in rows if r["mode"] == "raw-sockets"}
        for row in walled:
            row["load_raw_get_s"] = raw_s[row["nproc"]]
            row["load_gap_s"] = row["load_s"] - row["load_raw_get_s"]
            if row["nproc"] in sockets_s:
                row["load_x_raw_sockets"] = row["load_s"] / sockets_s[row["nproc"]]
        print()
        print_table(walled, [("nproc", "ranks"), ("mode", "mode"),
                             *[(f"load_wall_{p}_s", p, ".3f") for p in LOAD_ORDER],
                             ("load_wall_verify_s", "of read: verify", ".3f"), ("load_s", "load", ".3f"),
                             ("load_raw_get_s", "raw GET", ".3f"), ("load_gap_s", "load - raw", ".3f"),
                             ("load_x_raw", "load/raw", ".2f"),
                             *([("load_x_raw_sockets", "load/raw sockets GET", ".2f")]
                               if "raw-sockets" in args.modes else [])],
                    title="what separates a load from the raw GET of the same bytes: wall s by phase, slowest rank, "
                          "medians (meta: the .metadata GET and decode; plan: planning calls; read: the GETs into "
                          "the tensors, with the item checksums verified as each GET ends ('verify', overlapping "
                          "the GETs still in flight); dcp: DCP's planner and collectives)")
    path = write_json(results_path(args, "throughput"), {
        "benchmark": "throughput",
        "params": {"state_mib": args.state_mib, "nproc": args.nproc, "modes": args.modes, "repeats": args.repeats,
                   "part_mib": cfg.part_size_bytes / MiB, "object_size_target_mib": cfg.object_size_target_bytes / MiB,
                   "checksum": cfg.checksum, "max_concurrency": cfg.max_concurrency, "warmup": not args.no_warmup},
        "target": target.describe(),
        "environment": environment_info(),
        "results": rows,
        "floor_cpu_s_per_gib": floor,
        "raw": {str(k): v for k, v in report.items()},
        "elapsed_s": time.perf_counter() - started,
        "units": {"gbps": "1e9 bytes/s", "cpu_s_per_gib": "CPU seconds per GiB (2^30 bytes)",
                  "x_raw": "median time of the mode / median time of raw transfer"},
    })
    print(f"# results: {path} (total {time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
