"""A directory's state on S3, read from its markers, and the changes torch-checkpointing asks for.

    state        markers under the directory            seen as             becomes
    ─────────    ───────────────────────────────────    ────────────────    ─────────────────────────────
    ABSENT       (no object)                            nothing             EMPTY (mkdir), STAGED (mkdir of
                                                                            its staging view, or a write in it)
    EMPTY        .s3dcp-dir only                        an empty dir        STAGED, PLAIN, REMOVING (rmdir)
    PLAIN        objects, no staging marker             a dir               REMOVING (rmdir)
    STAGED       .s3dcp-staging, no .s3dcp-commit       tmp_<name> only     COMMITTED (rename onto <name>),
                                                                            REMOVING (rmdir)
    COMMITTED    .s3dcp-commit                          <name>              REMOVING (rmdir)
    REMOVING     .s3dcp-removing (whatever else)        nothing             ABSENT (its removal ends; an
                                                                            interrupted one: rmdir again)

Rules that make the table, and why: a directory written through its staging view hides
under its final name until the commit marker exists, so a reader never takes a partial
checkpoint for a complete one; the commit marker is written create-only (``If-None-Match: *``,
s3dcp's commit, :mod:`s3dcp.s3.compat`), so a committed directory is never committed over,
and staging refuses a COMMITTED or PLAIN directory, so no save writes into one (a PLAIN
directory holds objects nobody staged: taking them into a checkpoint would publish them).
Removal has its own marker, written first and deleted last: a directory being deleted is
never a visible, partial one, and staging refuses it, so a new save of the name can neither
join it (and lose its files to the removal's deletes) nor be committed missing them. A
directory's *parents* (``Where.guards``) hide it the same way: a file of an uncommitted
checkpoint does not exist under its final name.

Owns those states and transitions, and the translation of s3dcp's errors into the contract's
(``FileNotFoundError``, ``FileExistsError``, ``OSError``; s3dcp's error kept as ``__cause__``
and its message kept). The mapping of names is :mod:`~s3dcp.interop.torch_checkpointing_paths`'s.
"""

from __future__ import annotations

import enum
import errno
import json
import logging
import time
from concurrent.futures import Future
from typing import Callable, Iterable

from ..errors import NoSuchKeyError, PreconditionFailedError, S3DCPError
from ..s3.client import S3Client
from .torch_checkpointing_paths import COMMIT_MARKER, DIR_MARKER, MARKERS, REMOVING_MARKER, STAGING_MARKER, Where

__all__ = ["State", "Dirs", "DirectoryNotFoundError", "as_os_error", "wait"]

log = logging.getLogger("s3dcp")


class State(enum.Enum):
    ABSENT = "absent"
    EMPTY = "empty"
    PLAIN = "plain"
    STAGED = "staged"
    COMMITTED = "committed"
    REMOVING = "removing"


def as_os_error(error: BaseException) -> BaseException:
    """The contract's form of ``error``: an ``OSError`` as it is (s3dcp's ``NoSuchKeyError`` is
    a ``FileNotFoundError``, ``PreconditionFailedError`` a ``FileExistsError``), any other
    s3dcp error an ``OSError(EIO)`` with its message and it as the cause; others unchanged."""
    if isinstance(error, OSError) or not isinstance(error, S3DCPError):
        return error
    translated = OSError(errno.EIO, str(error))
    translated.__cause__ = error
    return translated


def wait(future: Future, timeout_s: float | None = None):
    """``future``'s value; its error in the contract's form (:func:`as_os_error`)."""
    try:
        return future.result(timeout_s)
    except S3DCPError as e:
        raise as_os_error(e) from e


def occupied(src: str, dst: str, why: str, error_number: int = errno.ENOTEMPTY) -> FileExistsError:
    """The error for a destination a rename or a staging may not take."""
    return FileExistsError(error_number, f"refusing to put {src} onto {dst}: {why}. A commit goes onto "
                           "unoccupied space and never replaces a checkpoint; delete it (rmdir) if it is "
                           "meant to be replaced, or save under another name")


def not_found(where: Where, why: str) -> FileNotFoundError:
    return FileNotFoundError(errno.ENOENT, f"{where.shown} ({where.url}): {why}")


class DirectoryNotFoundError(FileNotFoundError, RuntimeError):
    """A write into a directory nobody made: ``FileNotFoundError`` as on a file system, and the
    ``RuntimeError`` torch-checkpointing's local backend raises there, so callers of either match."""


