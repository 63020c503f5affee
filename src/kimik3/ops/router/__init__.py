"""The MoE router: its logits, x @ gate.weight^T in fp32 (one tensor-core GEMM with fp32 output on CUDA when both
operands are bf16 or both fp16), and its expert selection (one Triton kernel per token row on CUDA when no
gradient is asked for); the references elsewhere.

Legend: N tokens, D hidden (K = D terms per logit), E experts.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kimik3.ops.backend import has_triton, use_fast
from kimik3.ops.router import reference, select_reference

__all__ = ["route", "router_logits"]


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
    if use_fast(x_ND, "router") and x_ND.dtype == w_ED.dtype and x_ND.dtype in (torch.bfloat16, torch.float16):
        from kimik3.ops.router import tensor_core

        return tensor_core.router_logits(x_ND, w_ED)
    return reference.router_logits(x_ND, w_ED)


def route(logits_NE: Tensor, bias_E: Tensor, top_k: int, renormalize: bool, scaling: float
          ) -> tuple[Tensor, Tensor, Tensor]:
    """Select each token's experts: sigmoid scores, the top_k of score + bias (the bias only selects), their
    unbiased scores as weights, renormalized to sum 1 if asked (top_k > 1), times `scaling`.

    Args:
        logits_NE: [N, E] fp32 router logits.
        bias_E: [E] fp32 `e_score_correction_bias`.
        top_k, renormalize, scaling: K3's num_experts_per_token (16), renormalize (True), routed_scaling_factor.

    Returns:
        (idx [N, top_k] int64, w [N, top_k] fp32, scores [N, E] fp32). Differentiable in w and scores through the
        logits on the reference path.

    On CUDA with Triton, when no gradient is asked for (decode, prefill, evaluation), one kernel per row does it
    all (the reference launches about seven kernels); its selection is the same set of experts, in descending
    order of biased score, except where two biased scores tie within the sigmoid's last-ulp difference between
    the two paths (as between any two summation orders of the logits, see `router_logits`).
    """
    if use_fast(logits_NE, "router") and has_triton() and not (torch.is_grad_enabled() and logits_NE.requires_grad):
        from kimik3.ops.router import select_triton  # lazily: triton exists only on GPU machines

        return select_triton.route(logits_NE, bias_E, top_k, renormalize, scaling)
    return select_reference.route(logits_NE, bias_E, top_k, renormalize, scaling)
