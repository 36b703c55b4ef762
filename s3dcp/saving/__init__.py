"""The save path: state dict -> staged host copy -> uploads -> commit.

:mod:`~s3dcp.saving.staging` (DCP's AsyncStager: a lease on a pool arena) with the copies of
:mod:`~s3dcp.saving.copies` and :mod:`~s3dcp.saving.statetree`; :mod:`~s3dcp.saving.writer`
(DCP's StorageWriter: plans, the commit) with one rank's uploads in
:mod:`~s3dcp.saving.uploads`; what an incremental save inherits from its base
(:mod:`~s3dcp.saving.base`) and which objects other checkpoints still reference
(:mod:`~s3dcp.saving.referenced`). It may read through :mod:`s3dcp.loading` (a base's
metadata); nothing below imports it.
"""
