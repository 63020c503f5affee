"""Routed-expert computation of the latent MoE; grouped-GEMM and MXFP4 GPU paths are dispatched here.

CUDA tensors take the fast paths unless `kimik3.ops.backend.use_backend("torch")` is in force: bf16
`routed_experts` runs three `torch._grouped_mm` (`.grouped`, differentiable); `routed_experts_mxfp4` with
bf16/fp16 activations runs the Triton W4A16 kernels (`.triton_mxfp4`, imported on first use, inference only:
with autograd recording a z that requires grad it takes the reference). Everything else runs `.reference`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kimik3.ops.backend import has_triton, use_fast
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
    if use_fast(z) and z.dtype == torch.bfloat16:
        from kimik3.ops.moe import grouped

        return grouped.routed_experts(z, topk_idx, topk_weight, w1, w3, w2, beta, linear_beta)
    return reference.routed_experts(z, topk_idx, topk_weight, w1, w3, w2, beta, linear_beta)


def routed_experts_mxfp4(z: Tensor, topk_idx: Tensor, topk_weight: Tensor, packed: tuple[Tensor, Tensor, Tensor],
                         scales: tuple[Tensor, Tensor, Tensor], beta: float, linear_beta: float) -> Tensor:
    """`routed_experts` with the expert weights kept MXFP4-packed (W4A16): the same function.

    The reference decodes each expert exactly and equals `routed_experts` on the decoded weights bit for bit;
    the Triton path decodes exactly too but sums the matmuls in its own order (bf16-level differences).

    Args:
        packed: (w1, w3, w2) uint8 codes [E, F, L/2], [E, F, L/2], [E, L, F/2].
        scales: (w1, w3, w2) uint8 E8M0 scales [E, F, L/32], [E, F, L/32], [E, L, F/32].
        other arguments: as `routed_experts`.
    """
    if (use_fast(z) and z.dtype in (torch.bfloat16, torch.float16) and has_triton()
            and not (z.requires_grad and torch.is_grad_enabled())):
        from kimik3.ops.moe import triton_mxfp4

        return triton_mxfp4.routed_experts_mxfp4(z, topk_idx, topk_weight, packed, scales, beta, linear_beta)
    return reference.routed_experts_mxfp4(z, topk_idx, topk_weight, packed, scales, beta, linear_beta)
