"""A directory only its user may write: made 0700, or refused when it belongs to someone else.

What s3dcp keeps on the local disk for itself (the local server's data, the state files that
``s3dcp server --print-env`` reads and prints as shell commands) is trusted when it is read
back, so nobody else may have been able to write it: :func:`private_dir` makes the directory
0700 when it is new, and refuses one that another user owns or that its group or others may
write (they could plant or replace what is in it). ``tighten=True`` also takes away what
others may read (chmod 0700), for a directory that holds data.
"""

from __future__ import annotations

import os
import stat

from .errors import ConfigError

__all__ = ["private_dir"]


def private_dir(path: str, *, what: str, create: bool = True, tighten: bool = False) -> str | None:
    """The absolute ``path`` of a directory only this user may write (see the module docstring);
    ``what`` names it in errors. Made 0700 (parents too) when missing and ``create``, else
    None when missing. Raises ConfigError for one owned by another user, one its group or
    others may write, or something that is not a directory."""
    path = os.path.abspath(path)
    if create:
        os.makedirs(path, mode=0o700, exist_ok=True)
    try:
        st = os.stat(path)  # a symlink to a directory is judged by the directory
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{what} {path} is not a directory")
    me = os.geteuid()
    if st.st_uid != me:
        raise ConfigError(f"{what} {path} belongs to uid {st.st_uid}, not to you (uid {me}): whoever owns it can "
                          "change what s3dcp reads from it; use a directory of your own")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        who = "others" if st.st_mode & stat.S_IWOTH else "its group"
        raise ConfigError(f"{what} {path} may be written by {who} (mode {stat.S_IMODE(st.st_mode):04o}): they could "
                          f"plant or replace what s3dcp reads from it; chmod go-w {path}, or use another directory")
    if tighten and st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path
