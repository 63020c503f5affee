"""Routed-expert computation of the latent MoE; grouped-GEMM and MXFP4 GPU paths are dispatched here."""

from __future__ import annotations

from torch import Tensor

from kimik3.ops.moe import reference


def routed_experts(z: Tensor, topk_idx: Tensor, topk_weight: Tensor, w1: Tensor, w3: Tensor, w2: Tensor,
                   beta: float, linear_beta: float) -> Tensor:
    """Run each token through its selected experts and combine them.

    Args:
        z: [N, L] latent tokens (compute dtype).
        topk_idx: [N, A] int64 selected experts.
        topk_weight: [N, A] fp32 combine weights (already renormalized and scaled).
        w1, w3: [E, F, L] gate and up projections; w2: [E, L, F] down projection (compute dtype).
        beta, linear_beta: SiTU constants.

    Returns:
        [N, L] in `z.dtype`: sum over the A experts of weight * expert output, accumulated in fp32 after each
        expert's output is rounded to the compute dtype.
    """
    return reference.routed_experts(z, topk_idx, topk_weight, w1, w3, w2, beta, linear_beta)


def routed_experts_mxfp4(z: Tensor, topk_idx: Tensor, topk_weight: Tensor, packed: tuple[Tensor, Tensor, Tensor],
                         scales: tuple[Tensor, Tensor, Tensor], beta: float, linear_beta: float) -> Tensor:
    """`routed_experts` with the expert weights kept MXFP4-packed (W4A16): same result, bit for bit.

    Args:
        packed: (w1, w3, w2) uint8 codes [E, F, L/2], [E, F, L/2], [E, L, F/2].
        scales: (w1, w3, w2) uint8 E8M0 scales [E, F, L/32], [E, F, L/32], [E, L, F/32].
        other arguments: as `routed_experts`.
    """
    return reference.routed_experts_mxfp4(z, topk_idx, topk_weight, packed, scales, beta, linear_beta)
