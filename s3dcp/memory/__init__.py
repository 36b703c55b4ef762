"""Host memory reused across checkpoints: the staging and bounce pool
(:mod:`~s3dcp.memory.pool`, pinned where CUDA exists) and FIFO spans of one buffer
(:mod:`~s3dcp.memory.ring_buffer`). It knows bytes and arenas, never checkpoints or S3.
"""
