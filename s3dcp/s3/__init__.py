"""Talking to S3: the only code that sends a request.

:mod:`~s3dcp.s3.client` turns each S3 operation into a future; one request's life (deadline,
abort, slot) and the native CRT clients shared by every ``S3Client`` of a process live beside it;
:mod:`~s3dcp.s3.responses` reads S3's answers and translates errors once, by status and S3
code; :mod:`~s3dcp.s3.streams` feeds request bodies straight from caller buffers;
:mod:`~s3dcp.s3.probe` explains a failed connection; :mod:`~s3dcp.s3.location` is where a
checkpoint is and how to reach it. Nothing here knows what a checkpoint holds: no torch tensors,
no metadata, no DCP plans.
"""
