"""Routed-expert computation of the latent MoE; grouped-GEMM and MXFP4 GPU paths are dispatched here.

CUDA tensors take the fast paths unless `kimik3.ops.backend.use_backend("torch")` is in force: bf16
`routed_experts` runs three `torch._grouped_mm` (`.grouped`, differentiable); `routed_experts_mxfp4` with
bf16/fp16 activations runs a W4A16 backend (inference only: with autograd recording a z that requires grad it
takes the reference). Everything else runs `.reference`.

The W4A16 backend, imported on first use:
    humming  Humming's MoE GEMM (`.humming`; the `gpu` extra's humming-kernels) where it can run: bf16 z on a
             compute capability 9.x device, L a multiple of 256 and F of 128 (K3's widths). Measured on an H200
             at K3's 896 experts, top-16 (2026-12-01, one process with ours): 1.49 / 5.79 / 12.29 ms at 16 / 256 /
             4096 tokens against Triton's 1.79 / 6.99 / 25.78, faster at every size measured.
    triton   our Triton kernels (`.triton_mxfp4`): for fp16, other GPUs, other widths, and stored bytes.
Humming wants its own weight layout. `routed_experts_relaid` runs experts already re-laid out (one copy:
`kimik3.quant.relayout_experts` does this to a model for inference, where `experts_backend` picks humming).
`routed_experts_mxfp4` on the stored bytes runs Triton, or Humming on a second copy kept beside them when forced.
`kimik3.ops.backend.use_backend(moe=...)` picks (the CLI sets it once from KIMIK3_MOE_BACKEND):
    auto     (default) re-laid-out experts where Humming can run; stored bytes run Triton (no second copy)
    humming  as auto, and `routed_experts_mxfp4` on stored bytes runs Humming on a second copy; where Humming
             cannot run it is an error that says why, not a silent fallback
    triton   never Humming
"""

from __future__ import annotations

import importlib.util
from functools import cache

import torch
from torch import Tensor

from kimik3.ops.backend import MOE_BACKENDS, has_triton, moe_backend, use_fast
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



def routed_experts_mxfp4_lora(z: Tensor, topk_idx: Tensor, topk_weight: Tensor, packed: tuple[Tensor, Tensor, Tensor],
                              scales: tuple[Tensor, Tensor, Tensor], lora_a: tuple[Tensor, Tensor, Tensor],
                              lora_b: tuple[Tensor, Tensor, Tensor], scale: float, beta: float,
                              linear_beta: float) -> Tensor:
    """`routed_experts_mxfp4` with LoRA factors on every expert's w1, w3, w2 over the frozen packed weights:
    forward, and backward for z and the factors only. Reference: `.lora`'s per-expert loop; bf16 on CUDA with
    Triton runs `.lora_grouped` (a grouped GEMM per projection over a transient decode of the codes).

    Args:
        lora_a: (A1 [E', R, L], A3 [E', R, L], A2 [E', R, F]); lora_b: (B1 [E', F, R], B3 [E', F, R],
            B2 [E', L, R]); E' is E (per expert) or 1 (shared by the layer's experts).
        scale: the LoRA scale (alpha / R).
        other arguments: as `routed_experts_mxfp4`.
    """
    if use_fast(z) and has_triton():
        from kimik3.ops.moe import lora_grouped

        if lora_grouped.supports(z, lora_a):
            return lora_grouped.routed_experts_mxfp4_lora(z, topk_idx, topk_weight, packed, scales, lora_a, lora_b,
                                                          scale, beta, linear_beta)
    from kimik3.ops.moe import lora

    return lora.routed_experts_mxfp4_lora(z, topk_idx, topk_weight, packed, scales, lora_a, lora_b, scale, beta,
                                          linear_beta)


