"""Where a torch-checkpointing path lives in S3, and which staging view it names. Pure: no I/O.

    Path("s3://b/run/tmp_step_5/model_0.pt") ──► Where(bucket "b", key "run/step_5/model_0.pt",
                                                      staged "run/step_5", guards ("run",))
    Path("step_5/model_0.pt"), root s3://b/run ──► Where(bucket "b", key "run/step_5/model_0.pt",
                                                      staged None, guards ("run/step_5",))

torch-checkpointing commits a save by renaming ``<parent>/tmp_<name>`` onto ``<parent>/<name>``
(``CheckpointWriterConfig.temp_dir_prefix``, ``"tmp_"``). S3 has no rename, so a directory
named with the staging prefix is not a prefix of its own: it is the *staging view* of the
directory without it, whose objects are written where they will stay (``run/step_5/...``)
and which stays hidden until its commit marker exists (the directory states and their markers
are :mod:`s3dcp.interop.torch_checkpointing_dirs`'s). Only names below the configured root are
read so (the root itself is taken as written), and at most one directory of a path may carry
the prefix: ``tmp_a/tmp_b`` has no meaning and is refused.

Owns the mapping from a path (``pathlib.Path`` folds ``s3://`` to ``s3:/``; both are
accepted, as are paths relative to the root and absolute local-looking paths, placed under it),
the reserved marker names, and the names a listing shows. Raises :class:`ConfigError` (a
``ValueError``) for a path it cannot place.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from ..errors import ConfigError
from ..uri import parse_s3_uri

__all__ = ["Where", "PathMap", "DIR_MARKER", "STAGING_MARKER", "COMMIT_MARKER", "REMOVING_MARKER", "MARKERS"]

DIR_MARKER = ".s3dcp-dir"  # a directory made by mkdir (S3 has no empty directories otherwise)
STAGING_MARKER = ".s3dcp-staging"  # a directory written through its staging view, not committed
COMMIT_MARKER = ".s3dcp-commit"  # written create-only, last: the directory is committed
REMOVING_MARKER = ".s3dcp-removing"  # written first and deleted last by a removal: hidden, never staged
MARKERS = frozenset({DIR_MARKER, STAGING_MARKER, COMMIT_MARKER, REMOVING_MARKER})


@dataclass(frozen=True)
class Where:
    """One path placed in S3. ``key`` is where its bytes are ("" is the bucket itself);
    ``staged``, the directory whose staging view the path is in (or is: ``key == staged``);
    ``guards``, the other directories (parents, and the path itself where it may be a
    directory) whose uncommitted staging would hide it; ``shown``, the path as it was named."""

    bucket: str
    key: str
    staged: str | None
    guards: tuple[str, ...]
    shown: str

    @property
    def url(self) -> str:
        """Where the bytes are, as an ``s3://`` URL (a staging view's is its directory's)."""
        return f"s3://{self.bucket}/{self.key}"

    @property
    def prefix(self) -> str:
        """The listing prefix of what lies under this path."""
        return f"{self.key}/" if self.key else ""

    @property
    def is_staging_view(self) -> bool:
        """Whether the path names a staging directory itself (``.../tmp_step_5``)."""
        return self.staged is not None and self.staged == self.key

    def parents(self) -> "Where":
        """This path with only its parents as guards (for what acts on the directory itself)."""
        return replace(self, guards=tuple(g for g in self.guards if g != self.key))


class PathMap:
    """Places paths: ``root`` (``s3://bucket/prefix`` or None) takes every path that is not an
    ``s3://`` URL; ``staging_prefix`` must equal the writer's ``temp_dir_prefix``."""

    def __init__(self, root: str | None, staging_prefix: str) -> None:
        if not staging_prefix or "/" in staging_prefix:
            raise ConfigError(f"staging_prefix={staging_prefix!r}: give the writer's temp_dir_prefix, a non-empty "
                              "name start without '/' (torch-checkpointing's default is 'tmp_')")
        self.root = parse_s3_uri(root.rstrip("/")) if root is not None else None
        self.staging_prefix = staging_prefix

    def where(self, path: str | os.PathLike, *, file: bool) -> Where:
        """Place ``path``. ``file=True``: its last name is a file's, never a staging view (a file
        may be called ``tmp_x.pt``); ``file=False``: it may name a directory."""
        shown = os.fspath(path)
        bucket, parts, literal = self._split(shown)
        staged_at = None
        last_dir = len(parts) - 1 if file else len(parts)
        for i in range(literal, last_dir):
            if parts[i].startswith(self.staging_prefix) and len(parts[i]) > len(self.staging_prefix):
                if staged_at is not None:
                    raise ConfigError(
                        f"{shown}: two directories carry the staging prefix {self.staging_prefix!r} "
                        f"({parts[staged_at]!r}, {parts[i]!r}); names starting with it are reserved for "
                        "torch-checkpointing's staging directories (rename the directory, or set "
                        "S3StorageConfig.staging_prefix and CheckpointWriterConfig.temp_dir_prefix to another prefix)")
                staged_at = i
        if staged_at is not None:
            parts = [*parts[:staged_at], parts[staged_at][len(self.staging_prefix):], *parts[staged_at + 1:]]
        if parts and parts[-1] in MARKERS:
            raise ConfigError(f"{shown}: {parts[-1]!r} is a name s3dcp keeps for its own markers")
        key = "/".join(parts)
        staged = "/".join(parts[:staged_at + 1]) if staged_at is not None else None
        dirs = [("/".join(parts[:i + 1])) for i in range(max(literal, 0), len(parts) - (1 if file else 0))]
        guards = tuple(d for d in dirs if d != staged)
        return Where(bucket=bucket, key=key, staged=staged, guards=guards, shown=shown)

    def listed_name(self, child: str, *, staged: bool) -> str:
        """The name a listing shows for a child directory: its staging view's while it is
        staged and uncommitted."""
        return self.staging_prefix + child if staged else child

    def child(self, where: Where, name: str, *, file: bool) -> Where:
        """``where``'s child ``name`` (as a listing shows it)."""
        return self.where(f"{where.shown.rstrip('/')}/{name}", file=file)

    # ------------------------------------------------------------------ internals
    def _split(self, shown: str) -> tuple[str, list[str], int]:
        """Bucket, key parts, and how many leading parts are the root's (taken as written)."""
        if shown.startswith("s3:/"):
            uri = parse_s3_uri("s3://" + shown[len("s3:/"):].lstrip("/"))
        elif self.root is None:
            raise ConfigError(f"{shown!r} is not an s3:// path and S3StorageConfig has no root to place it under "
                              "(give root='s3://bucket/prefix', or checkpoint paths as s3://bucket/...)")
        else:
            rest = shown.strip("/")
            uri = parse_s3_uri(f"{self.root}/{rest}" if rest else str(self.root))
        parts = uri.prefix.split("/") if uri.prefix else []
        return uri.bucket, parts, self._literal_depth(uri.bucket, uri.prefix)

    def _literal_depth(self, bucket: str, key: str) -> int:
        """How many leading names of ``key`` are the root's, where ``key`` is under the root."""
        root = self.root
        if root is None or bucket != root.bucket or not root.prefix:
            return 0
        if key == root.prefix or key.startswith(root.prefix + "/"):
            return len(root.prefix.split("/"))
        return 0
