"""s3dcp: PyTorch Distributed Checkpoint (DCP) storage for S3-compatible object stores.

    import s3dcp

    s3dcp.save(state_dict, "s3://bucket/run/step-1000")          # errors: catchable (except Exception)
    future = s3dcp.async_save(state_dict, "s3://bucket/run/step-2000")
    s3dcp.load(state_dict, "s3://bucket/run/step-1000")

or, with DCP's own calls:

    import torch.distributed.checkpoint as dcp
    from s3dcp import S3StorageWriter, S3StorageReader

    dcp.save(state_dict, storage_writer=S3StorageWriter("s3://bucket/run/step-1000"))
    dcp.async_save(state_dict, storage_writer=S3StorageWriter("s3://bucket/run/step-2000"))
    dcp.load(state_dict, storage_reader=S3StorageReader("s3://bucket/run/step-1000"))

Names are imported on first use, so ``python -m s3dcp.testing`` or the CLI's light commands
do not pay for importing torch and awscrt.
"""

from importlib import import_module

from ._version import __version__
from .config import S3Config
from .errors import *  # noqa: F401,F403
from .errors import __all__ as _error_names

_LAZY = {
    "save": ".api",
    "async_save": ".api",
    "load": ".api",
    "last_save_stats": ".api",
    "last_load_stats": ".api",
    "LoadStats": ".loading.exchange",
    "S3StorageWriter": ".saving.writer",
    "S3StorageReader": ".loading.reader",
    "HostBufferPool": ".saving.staging",
    "release_staging_memory": ".saving.staging",
    "gc": ".lifecycle.gc",
    "GcReport": ".lifecycle.gc",
    "CheckpointManager": ".lifecycle.manager",
    "CheckpointInfo": ".lifecycle.manager",
    "S3SafetensorsReader": ".interop.safetensors_reader",
}


def close(wait_s: float = 0.0) -> None:
    """Release what s3dcp holds process-wide: native CRT clients (idle ones at once, busy ones
    when their last request ends) and idle staging memory. Safe to call any time; anything used
    afterwards is made again on demand. With ``wait_s``, wait up to that long for the CRT's
    threads and sockets to be gone (e.g. before forking workers)."""
    from .s3.native import close_native_clients
    from .saving.staging import release_staging_memory

    close_native_clients(wait_s=wait_s)
    release_staging_memory()


__all__ = ["S3Config", "__version__", "close", *_LAZY, *_error_names]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 's3dcp' has no attribute {name!r}")
    value = getattr(import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(__all__)
