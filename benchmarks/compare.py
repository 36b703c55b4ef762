"""What users would otherwise pick: s3torchconnector's DCP writer and reader, on the same server.

    from compare import s3tc_available, s3tc_note, s3tc_save, s3tc_load
    if s3tc_available():
        s3tc_save(state, "s3://bucket/prefix", cfg)          # dcp.save through S3StorageWriter
        s3tc_load(dest, "s3://bucket/prefix", cfg)           # dcp.load through S3StorageReader
    else:
        print(s3tc_note())
    rss_cycle("s3dcp", make_state, 512, cfg, "s3://bucket/prefix")   # peak RSS of save + async_save + load,
    rss_cycle("s3tc", make_state, 512, cfg, "s3://bucket/prefix2")   # each in a fresh process

    python benchmarks/compare.py --state-mib 512                     # that cycle for both, side by side

s3torchconnector (``pip install -e '.[compare]'``) is optional: every function here imports it
lazily, and the benchmarks print :func:`s3tc_note` and skip its rows when it is not installed.
Its DCP classes make their own CRT client (mountpoint-s3-client) from a region and a path and
take the endpoint from ``AWS_ENDPOINT_URL`` and the keys from the ``AWS_*`` environment:
:func:`s3tc_environment` sets those from an ``S3Config`` in this process (never printed). Both
libraries then talk to the same server with the same part size and throughput target, so the
figures differ only by the client library.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

__all__ = ["s3tc_available", "s3tc_note", "s3tc_environment", "s3tc_client_config", "s3tc_writer",
           "s3tc_reader", "s3tc_save", "s3tc_load", "s3tc_async_save", "rss_cycle", "KINDS"]

KINDS = ("s3dcp", "s3tc")


def s3tc_available() -> bool:
    """Whether s3torchconnector's DCP classes can be imported."""
    return importlib.util.find_spec("s3torchconnector") is not None


def s3tc_note() -> str:
    return ("s3torchconnector is not installed: its rows are skipped "
            "(pip install -e '.[compare]' to compare against its DCP S3StorageWriter/S3StorageReader)")


def s3tc_environment(cfg) -> None:
    """Point s3torchconnector's client at ``cfg``'s endpoint and credentials (it reads them only
    from the environment). Call before the first writer or reader of the process."""
    os.environ["AWS_ENDPOINT_URL"] = cfg.endpoint_url
    os.environ["AWS_REGION"] = os.environ["AWS_DEFAULT_REGION"] = cfg.region
    if cfg.access_key_id:
        os.environ["AWS_ACCESS_KEY_ID"] = cfg.access_key_id
        os.environ["AWS_SECRET_ACCESS_KEY"] = cfg.secret_access_key
        if cfg.session_token:
            os.environ["AWS_SESSION_TOKEN"] = cfg.session_token


def s3tc_client_config(cfg):
    """s3torchconnector's ``S3ClientConfig`` matching ``cfg``: same part size for uploads and
    downloads (it has one knob for both; we use s3dcp's upload part size), same throughput
    target, path-style addressing for a local server."""
    from s3torchconnector import S3ClientConfig

    return S3ClientConfig(throughput_target_gbps=float(cfg.throughput_target_gbps),
                          part_size=cfg.part_size_bytes, force_path_style=cfg.use_path_style)


def s3tc_writer(uri: str, cfg, *, thread_count: int = 1):
    """s3torchconnector's DCP ``S3StorageWriter`` for ``uri`` (``thread_count``: its writer
    threads per rank; 1 is its default)."""
    from s3torchconnector.dcp import S3StorageWriter

    s3tc_environment(cfg)
    return S3StorageWriter(region=cfg.region, path=uri, s3client_config=s3tc_client_config(cfg),
                           thread_count=thread_count)


def s3tc_reader(uri: str, cfg):
    """s3torchconnector's DCP ``S3StorageReader`` for ``uri`` (its default reader: the
    DCP-optimised ranged reader)."""
    from s3torchconnector.dcp import S3StorageReader

    s3tc_environment(cfg)
    return S3StorageReader(region=cfg.region, path=uri, s3client_config=s3tc_client_config(cfg))


def s3tc_save(state: dict, uri: str, cfg, *, thread_count: int = 1) -> None:
    """``dcp.save`` of ``state`` through s3torchconnector."""
    import torch.distributed.checkpoint as dcp

    dcp.save(state, storage_writer=s3tc_writer(uri, cfg, thread_count=thread_count))


def s3tc_async_save(state: dict, uri: str, cfg, *, thread_count: int = 1):
    """``dcp.async_save`` of ``state`` through s3torchconnector; returns DCP's future (or
    response object, depending on the torch version)."""
    import torch.distributed.checkpoint as dcp

    return dcp.async_save(state, storage_writer=s3tc_writer(uri, cfg, thread_count=thread_count))


def s3tc_load(dest: dict, uri: str, cfg) -> None:
    """``dcp.load`` into ``dest`` (in place) through s3torchconnector."""
    import torch.distributed.checkpoint as dcp

    dcp.load(dest, storage_reader=s3tc_reader(uri, cfg))


def _wait(result) -> None:
    """Wait for what ``dcp.async_save`` returned (a Future, or a response with one)."""
    future = getattr(result, "upload_completion", result)
    future.result()


