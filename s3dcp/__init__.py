"""s3dcp: PyTorch Distributed Checkpoint (DCP) storage for S3-compatible object stores."""

from .config import S3Config
from .errors import *  # noqa: F401,F403
from .errors import __all__ as _error_names

__version__ = "0.1.0"
__all__ = ["S3Config", "__version__", *_error_names]
