"""Process-group set-up from torchrun's environment, and the few collectives the trainer needs.

`torchrun --nproc_per_node N -m kimik3 train CONFIG.toml` sets RANK, WORLD_SIZE and LOCAL_RANK; a plain
`kimik3 train` runs as rank 0 of 1 with no process group. CPU ranks use gloo, CUDA ranks NCCL.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device(device: str, local_rank: int = 0) -> torch.device:
    """'auto' -> cuda when available, else cpu; 'cuda' -> this process's GPU."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("train.device = 'cuda' but no CUDA device is available")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(device: str = "auto") -> DistEnv:
    """Join the process group when launched by torchrun (WORLD_SIZE > 1); otherwise a single process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    dev = resolve_device(device, local_rank)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return DistEnv(rank, world, local_rank, dev)


def group_rank(group, caller: str) -> tuple[int, int]:
    """(this rank, world size) in `group` (None: all ranks), for `caller`'s error when no group is initialized."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"{caller} needs an initialized torch.distributed process group (torchrun + "
                         "init_distributed)")
    return dist.get_rank(group), dist.get_world_size(group)


def all_reduce(value: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """In place over all ranks (a no-op without a process group). Returns `value`."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return value


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def shutdown() -> None:
    """Leave the process group (after a barrier: a rank that tears down early aborts the others' gloo)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
