"""Run by test_reliability.py in a child process that the test SIGKILLs in the middle of the
save: a plain ``dcp.save`` of a few small tensors (packed into one object, a single PUT) and
one large tensor (its own object, a multipart upload).

Usage: python crash_job.py URI  (endpoint and keys in AWS_ENDPOINT_URL_S3, AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_REGION; the endpoint is the test's fault proxy, which holds the parts)
"""

import os
import sys
import warnings

import torch
import torch.distributed.checkpoint as dcp

from s3dcp import S3Config, S3StorageWriter
from s3dcp.config import MiB

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def main(uri: str) -> None:
    config = S3Config(access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
                      secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
                      part_size_bytes=5 * MiB, object_size_target_bytes=4 * MiB)
    gen = torch.Generator().manual_seed(6)
    state = {f"small{i}": torch.randn(64 * 1024, generator=gen) for i in range(3)}  # 256 KiB each
    state["large"] = torch.randn(3 * MiB, generator=gen)  # 12 MiB: 3 parts
    print("saving", flush=True)
    dcp.save(state, storage_writer=S3StorageWriter(uri, config=config))
    print("saved (the test should have killed us by now)", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