class Dirs:
    """Directory states and transitions through one :class:`S3Client` (see the module docstring)."""

    def __init__(self, client: S3Client) -> None:
        self.client = client

    # ------------------------------------------------------------------ reading states
    def has(self, bucket: str, key: str) -> "Future[bool]":
        """Whether object ``key`` exists (a HEAD; missing is False, other failures raise)."""
        outer: Future = Future()

        def done(f: Future) -> None:
            error = f.exception()
            if error is None:
                outer.set_result(True)
            elif isinstance(error, NoSuchKeyError):
                outer.set_result(False)
            else:
                outer.set_exception(error)

        self.client.head(bucket, key).add_done_callback(done)
        return outer

    def first_objects(self, bucket: str, prefix: str, count: int = 5) -> Future:
        """The first ``count`` objects under ``prefix`` (one request): with 4 marker names, 5
        objects tell an empty directory from one holding anything else."""
        return self.client.list(bucket, prefix, page_size=count, first_page_only=True)

    def state(self, bucket: str, key: str) -> State:
        """The state of directory ``key`` (four requests in parallel)."""
        removing = self.has(bucket, f"{key}/{REMOVING_MARKER}")
        staging = self.has(bucket, f"{key}/{STAGING_MARKER}")
        commit = self.has(bucket, f"{key}/{COMMIT_MARKER}")
        prefix = f"{key}/" if key else ""
        objects = self.first_objects(bucket, prefix)
        names = {o.key[len(prefix):] for o in wait(objects)[0]}  # a marker counts only directly in it
        if wait(removing):
            return State.REMOVING
        if wait(commit):
            return State.COMMITTED
        if wait(staging):
            return State.STAGED
        if names - MARKERS:
            return State.PLAIN
        return State.EMPTY if DIR_MARKER in names else State.ABSENT

    def marks(self, bucket: str, dirs: Iterable[str]) -> "Callable[[], list[State | None]]":
        """Start asking, for each of ``dirs``, whether it hides what lies under it: REMOVING
        (being deleted), STAGED (staged and uncommitted), or None. The returned call waits for
        the answers. A HEAD of each staging and removal marker, and of the commit marker where
        a staging marker is there."""
        dirs = list(dirs)
        removing = [self.has(bucket, f"{d}/{REMOVING_MARKER}") for d in dirs]
        staging = [self.has(bucket, f"{d}/{STAGING_MARKER}") for d in dirs]

        def answer() -> "list[State | None]":
            staged = [wait(f) for f in staging]
            commits = [self.has(bucket, f"{d}/{COMMIT_MARKER}") if s else None for d, s in zip(dirs, staged)]
            gone = [wait(f) for f in removing]
            return [State.REMOVING if g else State.STAGED if c is not None and not wait(c) else None
                    for g, c in zip(gone, commits)]

        return answer

    def hiding(self, bucket: str, dirs: Iterable[str]) -> "Callable[[], str | None]":
        """Start asking which of ``dirs`` hides what lies under it (:meth:`marks`); the returned
        call waits for the answer: the first such directory, or None."""
        dirs = list(dirs)
        marks = self.marks(bucket, dirs)
        return lambda: next((d for d, m in zip(dirs, marks()) if m is not None), None)

    def require_visible(self, where: Where) -> "Callable[[], None]":
        """Start the checks that ``where`` may be seen under the name it was given: its staging
        view's directory is STAGED, no guard hides it. The returned call waits and raises
        ``FileNotFoundError`` (naming why) if not."""
        hidden = self.marks(where.bucket, where.guards)
        view = self.marks(where.bucket, [where.staged]) if where.staged is not None else None

        def check() -> None:
            if view is not None and view() != [State.STAGED]:
                raise not_found(where, f"no staging directory here: {where.staged!r} is not a save in progress "
                                       "(committed already, removed, or never made)")
            hider = next(((d, m) for d, m in zip(where.guards, hidden()) if m is not None), None)
            if hider is not None and hider[1] is State.REMOVING:
                raise not_found(where, f"s3://{where.bucket}/{hider[0]} is being deleted ({REMOVING_MARKER})")
            if hider is not None:
                raise not_found(where, f"s3://{where.bucket}/{hider[0]} is a checkpoint whose save has not committed "
                                       f"(no {COMMIT_MARKER}); nothing in it can be read until it is")

        return check

    # ------------------------------------------------------------------ changes
    def make(self, where: Where) -> None:
        """mkdir of a plain directory: its marker, unless something is there already."""
        if where.key and not wait(self.first_objects(where.bucket, where.prefix, 1))[0]:
            wait(self.client.put(where.bucket, f"{where.key}/{DIR_MARKER}", b""))

    def stage(self, where: Where) -> None:
        """The staging view ``where`` (``.../tmp_<name>``) exists once this returns: its
        directory is STAGED (made so from ABSENT or EMPTY, or already); a COMMITTED or PLAIN
        one raises ``FileExistsError`` before anything is written."""
        key = where.staged
        state = self.state(where.bucket, key)
        if state is State.COMMITTED:
            raise occupied(where.shown, f"s3://{where.bucket}/{key}", "it holds a committed checkpoint")
        if state is State.REMOVING:
            raise occupied(where.shown, f"s3://{where.bucket}/{key}", f"it is being deleted ({REMOVING_MARKER}); "
                           "save once its deletion has ended (an interrupted deletion ends with another rmdir "
                           "of it)", errno.EBUSY)
        if state is State.PLAIN and wait(self.has(where.bucket, f"{key}/{STAGING_MARKER}")):
            state = State.STAGED  # another rank staged it and wrote between this one's HEAD and LIST
        if state is State.PLAIN:
            raise occupied(where.shown, f"s3://{where.bucket}/{key}", "it holds objects that were not written as "
                           "a staged checkpoint")
        if state is not State.STAGED:
            wait(self.client.put(where.bucket, f"{key}/{STAGING_MARKER}", b""))

    def commit(self, src: Where, dst: Where) -> None:
        """rename(``<parent>/tmp_<name>`` → ``<parent>/<name>``): one create-only PUT of the
        commit marker, no byte of the checkpoint copied. Then the staging (and an empty
        directory's) marker go; a failure there leaves a committed directory all the same."""
        bucket, key = dst.bucket, dst.key
        if not wait(self.has(bucket, f"{key}/{STAGING_MARKER}")):
            raise not_found(src, "no staging directory to commit (never made, removed, or committed already)")
        body = json.dumps({"committed_by": "s3dcp torch-checkpointing storage", "from": src.shown,
                           "unix_time_s": time.time()}).encode()
        try:
            wait(self.client.put(bucket, f"{key}/{COMMIT_MARKER}", body, if_none_match=True))
        except PreconditionFailedError as e:  # another save of this name committed first
            raise occupied(src.shown, dst.url, "it was committed already") from e
        try:
            wait(self.client.delete(bucket, [f"{key}/{STAGING_MARKER}", f"{key}/{DIR_MARKER}"]))
        except OSError:  # committed: the markers left are harmless (the commit marker wins)
            log.warning("s3dcp: committed %s but could not remove its staging marker", dst.url, exc_info=True)

    def remove(self, where: Where, state: State) -> Future:
        """Delete directory ``where`` in ``state`` (not ABSENT): its removal marker first
        (hidden, and never staged, from here on), the commit marker, every other object, the
        removal marker last. Resolves when all are gone."""
        bucket, key = where.bucket, where.staged if where.is_staging_view else where.key
        removing = f"{key}/{REMOVING_MARKER}"
        client = self.client

        def everything(_=None) -> Future:
            return _then(client.list(bucket, f"{key}/"), lambda found: client.delete(
                bucket, [o.key for o in found[0] if o.key != removing]))

        start = _then(client.put(bucket, removing, b""), lambda _: client.delete(bucket, [f"{key}/{COMMIT_MARKER}"]))
        return _then(_then(start, everything), lambda _: client.delete(bucket, [removing]))


def _then(first: Future, step: Callable[[object], Future]) -> Future:
    """The future of ``step(first's value)``; an error of either lands on it. ``step`` runs
    where ``first`` ends (a CRT callback: it only starts requests)."""
    outer: Future = Future()

    def passed(f: Future) -> None:
        error = f.exception()
        if error is not None:
            outer.set_exception(error)
        else:
            outer.set_result(f.result())

    def started(f: Future) -> None:
        error = f.exception()
        if error is not None:
            outer.set_exception(error)
            return
        try:
            step(f.result()).add_done_callback(passed)
        except BaseException as e:  # noqa: BLE001 - reaches the caller through the future
            outer.set_exception(e)

    first.add_done_callback(started)
    return outer
