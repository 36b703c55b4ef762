"""Helpers of the torch-checkpointing tests that must be importable by name in the processes
torch-checkpointing spawns (its writer subprocess unpickles the callbacks it is handed)."""

from __future__ import annotations

import os
import signal


def kill_writer_if_doomed(args) -> None:
    """A ``pre_finalize_callback``: the writer subprocess of a save whose path names "doomed"
    dies (SIGKILL) after writing every file and metadata.pkl, before the barrier and the commit:
    the most a killed save can leave behind."""
    if "doomed" in args.path:
        os.kill(os.getpid(), signal.SIGKILL)


def gather_metadata_on_cpu() -> None:
    """torch-checkpointing 0.1.1 gathers the ranks' resharding metadata through CUDA tensors
    (``DefaultMetadataManager._all_gather_pickled_data`` puts its sizes and bytes on "cuda"),
    so a multi-rank save with a resharder fails on a machine without a GPU. The ranks of these
    tests (gloo, CPU) replace that one method by the same gather on CPU: every rank's
    metadata, by rank. It is the library's collective, not the storage under test."""
    import torch.distributed as dist
    from torch_checkpointing.metadata_manager import DefaultMetadataManager

    def gather(self, data, process_group=None):
        gathered = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(gathered, data, group=process_group)
        return dict(enumerate(gathered))

    DefaultMetadataManager._all_gather_pickled_data = gather
