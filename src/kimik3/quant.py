"""Quantization transforms of a built model (as gpt-fast's `quantize.py`): the model is built dense, then its
routed experts are packed to MXFP4 or re-laid out for a W4A16 kernel in place.

    pack_experts(model)       every `Experts` -> `MXFP4Experts` (OCP MX encode; exact for weights from MXFP4)
    relayout_experts(model)   every `MXFP4Experts` -> `RelaidExperts` where Humming's MoE GEMM will run them
"""

from __future__ import annotations

import torch
from torch import nn

from kimik3.model.moe import Experts, LatentMoE, MXFP4Experts, RelaidExperts
from kimik3.ops.moe import experts_backend
from kimik3.ops.mxfp4 import encode

__all__ = ["pack_experts", "relayout_experts"]


@torch.no_grad()
def pack_experts(model: nn.Module) -> nn.Module:
    """Replace every `Experts` in `model` by `MXFP4Experts` (in place; returns `model`).

    Real weights are encoded with the OCP MX rule (exact for weights that came from MXFP4); on the meta
    device only the structure changes (the loader then fills the packed buffers).
    """
    for moe in [m for m in model.modules() if isinstance(m, LatentMoE)]:
        old = moe.experts
        if not isinstance(old, Experts):
            continue
        E, F, L = old.w1.shape
        new = MXFP4Experts(E, L, F).to(old.w1.device)
        if old.w1.device.type != "meta":
            for name in ("w1", "w3", "w2"):
                p, s = encode(getattr(old, name))
                getattr(new, f"{name}_packed").copy_(p)
                getattr(new, f"{name}_scale").copy_(s)
        moe.experts = new
    return model


@torch.no_grad()
def relayout_experts(model: nn.Module) -> int:
    """Re-lay out every `MXFP4Experts` of `model` for Humming's MoE GEMM where `kimik3.ops.moe.experts_backend`
    picks it (the MoE backend of `kimik3.ops.backend.use_backend(moe=...)`, auto by default: bf16 experts at K3's
    widths on a Hopper GPU with humming-kernels installed), in place, one layer at a time: the stored codes are
    dropped, so the experts stay one copy (plus one layer's while it is made). Returns how many layers were
    re-laid out.

    For inference: afterwards the model cannot be saved, trained, or run off that GPU (each says so).
    """
    done = 0
    for moe in [m for m in model.modules() if isinstance(m, LatentMoE)]:
        ex = moe.experts
        if not isinstance(ex, MXFP4Experts):
            continue
        _, F, L_half = ex.w1_packed.shape
        dtype = moe.routed_expert_down_proj.weight.dtype
        if experts_backend(ex.w1_packed.device, dtype, 2 * L_half, F) != "humming":
            continue
        from kimik3.ops.moe import humming  # only now: it imports triton, which a CPU install may lack
        relaid = humming.relayout((ex.w1_packed, ex.w3_packed, ex.w2_packed), (ex.w1_scale, ex.w3_scale, ex.w2_scale))
        moe.experts = RelaidExperts(relaid)  # the last reference to the stored codes: freed here
        del ex
        done += 1
    return done
