"""A run's checkpoint directories: the pattern that names them by step (``name_format``), the
scan of every object under the run, grouped by directory (``s3dcp ls`` and the manager), and
what the manager tells of one (:class:`CheckpointInfo`, :func:`list_checkpoints`)."""

from __future__ import annotations

import re
import string
from dataclasses import dataclass

from typing import Callable

from ..errors import ConfigError
from ..format.layout import METADATA_NAME, is_data_object
from ..s3.client import ObjectInfo, S3Client
from ..uri import S3Uri
from .deletion import held_for_references

__all__ = ["scan_directories", "list_checkpoints", "name_pattern", "CheckpointInfo"]


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint directory under the manager's base URI."""

    step: int
    uri: str
    committed: bool  # its .metadata exists
    bytes: int  # total size of the objects directly in the directory
    objects: int
    last_modified: float | None  # newest object, seconds since the epoch


def scan_directories(client: S3Client, base: S3Uri) -> dict[str, list[ObjectInfo]]:
    """Every object under ``base`` (all levels), grouped by the directory holding it
    (``"run/step-1/"``; the keys end with '/')."""
    objects, _ = client.list(base.bucket, base.dir_prefix).result()
    by_dir: dict[str, list[ObjectInfo]] = {}
    for obj in objects:
        directory = obj.key.rpartition("/")[0]
        by_dir.setdefault(f"{directory}/" if directory else "", []).append(obj)
    return by_dir


def list_checkpoints(client: S3Client, base: S3Uri, step_of: Callable[[str], int | None]) -> list[CheckpointInfo]:
    """Every checkpoint directory under ``base`` whose name ``step_of`` gives a step, committed or
    not, sorted by step (:meth:`CheckpointManager.list <s3dcp.CheckpointManager.list>`); a deleted
    checkpoint whose objects are kept only because others reference them is not listed."""
    infos = []
    by_dir = scan_directories(client, base)
    held = held_for_references(client, base.bucket, by_dir)  # deleted, objects kept for others
    for directory, objects in by_dir.items():
        if directory in held:
            continue
        relative = directory[len(base.dir_prefix):].rstrip("/")
        step = step_of(relative)
        if step is None:
            continue
        names = {o.key.rpartition("/")[2] for o in objects}
        if METADATA_NAME not in names and not any(is_data_object(n) for n in names):
            continue
        stamps = [o.last_modified for o in objects if o.last_modified is not None]
        infos.append(CheckpointInfo(
            step=step, uri=str(base.child(relative)), committed=METADATA_NAME in names,
            bytes=sum(o.size for o in objects), objects=len(objects),
            last_modified=max(stamps) if stamps else None))
    return sorted(infos, key=lambda i: i.step)


def name_pattern(name_format: str) -> re.Pattern:
    """The regular expression matching the directory names ``name_format`` gives (the step is group 1);
    ConfigError for a format that is not one ``{step}`` in a relative path."""
    parts, fields = [], 0
    try:
        parsed = list(string.Formatter().parse(name_format))
        name_format.format(step=0)
    except (ValueError, KeyError, IndexError) as e:
        raise ConfigError(f"name_format={name_format!r} is not a valid format string: {e}") from None
    for literal, field, _spec, _conversion in parsed:
        parts.append(re.escape(literal))
        if field is not None:
            if field != "step":
                raise ConfigError(f"name_format={name_format!r} may only use the field {{step}}, not {{{field}}}")
            fields += 1
            parts.append(r"(\d+)")
    if fields != 1:
        raise ConfigError(f"name_format={name_format!r} must contain {{step}} exactly once")
    sample = name_format.format(step=0)
    if sample.startswith("/") or sample.endswith("/") or "//" in sample:
        raise ConfigError(f"name_format={name_format!r} must be a relative path without empty segments")
    return re.compile("".join(parts) + r"\Z")
