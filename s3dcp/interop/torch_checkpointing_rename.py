"""``Storage.rename`` on S3: torch-checkpointing's table, row by row, and what each row costs here.

    src                      dst                          here
    ───────────────────────  ───────────────────────────  ─────────────────────────────────────────────
    staging view tmp_<name>  <name> (absent, or empty)    commit: one create-only PUT of
                                                          <name>/.s3dcp-commit, no byte copied
    staging view tmp_<name>  <name>, committed meanwhile  FileExistsError: occupied, never merged
    directory                absent, or empty directory   every object copied server-side (the
                                                          destination hidden by a staging marker
                                                          until the last copy is in), then the
                                                          source deleted: the server's time grows
                                                          with the size, not atomic, logged
    directory                populated directory, file,   FileExistsError (ENOTEMPTY / ENOTDIR)
                             or one staged, uncommitted
    directory                itself, inside it, or around OSError (EINVAL): the copies would land in
                             it (tmp_x/sub onto x/sub:    the source and its delete take both
                             the same keys)
    file                     absent, or a file            server-side copy, then the source deleted
                                                          (a file onto a file replaces it); onto its
                                                          own key (tmp_x/f onto x/f): OSError (EINVAL)
    file                     directory (empty or not,     FileExistsError (EISDIR)
                             staged or not)
    anything                 under an uncommitted         FileNotFoundError: not there under that name
                             checkpoint's final name
    nothing                  anything                     FileNotFoundError

The rules that generate it are torch-checkpointing's (``Storage.rename``): the contents land
*at* the destination, never inside it; an occupied destination raises and is never merged
into or deleted, except a file onto a file. The first row is the one torch-checkpointing's
writer uses (``tmp_<name>`` onto ``<name>`` after every rank has written), and the reason for
staging views (:mod:`~s3dcp.interop.torch_checkpointing_paths`): the checkpoint was written
where it stays, so committing it writes one small object whatever its size. A directory made
from a staged or committed one ends committed; from a plain one, plain.

Owns the table and its rows' flows; states, markers and removal are
:class:`~s3dcp.interop.torch_checkpointing_dirs.Dirs`'s.
"""

from __future__ import annotations

import errno
import logging
from concurrent.futures import Future
from typing import Any

from .torch_checkpointing_dirs import Dirs, State, not_found, occupied, wait
from .torch_checkpointing_paths import COMMIT_MARKER, DIR_MARKER, MARKERS, STAGING_MARKER, PathMap, Where

__all__ = ["rename"]

log = logging.getLogger("s3dcp")


def rename(paths: PathMap, dirs: Dirs, src_path: Any, dst_path: Any, *, background_cleanup: bool) -> None:
    """Rename ``src_path`` onto ``dst_path`` as the module's table says."""
    client = dirs.client
    src_file, src_dir = paths.where(src_path, file=True), paths.where(src_path, file=False)
    dst_file, dst_dir = paths.where(dst_path, file=True), paths.where(dst_path, file=False)
    if src_dir.is_staging_view and dst_dir.staged is None and dst_dir.key == src_dir.staged:
        dirs.require_visible(src_dir)()
        dirs.commit(src_dir, dst_dir)
        return
    src_state = _dir_state(dirs, src_dir)
    if src_state is not State.ABSENT:
        _rename_directory(paths, dirs, src_dir, src_state, dst_file, dst_dir, background_cleanup)
        return
    size = _file_size(dirs, src_file)
    if size is None:
        raise not_found(src_file, "nothing to rename: no such file or directory")
    if src_file.bucket != dst_file.bucket:
        raise OSError(errno.EXDEV, f"rename of {src_file.shown} to {dst_file.shown}: files move within one bucket only")
    if src_file.key == dst_file.key:  # a copy onto itself, then its delete, would lose the file
        raise OSError(errno.EINVAL, f"rename of {src_file.shown} to {dst_file.shown}: both name the object "
                      f"{src_file.url}")
    if _dir_state(dirs, dst_dir, destination=True) not in (State.ABSENT,):
        raise occupied(src_file.shown, dst_dir.shown, "the destination is a directory", errno.EISDIR)
    dirs.require_visible(dst_file)()  # not into an uncommitted checkpoint under its final name
    wait(client.copy(dst_file.bucket, src_file.key, dst_file.key, size))
    wait(client.delete(src_file.bucket, [src_file.key]))


