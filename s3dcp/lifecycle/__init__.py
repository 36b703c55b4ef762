"""Between checkpoints: what happens to checkpoints once they are committed.

:mod:`~s3dcp.lifecycle.manager` (save every N, keep the last K, resume) with its retention
bookkeeping (:mod:`~s3dcp.lifecycle.retention`) and listing (:mod:`~s3dcp.lifecycle.directories`);
deletion that keeps what other checkpoints reference (:mod:`~s3dcp.lifecycle.deletion`);
:mod:`~s3dcp.lifecycle.materialize` (copy referenced objects in); :mod:`~s3dcp.lifecycle.gc`
(failed saves' leftovers). It drives the save and load paths; they never call it.
"""
