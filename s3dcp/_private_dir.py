"""A directory only its user may write: made 0700, or refused while someone else could change it.

What s3dcp keeps on the local disk for itself (the local server's data, the state files that
``s3dcp server --print-env`` reads and prints as shell commands, a CheckpointManager's
``local_dir``, whose copies a restore loads) is trusted when it is read back, so nobody else may
have been able to write it. :func:`private_dir`:

    missing                        made, 0700 (its parents with the usual permissions)
    a directory of this user       refused while its group or others may write it (they could plant
                                   or replace what is in it); ``tighten=True`` also takes away what
                                   they may read (0700), for a directory that holds data
    another user's, or a link      refused: ConfigError saying whose it is and what to do
      another user owns
    a file, under a file, not      refused: ConfigError naming ``what`` and the fix
      writable by this user

What this cannot stop: root, and another process of the same user.
"""

from __future__ import annotations

import logging
import os
import stat

from .errors import ConfigError

__all__ = ["private_dir"]

log = logging.getLogger("s3dcp")


def private_dir(path: str | os.PathLike, *, what: str, create: bool = True, tighten: bool = False) -> str | None:
    """The absolute ``path`` of a directory only this user may write (see the module docstring);
    ``what`` names it in errors. Made 0700 (parents too) when missing and ``create``, else
    None when missing."""
    path = os.path.abspath(path)
    if create:
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
        except FileExistsError:
            pass  # a file in its place: said below
        except NotADirectoryError:
            raise ConfigError(f"{what} {path} cannot be made: a part of its path is a file, not a directory; "
                              "choose another directory") from None
        except PermissionError as e:
            raise ConfigError(f"{what} {path} cannot be made: {e.strerror} ({e.filename}); choose a directory this "
                              "user may write") from None
    me = os.geteuid()
    try:
        link = os.lstat(path)
        st = os.stat(path)  # a link to a directory is judged by the directory, and by whose link it is
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(link.st_mode) and link.st_uid not in (me, 0):
        raise ConfigError(f"{what} {path} is a symbolic link of uid {link.st_uid}, who could point it elsewhere at "
                          "any time; use the directory itself, or a link of your own")
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{what} {path} is not a directory (a file is in its place); remove it or choose another "
                          "directory")
    if st.st_uid != me:
        raise ConfigError(f"{what} {path} belongs to uid {st.st_uid}, not to you (uid {me}): whoever owns it can "
                          "change what s3dcp reads from it; use a directory of your own")
    mode = stat.S_IMODE(st.st_mode)
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        who = "others" if st.st_mode & stat.S_IWOTH else "its group"
        raise ConfigError(f"{what} {path} may be written by {who} (mode {mode:04o}): they could plant or replace "
                          f"what s3dcp reads from it; chmod go-w {path} (or 700), or use another directory")
    if tighten and mode & 0o077:
        os.chmod(path, mode & 0o700)
        log.info("%s %s was readable by others (mode %04o): made private (%04o)", what, path, mode, mode & 0o700)
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} {path} is not writable by this user (mode {mode:04o}); chmod u+rwx it or choose "
                          "another directory")
    return path
