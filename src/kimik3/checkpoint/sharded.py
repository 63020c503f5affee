"""Expert shards: which routed experts a rank holds, the model cut down to them, and the checkpoint names it reads.

Legend: E routed experts, W ranks, El = E / W experts per rank, F expert width, L MoE latent width.

Rank r of W holds the contiguous experts [r*El, (r+1)*El) of every MoE layer. `slice_experts` replaces each
`LatentMoE.experts` by a module of the same class holding only those rows (`Experts` w1/w3 [El, F, L], w2
[El, L, F]; or `MXFP4Experts` with its packed buffers cut the same way), so parameter names and state_dict
keys are unchanged and only the leading dimension shrinks. The module remembers its `expert_shard`.

This is structure only (no communication): the loader uses it to build and fill a rank's model without
reading other ranks' experts (`load(..., expert_shard=(rank, world))`), and
`kimik3.distributed.expert_parallel` uses it before wiring in the all-to-all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kimik3.checkpoint.keys import parse_expert_key
from kimik3.model.init import allocate
from kimik3.model.moe import Experts, LatentMoE, MXFP4Experts


@dataclass(frozen=True)
class ExpertShard:
    """Rank `rank` of `world` holds routed experts [start, stop) of `num_experts` (every MoE layer alike).

    Raises:
        ValueError: world < 1, rank outside [0, world), or num_experts not divisible by world.
    """

    rank: int
    world: int
    num_experts: int

    def __post_init__(self):
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise ValueError(f"expert shard: need 0 <= rank < world, got rank={self.rank}, world={self.world}")
        if self.num_experts % self.world:
            raise ValueError(f"num_experts ({self.num_experts}) must be divisible by the expert-parallel world "
                             f"size ({self.world}): every rank holds the same number of experts")

    @property
    def count(self) -> int:
        return self.num_experts // self.world

    @property
    def start(self) -> int:
        return self.rank * self.count

    @property
    def stop(self) -> int:
        return self.start + self.count

    def reads(self, name: str) -> bool:
        """Whether this rank reads checkpoint tensor `name`: everything except other ranks' per-expert tensors."""
        key = parse_expert_key(name)
        return key is None or self.start <= key.expert < self.stop


def _expert_tensors(experts: nn.Module) -> dict[str, torch.Tensor]:
    return dict(experts.named_parameters(recurse=False)) | dict(experts.named_buffers(recurse=False))


@torch.no_grad()
def _sliced(old: Experts | MXFP4Experts, shard: ExpertShard) -> Experts | MXFP4Experts:
    """A module of `old`'s class holding its experts [start, stop), on `old`'s device (meta stays meta)."""
    tensors = _expert_tensors(old)
    device = next(iter(tensors.values())).device
    with torch.device("meta"):
        if isinstance(old, Experts):
            _, F, L = old.w1.shape
            new = Experts(shard.count, L, F, dtype=old.w1.dtype)
        else:
            F, L = old.w1_packed.shape[1], old.w2_packed.shape[1]
            new = MXFP4Experts(shard.count, L, F)
    allocate(new, device)
    for name, t in _expert_tensors(new).items():
        src = tensors[name]
        if device.type != "meta":
            t.copy_(src[shard.start:shard.stop])  # a copy, so the full stacked tensor can be freed
        t.requires_grad_(src.requires_grad)
    new.expert_shard = shard
    return new


def slice_experts(model: nn.Module, rank: int, world: int) -> nn.Module:
    """Keep only rank `rank`'s contiguous slice of every MoE layer's routed experts (in place; returns `model`).

    Works on real and meta tensors. A layer already cut for the same (rank, world) is left as it is.

    Raises:
        ValueError: num_experts not divisible by `world`, or a layer already cut for another (rank, world).
    """
    for moe in [m for m in model.modules() if isinstance(m, LatentMoE)]:
        old = moe.experts
        have = getattr(old, "expert_shard", None)
        if have is not None:
            if (have.rank, have.world) != (rank, world):
                raise ValueError(f"experts are already sharded as rank {have.rank} of {have.world}; "
                                 f"cannot re-shard as rank {rank} of {world}")
            continue
        num_experts = next(iter(_expert_tensors(old).values())).shape[0]
        moe.experts = _sliced(old, ExpertShard(rank, world, num_experts))
    return model
