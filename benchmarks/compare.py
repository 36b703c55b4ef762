"""What users would otherwise pick: s3torchconnector's DCP writer and reader, on the same server.

    from compare import s3tc_available, s3tc_note, s3tc_save, s3tc_load
    if s3tc_available():
        s3tc_save(state, "s3://bucket/prefix", cfg)          # dcp.save through S3StorageWriter
        s3tc_load(dest, "s3://bucket/prefix", cfg)           # dcp.load through S3StorageReader
    else:
        print(s3tc_note())

s3torchconnector (``pip install -e '.[compare]'``) is optional: every function here imports it
lazily, and the benchmarks print :func:`s3tc_note` and skip its rows when it is not installed.
Its DCP classes make their own CRT client (mountpoint-s3-client) from a region and a path and
take the endpoint from ``AWS_ENDPOINT_URL`` and the keys from the ``AWS_*`` environment:
:func:`s3tc_environment` sets those from an ``S3Config`` in this process (never printed). Both
libraries then talk to the same server with the same part size and throughput target, so the
figures differ only by the client library.
"""

from __future__ import annotations

import importlib.util
import os

__all__ = ["s3tc_available", "s3tc_note", "s3tc_environment", "s3tc_client_config", "s3tc_writer",
           "s3tc_reader", "s3tc_save", "s3tc_load", "s3tc_async_save"]


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
