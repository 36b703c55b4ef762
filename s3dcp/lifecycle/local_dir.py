"""A run's ``local_dir``: made private to the job, or refused while it is not.

The node's copies of a checkpoint are as sensitive as the bucket (the weights, the run's URI)
and as trusted (a restore loads them). So, when a :class:`~s3dcp.CheckpointManager` is made:

    local_dir missing              made, 0700 (its parents with the usual permissions)
    a directory of this user       group and others lose their read and search bits (0700); refused
                                   while group or others may write it (they could plant a copy)
    another user's, or a link      refused: ConfigError saying whose it is and what to do
      another user owns
    a file, under a file,          refused: ConfigError naming local_dir and the fix
      not writable

Everything s3dcp writes under it is 0700 directories and 0600 files
(:mod:`s3dcp.saving.local_copy`), so within a private ``local_dir`` only this user (and root)
can read or change a copy. What this cannot stop: root, and another process of the same user.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from ..errors import ConfigError

__all__ = ["open_local_dir"]

log = logging.getLogger("s3dcp")


def open_local_dir(local_dir: str | os.PathLike) -> Path:
    """``local_dir``, made (0700) where it is missing, checked private to this user where it
    is there (see the module docstring); ConfigError otherwise."""
    if not isinstance(local_dir, (str, os.PathLike)) or not str(local_dir):
        raise ConfigError(f"local_dir={local_dir!r} must be a path (a directory of this run, e.g. /dev/shm/run7)")
    path = Path(local_dir)
    try:
        path.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass  # checked below (made by another rank of this node just now, or there before)
    except NotADirectoryError:
        raise ConfigError(f"local_dir={str(path)!r} cannot be made: a part of its path is a file, not a "
                          "directory; choose another local_dir") from None
    except PermissionError as e:
        raise ConfigError(f"local_dir={str(path)!r} cannot be made: {e.strerror} ({e.filename}); choose a "
                          "directory this user may write (e.g. under /dev/shm or a local NVMe)") from None
    except OSError as e:
        raise ConfigError(f"local_dir={str(path)!r} cannot be made: {e.strerror or e}") from None
    _check_private(path)
    return path


def _check_private(path: Path) -> None:
    me = os.geteuid()
    link = os.lstat(path)
    if stat.S_ISLNK(link.st_mode) and link.st_uid not in (me, 0):
        raise ConfigError(f"local_dir={str(path)!r} is a symbolic link of user {link.st_uid}, who could point "
                          "it elsewhere at any time; use the directory itself, or a link of your own")
    try:
        st = os.stat(path)
    except OSError as e:
        raise ConfigError(f"local_dir={str(path)!r} is not usable: {e.strerror or e}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"local_dir={str(path)!r} is a file, not a directory; remove it or choose another "
                          "local_dir")
    if st.st_uid != me:
        raise ConfigError(f"local_dir={str(path)!r} belongs to user {st.st_uid}, not to this user ({me}): its "
                          "owner could read the node's copies or plant one that a restore would load; use a "
                          "directory of your own (a new path is made private to you)")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ConfigError(f"local_dir={str(path)!r} is writable by {_who(st.st_mode)} (mode "
                          f"{stat.S_IMODE(st.st_mode):04o}): they could plant a copy that a restore would load; "
                          f"make it private (chmod 700 {str(path)!r}) or use a new path")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, stat.S_IMODE(st.st_mode) & 0o700)
        log.info("local_dir %s was readable by others (mode %04o): made private (0700)", path,
                 stat.S_IMODE(st.st_mode))
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"local_dir={str(path)!r} is not writable by this user (mode "
                          f"{stat.S_IMODE(st.st_mode):04o}); chmod u+rwx it or choose another local_dir")


def _who(mode: int) -> str:
    return " and ".join(w for w, bit in (("its group", stat.S_IWGRP), ("every user", stat.S_IWOTH)) if mode & bit)
