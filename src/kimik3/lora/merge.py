"""Fold an adapter into its base: W' = W + scale * B A, computed in fp32 from the exact base weights.

    merge(model)                                    in place: LoRA modules -> plain Linear / dense Experts (fp32)
    merge_checkpoint(base, adapter, out, experts)   a full checkpoint folder, routed experts "bf16" or "mxfp4"

Non-expert weights: W is the stored (bf16) weight read exactly, the sum is fp32, rounded once to the output dtype.
Routed experts: decode(MXFP4) + delta in fp32 (dense experts), or re-encoded to MXFP4 (`kimik3.ops.mxfp4.encode`);
a merged update is rarely on the MXFP4 grid, so re-encoding is lossy and its error is measured and returned:
||decode(encode(M)) - M|| / ||M|| over all experts of all layers, M the fp32 merge.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from kimik3.lora.apply import lora_modules, released_prefix
from kimik3.lora.layers import PROJECTIONS, LoraLinear
from kimik3.model.moe import Experts
from kimik3.ops.mxfp4 import decode, encode

EXPERT_CHOICES = ("bf16", "mxfp4")


@torch.no_grad()
def merge(model: nn.Module) -> nn.Module:
    """Replace every LoRA module of `model` by its merged base module, in place (experts dense, fp32). Returns it."""
    prefix = released_prefix(model)
    for released, m in lora_modules(model).items():
        name = released.removeprefix(prefix)
        if isinstance(m, LoraLinear):
            new = nn.Linear(m.in_features, m.out_features, bias=False, device=m.weight.device, dtype=m.weight.dtype)
            new.weight.copy_((m.weight.float() + m.delta()).to(m.weight.dtype))
        else:
            E, F, half = m.w1_packed.shape
            new = Experts(E, 2 * half, F, dtype=torch.float32).to(m.w1_packed.device)
            for p in PROJECTIONS:
                getattr(new, p).copy_(m.merged(p))
        new.requires_grad_(False)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
    if hasattr(model, "lora_config"):
        del model.lora_config
    return model


def reencode_error(model: nn.Module) -> float:
    """Relative error of MXFP4-re-encoded dense experts against themselves (see the module docstring)."""
    num = den = 0.0
    for m in model.modules():
        if isinstance(m, Experts):
            for p in PROJECTIONS:
                w = getattr(m, p).float()
                num += float((decode(*encode(w), torch.float32) - w).double().square().sum())
                den += float(w.double().square().sum())
    return math.sqrt(num / den) if den > 0 else 0.0


def merge_checkpoint(base: str | Path, adapter: str | Path, out: str | Path, *, experts: str = "bf16",
                     dtype: torch.dtype | None = None, quiet: bool = False) -> dict:
    """Write base + adapter as a full checkpoint folder at `out` (tokenizer and card copied from `base`), or as a
    GGUF when `out` ends in .gguf (`kimik3.checkpoint.gguf_write.save_gguf`).

    Args:
        experts: "bf16" (dense routed experts, the fp32 merge rounded to `dtype`) or "mxfp4" (re-encoded).
        dtype: stored dtype of the weights; None = the base config's (bfloat16).

    Returns:
        {"experts": ..., "reencode_rel_err": float or None, "modules": merged module count}.
    """
    from kimik3.checkpoint import load, save
    from kimik3.lora.peft import load as load_adapter

    if experts not in EXPERT_CHOICES:
        raise ValueError(f"experts must be one of {EXPERT_CHOICES}, got {experts!r}")
    model = load(base, dtype=torch.float32, keep_experts_packed=True, quiet=quiet)
    load_adapter(model, adapter)
    count = len(lora_modules(model))
    merge(model)
    err = reencode_error(model) if experts == "mxfp4" else None
    if str(out).endswith(".gguf"):  # llama.cpp's kimi-k3 layout (docs/gguf.md)
        from kimik3.checkpoint.gguf_write import save_gguf

        save_gguf(model, out, experts=experts, dtype=dtype, source=base, quiet=quiet)
    else:
        save(model, out, experts=experts, dtype=dtype, source=base, quiet=quiet)
    return {"experts": experts, "reencode_rel_err": err, "modules": count}
