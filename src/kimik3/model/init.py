"""A model built on the meta device given memory (`allocate`), and the training initialization of a freshly built
model (a loaded checkpoint needs none)."""

from __future__ import annotations

import torch
from torch import nn

from kimik3.model.kda import KimiDeltaAttention
from kimik3.model.moe import Experts, Router
from kimik3.model.norm import GatedRMSNorm, RMSNorm


def allocate(module: nn.Module, device: torch.device | str) -> nn.Module:
    """`module.to_empty(device=device)`: each meta parameter and buffer replaced by uninitialized memory of its size,
    dtype and strides on `device`. to_empty's `empty_like` of a meta tensor runs torch's Python reference
    (`torch._refs.empty_like`, its stride logic: 1.1 ms a tensor here, 10 ms on the H200 in a new `kimik3 generate`
    under cProfile); `empty_strided` is one C++ call. Modules that keep their own placement (tiered experts) keep it,
    as under to_empty (both go through `_apply`)."""
    return module._apply(lambda t: torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device))


@torch.no_grad()
def init_weights(model: nn.Module, std: float, seed: int | None = None) -> None:
    """Normal(0, std) matrices, unit norms, fla-style KDA islands, zero AttnRes pseudo-queries.

    Zero pseudo-queries start every depth mix as a uniform average (the AttnRes paper's init); zero
    correction biases start routing on the raw scores.
    """
    if seed is not None:
        torch.manual_seed(seed)
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            if name.endswith("_res_proj"):
                mod.weight.zero_()
            else:
                mod.weight.normal_(0.0, std)
        elif isinstance(mod, nn.Embedding):
            mod.weight.normal_(0.0, std)
            if mod.padding_idx is not None:
                mod.weight[mod.padding_idx].zero_()
        elif isinstance(mod, (RMSNorm, GatedRMSNorm)):
            mod.weight.fill_(1.0)
        elif isinstance(mod, Router):
            mod.weight.normal_(0.0, std)
            mod.e_score_correction_bias.zero_()
        elif isinstance(mod, Experts):
            for w in (mod.w1, mod.w2, mod.w3):
                w.normal_(0.0, std)
        elif isinstance(mod, KimiDeltaAttention):
            mod.reset_kda_parameters()