def routed_experts_mxfp4_adapters(z: Tensor, topk_idx: Tensor, topk_weight: Tensor,
                                  packed: tuple[Tensor, Tensor, Tensor], scales: tuple[Tensor, Tensor, Tensor],
                                  adapter: Tensor, lora_a: tuple[Tensor, Tensor, Tensor],
                                  lora_b: tuple[Tensor, Tensor, Tensor], scale: Tensor, beta: float,
                                  linear_beta: float) -> Tensor:
    """`routed_experts_mxfp4` for tokens of different LoRA adapters in one batch (serving): each expert's base
    matmul shared by all its tokens, the adapters' updates grouped per adapter (`kimik3.ops.lora.lora_delta`).
    `.lora`'s per-expert loop on every device for now (it reads expert counts on the host).

    Args:
        adapter: [N] int64 adapter of each token, -1 for none (that token's result is the base's).
        lora_a, lora_b: the K adapters' factors per projection, [K, E, R, in] and [K, E, out, R].
        scale: [K] fp32 each adapter's alpha / rank.
        other arguments: as `routed_experts_mxfp4`.
    """
    from kimik3.ops.moe import lora

    return lora.routed_experts_mxfp4_adapters(z, topk_idx, topk_weight, packed, scales, adapter, lora_a, lora_b,
                                              scale, beta, linear_beta)


def routed_experts_relaid(z: Tensor, topk_idx: Tensor, topk_weight: Tensor, relaid, beta: float,
                          linear_beta: float) -> Tensor:
    """`routed_experts_mxfp4` on experts in Humming's layout (`humming.relayout` of the packed codes and scales):
    the same function, Humming's kernels only (its reference: `routed_experts_mxfp4` on the stored bytes).

    Raises:
        ValueError: a call Humming cannot run (see `humming.unsupported_for`), or one that asks for a gradient.
    """
    from kimik3.ops.moe import humming

    why = humming.unsupported_for(z.device, z.dtype, z.shape[1], relaid.width)
    if why is None and z.requires_grad and torch.is_grad_enabled():
        why = "is inference only (a gradient was asked for)"
    if why is not None:
        raise ValueError(f"experts re-laid out for Humming: its MoE GEMM {why}; load the model again without "
                         "relayout_experts (or with use_backend(moe='triton'), KIMIK3_MOE_BACKEND=triton) to run "
                         "them elsewhere")
    return humming.routed_experts_relaid(z, topk_idx, topk_weight, relaid, beta, linear_beta)


def warm_relaid(relaid, max_tokens: int, top_k: int, dtype: torch.dtype, device: torch.device) -> int:
    """Compile every Humming kernel that `routed_experts_relaid` on these experts meets for calls of up to
    `max_tokens` tokens (`humming.tiling_token_counts`), by one call at each count on zero inputs; returns the
    number of calls. An engine runs this in its warm-up: otherwise a step whose routed-row count falls in a new
    tile config waits seconds for a JIT compile."""
    from kimik3.ops.moe import humming

    counts = humming.tiling_token_counts(relaid, max_tokens, top_k, device)
    L, E = relaid.w2.config.shape_n, relaid.num_experts
    for n in counts:
        z = torch.zeros(n, L, dtype=dtype, device=device)
        idx = (torch.arange(n * top_k, device=device) % E).view(n, top_k)
        humming.routed_experts_relaid(z, idx, torch.full((n, top_k), 1 / top_k, device=device), relaid, 1.0, 0.0)
    return len(counts)


MXFP4_BACKENDS = MOE_BACKENDS


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


def experts_backend(device: torch.device, dtype: torch.dtype, L: int, F: int) -> str:
    """"humming" or "triton": how experts of latent width L and expert width F, run in `dtype` on `device`, should
    be held for inference (humming: re-laid out once, `relayout_experts`).

    Raises:
        ValueError: the MoE backend (`use_backend(moe=...)`) forces humming where Humming cannot run.
    """
    choice = moe_backend()
    if choice == "triton":
        return "triton"
    if not has_humming():
        why = "humming-kernels is not installed (the gpu extra)"
    else:
        from kimik3.ops.moe import humming

        why = humming.unsupported_for(torch.device(device), dtype, L, F)
    if why is None:
        return "humming"
    if choice == "humming":
        raise ValueError(f"moe backend 'humming' (KIMIK3_MOE_BACKEND=humming): Humming's MoE GEMM {why}")
    return "triton"


def mxfp4_backend(z: Tensor, packed: tuple[Tensor, Tensor, Tensor]) -> str:
    """"humming" or "triton": the W4A16 kernels `routed_experts_mxfp4` runs on stored bytes for these inputs on its
    fast path: humming only where the MoE backend is "humming" (it keeps a second copy of the weights).

    Raises:
        ValueError: the MoE backend forces humming where Humming cannot run.
    """
    if moe_backend() != "humming":
        return "triton"
    return experts_backend(z.device, z.dtype, z.shape[1], packed[0].shape[1])
