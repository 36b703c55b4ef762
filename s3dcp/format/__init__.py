"""What is stored, as pure code: no client, no I/O, no threads.

Object names and where each item's bytes live (:mod:`~s3dcp.format.layout`), item checksums
(:mod:`~s3dcp.format.integrity`), raw tensor bytes (:mod:`~s3dcp.format.tensors`), the
checkpoint metadata formats (:mod:`s3dcp.format.metadata`), the names incremental checkpoints
use for each other's objects (:mod:`~s3dcp.format.references`) and safetensors headers
(:mod:`~s3dcp.format.safetensors`). Everything decoded here comes from storage and is untrusted:
counts, lengths and offsets are bounded by what the object holds before anything is allocated.
"""
