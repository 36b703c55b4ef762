"""What S3StorageWriter and S3StorageReader share: where the checkpoint is, how to reach it."""

from __future__ import annotations

import os
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from ..config import S3Config
from ..errors import ConfigError
from ..uri import S3Uri, checkpoint_uri, is_s3_uri, parse_s3_uri
from .client import S3Client
from .sender import refuse_directory_bucket

__all__ = ["S3CheckpointPath", "UnreadableMetadata"]


class S3CheckpointPath:
    """A checkpoint location (``s3://bucket/prefix``), its config, and a lazily made client.

    The path comes from the constructor or from DCP's ``reset(checkpoint_id)``; the client is
    created on first use and is not pickled (each process makes its own).
    """

    _writes = False  # a writer's path may not be a bucket's root (uri.checkpoint_uri); a reader's may

    def _init_path(self, path: str | None, config: S3Config | None, client: S3Client | None) -> None:
        self.config = config or (client.config if client is not None else S3Config())
        self._client = client
        self._uri: S3Uri | None = self._parse(path) if path is not None else None

    def _reset_path(self, checkpoint_id: str | os.PathLike | None) -> None:
        if checkpoint_id is not None:
            self._uri = self._parse(checkpoint_id)

    def _parse(self, path: str | os.PathLike) -> S3Uri:
        """The checkpoint's URI (never a bucket's root for a writer), once it is known that this
        config's transport can reach its bucket."""
        uri = checkpoint_uri(str(path)) if self._writes else parse_s3_uri(str(path))
        if self.config.resolved_transport() == "sockets":
            refuse_directory_bucket(uri.bucket)
        return uri

    @property
    def checkpoint_id(self) -> str | None:
        return str(self._uri) if self._uri is not None else None

    @property
    def client(self) -> S3Client:
        if self._client is None:
            self._client = S3Client(self.config)
        return self._client

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """Whether DCP may hand this checkpoint_id to us: a well-formed ``s3://`` URI."""
        if not is_s3_uri(checkpoint_id):
            return False
        try:
            parse_s3_uri(checkpoint_id)
        except ConfigError:
            return False
        return True

    def _require_uri(self) -> S3Uri:
        if self._uri is None:
            what, call = (("S3StorageWriter", "dcp.save") if "Writer" in type(self).__name__
                          else ("S3StorageReader", "dcp.load"))
            raise ConfigError(f"{what} has no path: pass 's3://bucket/prefix' to it or checkpoint_id= to {call}")
        return self._uri

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_client"] = None
        return state


class UnreadableMetadata(Metadata):
    """What a reader's ``read_metadata`` returns when the metadata cannot be read: any look at
    its contents raises the error. DCP turns an exception raised by ``read_metadata`` into
    ``AssertionError("metadata is None")`` (and, for a signature with ``**kwargs``, retries that
    rank alone without collectives, which hangs the others); raised from
    ``set_up_storage_reader`` instead, it reaches every rank typed, through DCP's collective."""

    def __init__(self, error: BaseException) -> None:  # noqa: D107 - no dataclass fields on purpose
        object.__setattr__(self, "error", error)

    def __getattribute__(self, name: str):
        if name in ("state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version"):
            raise object.__getattribute__(self, "error")
        return object.__getattribute__(self, name)

    def __repr__(self) -> str:
        return f"<unreadable checkpoint metadata: {object.__getattribute__(self, 'error')!r}>"
