"""Run by test_reliability.py in a child process that the test interrupts (SIGINT, as Ctrl-C
does) while its ``s3dcp.save`` or ``s3dcp.load`` (or the ``result()`` of an ``s3dcp.async_save``)
waits for requests the test's fault proxy holds. It reports how many requests were still in
flight (or queued) in s3dcp's CRT clients when the KeyboardInterrupt reached it.

Usage: python interrupt_job.py save|load|async_save URI  (endpoint and keys in AWS_ENDPOINT_URL_S3,
AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION)
"""

import os
import signal
import sys
import warnings

import torch

import s3dcp
from s3dcp import S3Config
from s3dcp.config import MiB

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def job_state(fill: float | None = None) -> dict:
    """A few small tensors (packed into one object) and a large one (a multipart upload)."""
    gen = torch.Generator().manual_seed(7)

    def make(n: int) -> torch.Tensor:
        return torch.full((n,), fill) if fill is not None else torch.randn(n, generator=gen)

    state = {f"small{i}": make(64 * 1024) for i in range(3)}  # 256 KiB each
    state["large"] = make(3 * MiB)  # 12 MiB: 3 parts of 5 MiB
    return state


def job_config() -> S3Config:
    return S3Config(access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
                    secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
                    part_size_bytes=5 * MiB, download_part_size_bytes=5 * MiB, object_size_target_bytes=4 * MiB)


def in_flight() -> int:
    from s3dcp.s3 import native

    with native._NATIVE_LOCK:
        natives = list(native._NATIVE.values())
    return sum(n.in_flight + len(n._queue) for n in natives)


def main(op: str, uri: str) -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in an interactive shell
    state = job_state(fill=0.0) if op == "load" else job_state()
    print("started", flush=True)
    try:
        if op == "async_save":  # returns once staged; Ctrl-C comes while result() waits for the upload
            s3dcp.async_save(state, uri, config=job_config()).result()
        elif op == "save":
            s3dcp.save(state, uri, config=job_config())
        else:
            s3dcp.load(state, uri, config=job_config())
    except KeyboardInterrupt:
        print(f"interrupted; requests in flight: {in_flight()}", flush=True)
        return
    print(f"{op} finished (the test should have interrupted it)", flush=True)
    sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
