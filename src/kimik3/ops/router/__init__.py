"""The MoE router's logits, x @ gate.weight^T in fp32: one public function; one tensor-core GEMM with fp32
output on CUDA when both operands are bf16 (or both fp16), the fp32 reference elsewhere.

Legend: N tokens, D hidden (K = D terms per logit), E experts.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kimik3.ops.backend import use_fast
from kimik3.ops.router import reference

__all__ = ["router_logits"]


def router_logits(x_ND: Tensor, w_ED: Tensor) -> Tensor:
    """The router's logits `x_ND @ w_ED^T`, summed and returned in fp32.

    Args:
        x_ND: [N, D] tokens (the post-attention-norm hidden state), bf16, fp16 or fp32.
        w_ED: [E, D] `gate.weight` (bf16 in the checkpoint; fp32 where training keeps an fp32 master).

    Returns:
        [N, E] fp32; differentiable in both (gradients in each input's dtype).

    The two paths add the same exact products in different orders: each logit is within
    gamma_K * sum_k |x_k w_k| of the exact sum on either path (gamma_K = K u / (1 - K u), u = 2^-24; the
    tensor cores' truncating adds count u = 2^-23), see `.tensor_core` for the argument.
    """
    if use_fast(x_ND) and x_ND.dtype == w_ED.dtype and x_ND.dtype in (torch.bfloat16, torch.float16):
        from kimik3.ops.router import tensor_core

        return tensor_core.router_logits(x_ND, w_ED)
    return reference.router_logits(x_ND, w_ED)
