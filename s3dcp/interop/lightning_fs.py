"""An fsspec view of s3dcp checkpoints, for the places where Lightning asks a file system about them.

    ModelCheckpoint (file_exists, ls of dirpath) ──► CheckpointFileSystem ──► S3Client: LIST / HEAD / GET
    Trainer(ckpt_path="last") ──fsspec "s3dcp://"──► .exists / .modified of the candidates

Lightning thinks of a checkpoint as a file; s3dcp stores one as a prefix whose ``.metadata``
object commits it. This view shows every *committed* checkpoint prefix as one file (its
``.metadata``'s size and time: ``modified`` is the commit time), other objects as files and
other prefixes as directories; a checkpoint still uploading, or one whose save failed, does not
exist here. Small files (``best_k_models.yaml``) may be written: one PUT on close.

A look costs requests for what is asked about, never for what lies inside a checkpoint: ``ls``
is one listing with a delimiter (the children) and one HEAD of ``.metadata`` per child prefix;
``info`` a listing of the names that start with the path's (with a delimiter) and, for a
prefix, one HEAD of its ``.metadata``.

It is registered with fsspec under the protocol ``s3dcp`` only (never ``s3``, which stays
s3fs's): the file system of an ``s3dcp://bucket/key`` URL. Paths may be given as
``s3://bucket/key``, ``s3dcp://bucket/key`` or ``bucket/key``.
"""

from __future__ import annotations

import datetime
import io
from typing import Any

from fsspec import AbstractFileSystem
from fsspec.registry import register_implementation, registry

from ..config import S3Config
from ..errors import NoSuchKeyError
from ..format.layout import METADATA_NAME
from ..s3.client import S3Client

__all__ = ["CheckpointFileSystem", "PROTOCOL", "register"]

PROTOCOL = "s3dcp"
_default_config: list[S3Config | None] = [None]  # what an fsspec-made instance (no arguments) uses


def register(config: S3Config | None = None) -> None:
    """Make ``s3dcp://`` URLs resolve to :class:`CheckpointFileSystem` in fsspec (idempotent);
    ``config``, when given, is what instances fsspec makes without arguments use."""
    if config is not None:
        _default_config[0] = config
    if registry.get(PROTOCOL) is not CheckpointFileSystem:
        register_implementation(PROTOCOL, CheckpointFileSystem, clobber=True)


class CheckpointFileSystem(AbstractFileSystem):
    """Committed s3dcp checkpoints as files (see the module docstring)."""

    protocol = (PROTOCOL,)
    root_marker = ""
    cachable = False  # the config may change between instances made with the same arguments

    def __init__(self, config: S3Config | None = None, client: S3Client | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.client = client or S3Client(config or _default_config[0] or S3Config())
        self._owns_client = client is None

    def close(self) -> None:
        """Close the S3Client this view made (one passed in stays open). The view may still be
        used: the client takes a native client again."""
        if self._owns_client:
            self.client.close()

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        path = str(path)
        for prefix in ("s3://", f"{PROTOCOL}://"):
            if path.startswith(prefix):
                path = path[len(prefix):]
        return path.rstrip("/")

    def _split(self, path: str) -> tuple[str, str]:
        bucket, _, key = self._strip_protocol(path).partition("/")
        return bucket, key

    # ------------------------------------------------------------------ listing
    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list:
        bucket, key = self._split(path)
        prefix = f"{key}/" if key else ""
        objects, prefixes = self.client.list(bucket, prefix, delimiter="/").result()
        commits = {p: self.client.head(bucket, f"{p}{METADATA_NAME}") for p in prefixes}  # in flight together
        children: dict[str, dict] = {}
        for obj in objects:
            if obj.key != prefix:  # not a "folder" marker object
                children[f"{bucket}/{obj.key}"] = _file(f"{bucket}/{obj.key}", obj)
        for p, head in commits.items():
            full = f"{bucket}/{p.rstrip('/')}"
            metadata = _found(head)
            if metadata is not None:  # a committed checkpoint: shown as one file
                children[full] = _file(full, metadata)
            else:
                children.setdefault(full, {"name": full, "size": 0, "type": "directory"})
        if not children and key and not objects:
            raise FileNotFoundError(path)
        entries = sorted(children.values(), key=lambda e: e["name"])
        return entries if detail else [e["name"] for e in entries]

    def info(self, path: str, **kwargs: Any) -> dict:
        bucket, key = self._split(path)
        if not key:
            return {"name": bucket, "size": 0, "type": "directory"}
        # the object itself and the prefix below it (and siblings whose names start with it)
        objects, prefixes = self.client.list(bucket, key, delimiter="/").result()
        for obj in objects:
            if obj.key == key:
                return _file(f"{bucket}/{key}", obj)
        if f"{key}/" not in prefixes:
            raise FileNotFoundError(path)
        metadata = _found(self.client.head(bucket, f"{key}/{METADATA_NAME}"))
        if metadata is not None:
            return _file(f"{bucket}/{key}", metadata)
        return {"name": f"{bucket}/{key}", "size": 0, "type": "directory"}

    def modified(self, path: str) -> datetime.datetime:
        stamp = self.info(path).get("LastModified")
        if stamp is None:
            raise IsADirectoryError(path)
        return datetime.datetime.fromtimestamp(stamp, tz=datetime.timezone.utc)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        pass  # S3 has no directories

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        pass

    # ------------------------------------------------------------------ small files
    def _open(self, path: str, mode: str = "rb", **kwargs: Any):
        bucket, key = self._split(path)
        if "r" in mode:
            return io.BytesIO(bytes(self.client.get(bucket, key).result()))
        if "w" in mode:
            return _PutOnClose(self.client, bucket, key)
        raise ValueError(f"{type(self).__name__} opens files for 'rb' or 'wb', not {mode!r}")

    def _rm(self, path: str) -> None:
        bucket, key = self._split(path)
        self.client.delete(bucket, [key]).result()


class _PutOnClose(io.BytesIO):
    """A small file written with one PUT when closed."""

    def __init__(self, client: S3Client, bucket: str, key: str) -> None:
        super().__init__()
        self._target = (client, bucket, key)

    def close(self) -> None:
        if not self.closed:
            client, bucket, key = self._target
            client.put(bucket, key, self.getvalue()).result()
        super().close()


def _found(head: Any) -> Any:
    """A HEAD's ObjectInfo, or None when there is no such object."""
    try:
        return head.result()
    except NoSuchKeyError:
        return None


def _file(name: str, obj: Any) -> dict:
    return {"name": name, "size": obj.size, "type": "file", "LastModified": obj.last_modified}
