"""A staging slab is a file no other user can open: 0600, under a name nobody chose beforehand,
and unlinked as soon as it exists (docs/security.md)."""

from __future__ import annotations

import os
import stat

import pytest

from s3dcp.memory.slabs import Slab, files_supported


@pytest.mark.skipif(not files_supported(), reason="slabs are shared-memory files on Linux only")
def test_a_slab_is_a_private_unlinked_file():
    slabs = [Slab(1 << 20, pinned=False) for _ in range(2)]
    for slab in slabs:
        st = os.stat(slab.path)
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
        assert st.st_nlink == 0 and os.readlink(slab.path).endswith(" (deleted)")  # no name left to open it by
    assert os.readlink(slabs[0].path) != os.readlink(slabs[1].path)
    for slab in slabs:
        slab.close()