def rss_cycle(kind: str, make_state, state_mib: int, cfg, uri_base: str) -> dict:
    """In a fresh process (spawned, so nothing of this one counts): build ``make_state(state_mib)``,
    ``dcp.save`` it, ``dcp.async_save`` it, ``dcp.load`` the first save into a zeroed copy (checked
    equal), through ``kind`` (``"s3dcp"`` or ``"s3tc"``). Returns that process's peak RSS
    (``ru_maxrss``: at the end, and after the save and after the async save, which tells which
    step set it) and the RSS of the state alone, in MiB, and the step times in seconds.
    ``make_state`` must be importable in the child (a module-level function)."""
    import multiprocessing

    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}: expected one of {KINDS}")
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_rss_cycle_child, (kind, make_state, state_mib, cfg, uri_base))


def _rss_cycle_child(kind: str, make_state, state_mib: int, cfg, uri_base: str) -> dict:
    import resource

    import psutil
    import torch
    import torch.distributed.checkpoint as dcp

    def leaves(tree):
        if isinstance(tree, dict):
            for v in tree.values():
                yield from leaves(v)
        else:
            yield tree

    def zeros_like(tree):
        if isinstance(tree, dict):
            return {k: zeros_like(v) for k, v in tree.items()}
        return torch.zeros_like(tree) if isinstance(tree, torch.Tensor) else tree

    if kind == "s3dcp":
        from s3dcp import S3StorageReader, S3StorageWriter

        def writer(uri):
            return S3StorageWriter(uri, config=cfg)

        def reader(uri):
            return S3StorageReader(uri, config=cfg)
    else:
        def writer(uri):
            return s3tc_writer(uri, cfg)

        def reader(uri):
            return s3tc_reader(uri, cfg)

    state = make_state(state_mib)
    state_rss = psutil.Process().memory_info().rss
    out: dict = {"kind": kind}
    t = time.perf_counter()
    dcp.save(state, storage_writer=writer(f"{uri_base}/sync"))
    out["save_s"] = time.perf_counter() - t
    out["peak_after_save_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t = time.perf_counter()
    pending = dcp.async_save(state, storage_writer=writer(f"{uri_base}/async"))
    out["async_stall_s"] = time.perf_counter() - t
    _wait(pending)
    out["async_total_s"] = time.perf_counter() - t
    out["peak_after_async_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    dest = zeros_like(state)
    t = time.perf_counter()
    dcp.load(dest, storage_reader=reader(f"{uri_base}/sync"))
    out["load_s"] = time.perf_counter() - t
    for a, b in zip(leaves(state), leaves(dest)):
        if isinstance(a, torch.Tensor) and not torch.equal(a, b):
            raise RuntimeError(f"{kind}: the loaded state differs from the saved one")
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out["state_rss_mib"] = state_rss / (1 << 20)
    return out


def _default_state(state_mib: int) -> dict:
    """Weights, Adam moments and small tensors (the state benchmarks/stall.py uses)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    per = state_mib * (1 << 20) // 3 // 4
    state: dict = {"model": {}, "optim": {"state": {}}}
    i = 0
    while per > 0:
        n = min(per, 4 * (1 << 20))
        state["model"][f"layer{i}.weight"] = torch.randn(n, generator=gen)
        state["model"][f"layer{i}.bias"] = torch.randn(256, generator=gen).to(torch.bfloat16)
        state["optim"]["state"][f"{i}"] = {"exp_avg": torch.randn(n, generator=gen),
                                           "exp_avg_sq": torch.rand(n, generator=gen)}
        per -= n
        i += 1
    return state


def main(argv=None) -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import add_common_args, print_table, s3_target, unique_prefix  # noqa: E402

    parser = argparse.ArgumentParser(description="Peak RSS and step times of one process that saves, "
                                     "async-saves and loads a state: s3dcp vs s3torchconnector, side by side.")
    parser.add_argument("--state-mib", type=int, default=512)
    add_common_args(parser, repeats=1)
    args = parser.parse_args(argv)
    kinds = [k for k in KINDS if k != "s3tc" or s3tc_available()]
    if "s3tc" not in kinds:
        print(f"# {s3tc_note()}")
    rows = []
    with s3_target(args) as target:
        for r in range(args.repeats):
            for kind in kinds:
                row = rss_cycle(kind, _default_state, args.state_mib, target.config,
                                target.uri(unique_prefix(target, "rss", kind)))
                print(f"  rep {r}: {kind:6s} peak RSS {row['peak_rss_mib']:.0f} MiB (state {row['state_rss_mib']:.0f} "
                      f"MiB), save {row['save_s']:.2f} s, async stall {row['async_stall_s']:.2f} s, "
                      f"load {row['load_s']:.2f} s", flush=True)
                rows.append(row)
    from common import median

    summary = []
    for kind in kinds:
        mine = [r for r in rows if r["kind"] == kind]
        summary.append({"kind": kind, **{k: median(r[k] for r in mine) for k in mine[0] if k != "kind"}})
    if len(summary) == 2:
        summary.append({"kind": "s3dcp/s3tc", **{k: summary[0][k] / summary[1][k] for k in summary[0]
                                                  if k != "kind" and summary[1][k]}})
    print()
    print_table(summary, [("kind", "client"), ("peak_rss_mib", "peak RSS MiB", ".2f"),
                          ("peak_after_save_mib", "peak after save", ".2f"),
                          ("peak_after_async_mib", "peak after async", ".2f"),
                          ("state_rss_mib", "state RSS MiB", ".2f"), ("save_s", "save s", ".2f"),
                          ("async_stall_s", "async stall s", ".3f"), ("load_s", "load s", ".2f")],
                title=f"one process: save + async_save + load of a {args.state_mib} MiB state, median of "
                      f"{args.repeats} (last row: ratio)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
