"""Training checkpoints of an expert-parallel model: this rank's expert rows <-> the full tensors.

A checkpoint holds every tensor whole (the released layout, loadable by one process), whatever the world size.
FSDP2's full state dicts cover the data-parallel weights; the expert-sharded parameters (ignored by FSDP) and
their optimizer state are joined here with one all-gather each along the expert dimension (dim 0: rank r holds
experts [r*E/W, (r+1)*E/W), see `ExpertShard`), and cut back to this rank's rows on resume.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from kimik3.checkpoint.sharded import ExpertShard


def sharded_experts(model: nn.Module) -> dict[str, tuple[nn.Parameter, ExpertShard]]:
    """Fully qualified name -> (local parameter, its shard) for every expert-sharded parameter of `model`."""
    return {f"{mod_name}.{name}": (p, mod.expert_shard) for mod_name, mod in model.named_modules()
            if getattr(mod, "expert_shard", None) is not None for name, p in mod.named_parameters(recurse=False)}


def _gather(t: Tensor, group) -> Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts).cpu()


@torch.no_grad()
def gather_experts(model: nn.Module, optimizers: list[torch.optim.Optimizer], group=None
                   ) -> tuple[dict[str, Tensor], dict[str, dict]]:
    """(weights, optimizer state) of the sharded experts, whole, on the CPU of every rank, keyed by the names
    FSDP2's full state dicts use. Optimizer entries shaped like the parameter are joined; scalars (Adam's step)
    are the same on every rank and kept. Collective over `group` (default: all ranks)."""
    weights, states = {}, {}
    for name, (p, _) in sharded_experts(model).items():
        weights[name] = _gather(p.detach(), group)
        state = next((opt.state[p] for opt in optimizers if p in opt.state), {})
        states[name] = {k: _gather(v, group) if isinstance(v, Tensor) and v.shape == p.shape else v
                        for k, v in state.items()}
    return weights, states


def shard_expert_optimizer_state(model: nn.Module, full: dict) -> dict:
    """A full optimizer state dict ({"state": {name: {...}}, "param_groups": [...]}) with each sharded expert's
    entries cut to this rank's rows: what `set_optimizer_state_dict` expects for parameters FSDP ignores."""
    state = dict(full["state"])
    for name, (_, shard) in sharded_experts(model).items():
        if name in state:
            state[name] = {k: v[shard.start:shard.stop].clone()
                           if isinstance(v, Tensor) and v.dim() > 0 and v.shape[0] == shard.num_experts else v
                           for k, v in state[name].items()}
    return {**full, "state": state}
