"""A file written under a name nobody else could have prepared, then renamed onto its destination.

``s3dcp download`` and ``s3dcp export`` write next to their destination and rename when the
file is complete, so nothing half-written ever stands at the destination. The name they write
under must not be one another user could have prepared in a directory they may write: at a
fixed ``DEST.partial`` a symlink of theirs would have the write go to any file of yours.
:class:`PartialFile` creates the file exclusively (``O_EXCL``: an existing file or symlink
fails the call) under a random name in the destination's directory, 0600 until :meth:`finish`
gives it the mode any new file gets (the umask's) and renames it onto the destination.

    partial = PartialFile(dest)          # .DEST.k2j4x9.partial, 0600
    write(partial.fd)                    # (a writer that renames its own file onto partial.path: then reopen())
    partial.finish()                     # umask mode, renamed onto dest
    # on failure: partial.discard()      # (also what leaving its `with` block unfinished does)
"""

from __future__ import annotations

import os
import stat
import tempfile
from contextlib import suppress

__all__ = ["PartialFile", "umask"]


def umask() -> int:
    """This process's umask, read without changing it (``os.umask`` sets it, for every thread)."""
    with suppress(OSError, ValueError, StopIteration), open("/proc/self/status") as f:
        return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    return 0o077  # no /proc (macOS): unknown, so the strictest (a file too private beats one too open)


class PartialFile:
    """The file being written for ``dest`` (see the module docstring): :attr:`fd` open on it,
    :attr:`path` its name until :meth:`finish`."""

    def __init__(self, dest: str) -> None:
        self.dest = os.path.abspath(dest)
        directory, base = os.path.split(self.dest)
        self.fd: int | None
        self.fd, self.path = tempfile.mkstemp(prefix=f".{base}.", suffix=".partial", dir=directory)

    def reopen(self) -> None:
        """Hold the file that now stands at :attr:`path`, after a writer that renames a file of
        its own onto it (safetensors' ``save_file`` does): opened without following a symlink,
        and only a regular file of this user's (OSError otherwise)."""
        fd = os.open(self.path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            os.close(fd)
            raise OSError(f"{self.path} was replaced by something that is not this user's file while it was written")
        self._close()
        self.fd = fd

    def finish(self) -> None:
        """Give the file the mode a new file gets, rename it onto :attr:`dest`, close it."""
        os.fchmod(self.fd, 0o666 & ~umask())
        os.replace(self.path, self.dest)
        self._close()

    def discard(self) -> None:
        """Close and delete the unfinished file; idempotent."""
        if self.fd is not None:
            self._close()
            with suppress(FileNotFoundError):
                os.unlink(self.path)

    def _close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> "PartialFile":
        return self

    def __exit__(self, *exc_info) -> None:
        self.discard()
