"""Training initialization of a freshly built model (a loaded checkpoint needs none)."""

from __future__ import annotations

import torch
from torch import nn

from kimik3.model.kda import KimiDeltaAttention
from kimik3.model.moe import Experts, Router
from kimik3.model.norm import GatedRMSNorm, RMSNorm


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
