"""Real-dims K3 modules with random weights on the GPU, built on the meta device then materialized.

Routed experts are MXFP4-packed with random codes and scale bytes near 2^-7 (valid MXFP4 data: the
kernels' speed does not depend on the values, and no bf16 copy of 896 experts is ever made).
"""

from __future__ import annotations

import torch
from torch import nn

from bench.common import DEVICE
from kimik3.model.init import allocate
from kimik3.model.moe import MXFP4Experts
from kimik3.ops.backend import moe_backend_from_env, use_backend
from kimik3.quant import pack_experts, relayout_experts


@torch.no_grad()
def materialize(module: nn.Module, seed: int = 0) -> nn.Module:
    """meta -> DEVICE with random values: matrices N(0, 0.02), norms 1, KDA islands in their usual ranges."""
    pack_experts(module)
    allocate(module, DEVICE)
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        if t.dtype == torch.uint8:
            lo, hi = (0, 256) if name.endswith("_packed") else (118, 122)
            t.copy_(torch.randint(lo, hi, t.shape, generator=g, device=DEVICE, dtype=torch.int32))
        elif name.endswith("norm.weight"):
            t.fill_(1.0)
        elif name.endswith("A_log"):
            t.uniform_(0.0, 2.7, generator=g)
        elif name.endswith("e_score_correction_bias"):
            t.zero_()
        elif name.endswith("conv1d.weight"):
            t.normal_(0.0, 0.5, generator=g)
        else:
            t.normal_(0.0, 0.02, generator=g)
    return module


def experts_backend_of(module: nn.Module) -> str:
    """Hand the module's MXFP4 experts to Humming's layout where KIMIK3_MOE_BACKEND picks it, as `kimik3 generate`
    and `kimik3 serve` do (`relayout_experts`); returns the W4A16 kernels they will run: "humming" or "triton"."""
    with use_backend(moe=moe_backend_from_env()):  # the CLI reads the variable the same way
        return "humming" if relayout_experts(module) else "triton"


def expert_bytes(module: nn.Module) -> int:
    """Bytes of one routed expert (packed codes + scales of w1, w3, w2)."""
    ex = next(m for m in module.modules() if isinstance(m, MXFP4Experts))
    return sum(t[0].nbytes for t in ex.buffers())


def dense_bytes(module: nn.Module) -> int:
    """Bytes of every weight except the routed experts."""
    experts = {id(t) for m in module.modules() if isinstance(m, MXFP4Experts) for t in m.buffers()}
    return sum(t.nbytes for t in list(module.parameters()) + list(module.buffers()) if id(t) not in experts)


def step_weight_bytes(module: nn.Module, tokens: int) -> float:
    """Weight bytes a step of `tokens` independently routed tokens reads (the bytes floor's weight part): every
    dense weight once but the embedding (a lookup reads one row a token), and of the routed experts the share
    1 - (1 - A/E)^tokens that many tokens are expected to touch."""
    cfg = module.config
    expert, dense = 0, 0
    for name, t in module.state_dict().items():
        if name.endswith("embed_tokens.weight"):
            dense += tokens * t[0].nbytes
        elif ".experts." in name:
            expert += t.nbytes
        else:
            dense += t.nbytes
    touched = 1 - (1 - cfg.moe.num_experts_per_token / cfg.moe.num_experts) ** tokens if expert else 0
    return dense + expert * touched


def linear_flops(module: nn.Module, tokens: int, top_k: int) -> int:
    """Matmul FLOPs of one forward over `tokens` tokens: every Linear + the active routed experts."""
    flops = sum(2 * tokens * m.in_features * m.out_features for m in module.modules() if isinstance(m, nn.Linear))
    for m in module.modules():
        if isinstance(m, MXFP4Experts):
            E, F, L2 = m.w1_packed.shape
            flops += 2 * tokens * top_k * 3 * F * (2 * L2)
    return flops
