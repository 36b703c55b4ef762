"""The load path: metadata -> read plan -> ranged GETs into the destination tensors.

:mod:`~s3dcp.loading.reader` is DCP's StorageReader; :mod:`~s3dcp.loading.bounce` the bounded
window that GETs land in when they cannot land in the destination itself. It never imports the
save path.
"""