def _dir_state(dirs: Dirs, where: Where, *, destination: bool = False) -> State:
    """A directory's state as the name ``where`` sees it: a staging view is there while its
    directory is STAGED; a directory a guard hides, or a staged one under its own name, is not.
    As a ``destination`` a staged one is occupied all the same (STAGED: a save in progress is
    never merged into nor committed by someone else's rename), and one a guard hides raises
    ``FileNotFoundError`` (its parent is an uncommitted checkpoint's, not there under this name)."""
    if where.is_staging_view:
        return State.STAGED if dirs.marks(where.bucket, [where.staged])() == [State.STAGED] else State.ABSENT
    if not where.key:
        return State.PLAIN
    parents = where.parents()
    visible = dirs.hiding(where.bucket, parents.guards)
    state = dirs.state(where.bucket, where.key)
    hider = visible()
    if destination and hider is not None:
        dirs.require_visible(parents)()  # raises, naming the uncommitted checkpoint
    if hider is not None or (state in (State.STAGED, State.REMOVING) and not destination):
        return State.ABSENT
    return state


def _file_size(dirs: Dirs, where: Where) -> int | None:
    """The size of file ``where`` as that name sees it; None where there is none."""
    if not where.key:
        return None
    visible = dirs.require_visible(where)
    head = dirs.client.head(where.bucket, where.key)
    try:
        visible()
        return wait(head).size
    except FileNotFoundError:
        return None


def _rename_directory(paths: PathMap, dirs: Dirs, src: Where, src_state: State, dst_file: Where, dst: Where,
                      background_cleanup: bool) -> None:
    client = dirs.client
    source_key = src.staged if src.is_staging_view else src.key
    target_key = dst.staged if dst.is_staging_view else dst.key
    if src.bucket == dst.bucket and (target_key == source_key or target_key.startswith(source_key + "/")
                                     or source_key.startswith(target_key + "/")):
        # the copies would land in the source (or the source in them), and its delete take both
        raise OSError(errno.EINVAL, f"rename of {src.shown} to {dst.shown}: s3://{src.bucket}/{target_key} is "
                      f"s3://{src.bucket}/{source_key}, or lies inside it or around it")
    if dst_file.key and _file_size(dirs, dst_file) is not None:
        raise occupied(src.shown, dst.shown, "the destination is a file", errno.ENOTDIR)
    dst_state = _dir_state(dirs, dst, destination=True)
    if dst_state not in (State.ABSENT, State.EMPTY):
        what = {State.STAGED: "a save in progress (staged, not committed)",
                State.REMOVING: "being deleted"}.get(dst_state, "populated")
        raise occupied(src.shown, dst.shown, f"the destination is a {dst_state.value} directory: {what}")
    if src.bucket != dst.bucket:
        raise OSError(errno.EXDEV, f"rename of {src.shown} to {dst.shown}: directories move within one bucket only")
    log.warning("s3dcp: renaming directory %s to %s copies every object server-side (S3 has no rename); "
                "a torch-checkpointing commit (tmp_<name> onto <name>) copies nothing", src.url, dst.url)
    if dst.is_staging_view:
        dirs.stage(dst)
    else:
        wait(client.put(dst.bucket, f"{target_key}/{STAGING_MARKER}", b""))  # hidden until complete
    objects = wait(client.list(src.bucket, f"{source_key}/"))[0]
    copies = [client.copy(dst.bucket, o.key, f"{target_key}/{o.key[len(source_key) + 1:]}", o.size)
              for o in objects if o.key.rpartition("/")[2] not in MARKERS]
    for f in copies:
        wait(f)
    if not dst.is_staging_view:
        if src_state in (State.STAGED, State.COMMITTED):
            wait(client.put(dst.bucket, f"{target_key}/{COMMIT_MARKER}", b"{}", if_none_match=True))
        elif src_state is State.EMPTY:
            wait(client.put(dst.bucket, f"{target_key}/{DIR_MARKER}", b""))
        wait(client.delete(dst.bucket, [f"{target_key}/{STAGING_MARKER}"]))
    removal = dirs.remove(src, src_state)
    if background_cleanup:
        removal.add_done_callback(lambda f: _log_failure(f, src))
    else:
        wait(removal)


def _log_failure(f: Future, src: Where) -> None:
    if f.exception() is not None:
        log.warning("s3dcp: the renamed directory's old objects under %s were not all deleted: %s", src.url,
                    f.exception())

