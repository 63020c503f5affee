"""Routed-expert computation of the latent MoE; grouped-GEMM and MXFP4 GPU paths are dispatched here.

CUDA tensors take the fast paths unless `kimik3.ops.backend.use_backend("torch")` is in force: bf16
`routed_experts` runs three `torch._grouped_mm` (`.grouped`, differentiable); `routed_experts_mxfp4` with
bf16/fp16 activations runs a W4A16 backend (inference only: with autograd recording a z that requires grad it
takes the reference). Everything else runs `.reference`.

The W4A16 backend (`mxfp4_backend`), imported on first use:
    humming  Humming's MoE GEMM (`.humming`; the `gpu` extra's humming-kernels) when it is installed and the call
             suits it: bf16 z on a compute capability 9.x device, L a multiple of 256 and F of 128 (K3's widths).
             Measured on an H200 at K3's 896 experts, top-16 (2026-12-01, Humming's bench in one process with
             ours): 1.42 / 6.04 / 12.62 ms at 16 / 256 / 4096 tokens against Triton's 1.85 / 7.30 / 25.63, so
             `auto` chooses it at every token count.
    triton   our Triton kernels (`.triton_mxfp4`): the default, and for fp16, other GPUs, other widths.
The environment variable KIMIK3_MOE_BACKEND = triton (default) | auto | humming picks one; a forced humming that
cannot run this call is an error that says why, not a silent fallback. Humming is opt-in for now because its
re-laid-out weights are a second copy of the experts beside the stored ones (expert memory doubles; a device run
with Humming picked by default ran out of memory building a second slice-12 engine): the default flips once the
re-layout replaces the stored tensors at load time.
"""

from __future__ import annotations

import importlib.util
import os
from functools import cache

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
    the Triton and Humming paths decode exactly too but sum the matmuls in their own order (bf16-level
    differences).

    Args:
        packed: (w1, w3, w2) uint8 codes [E, F, L/2], [E, F, L/2], [E, L, F/2].
        scales: (w1, w3, w2) uint8 E8M0 scales [E, F, L/32], [E, F, L/32], [E, L, F/32].
        other arguments: as `routed_experts`.
    """
    if (use_fast(z) and z.dtype in (torch.bfloat16, torch.float16) and has_triton()
            and not (z.requires_grad and torch.is_grad_enabled())):
        if mxfp4_backend(z, packed) == "humming":
            from kimik3.ops.moe import humming as fast
        else:
            from kimik3.ops.moe import triton_mxfp4 as fast
        return fast.routed_experts_mxfp4(z, topk_idx, topk_weight, packed, scales, beta, linear_beta)
    return reference.routed_experts_mxfp4(z, topk_idx, topk_weight, packed, scales, beta, linear_beta)


MXFP4_BACKENDS = ("auto", "triton", "humming")


@cache
def has_humming() -> bool:
    """Whether humming-kernels is installed and imports (it is imported on the first fast call that asks)."""
    if importlib.util.find_spec("humming") is None:
        return False
    try:
        import humming  # noqa: F401
    except (ImportError, OSError):  # installed without its CUDA libraries
        return False
    return True


def mxfp4_backend(z: Tensor, packed: tuple[Tensor, Tensor, Tensor]) -> str:
    """"humming" or "triton": the W4A16 kernels `routed_experts_mxfp4` runs for these inputs on its fast path.

    Raises:
        ValueError: KIMIK3_MOE_BACKEND is not one of MXFP4_BACKENDS, or it forces humming where Humming cannot run.
    """
    choice = os.environ.get("KIMIK3_MOE_BACKEND", "triton")
    if choice not in MXFP4_BACKENDS:
        raise ValueError(f"KIMIK3_MOE_BACKEND must be one of {MXFP4_BACKENDS}, got {choice!r}")
    if choice == "triton":
        return "triton"
    if not has_humming():
        why = "humming-kernels is not installed (the gpu extra)"
    else:
        from kimik3.ops.moe import humming

        why = humming.unsupported(z, packed)
    if why is None:
        return "humming"
    if choice == "humming":
        raise ValueError(f"KIMIK3_MOE_BACKEND=humming: Humming's MoE GEMM {why}")
    return "triton"
