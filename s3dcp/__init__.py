"""s3dcp: PyTorch Distributed Checkpoint (DCP) storage for S3-compatible object stores.

    import torch.distributed.checkpoint as dcp
    from s3dcp import S3StorageWriter, S3StorageReader

    dcp.save(state_dict, storage_writer=S3StorageWriter("s3://bucket/run/step-1000"))
    dcp.async_save(state_dict, storage_writer=S3StorageWriter("s3://bucket/run/step-2000"))
    dcp.load(state_dict, storage_reader=S3StorageReader("s3://bucket/run/step-1000"))
"""

from .config import S3Config
from .errors import *  # noqa: F401,F403
from .errors import __all__ as _error_names
from .gc import GcReport, gc
from .reader import S3StorageReader
from .staging import HostBufferPool, release_staging_memory
from .writer import S3StorageWriter

__version__ = "0.1.0"
__all__ = [
    "S3StorageWriter",
    "S3StorageReader",
    "S3Config",
    "HostBufferPool",
    "gc",
    "GcReport",
    "release_staging_memory",
    "__version__",
    *_error_names,
]
