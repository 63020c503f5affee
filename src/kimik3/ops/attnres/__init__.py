"""The AttnRes depth mix: one public function; the fused Triton kernels on CUDA, the reference elsewhere."""

from __future__ import annotations

from torch import Tensor

from kimik3.ops.attnres import reference
from kimik3.ops.backend import has_triton, use_fast

__all__ = ["attn_res_mix"]


def attn_res_mix(blocks: Tensor, partial: Tensor, norm_weight: Tensor, proj_weight: Tensor, eps: float) -> Tensor:
    """Mix the stored block sums and the current partial sum over depth, per token.

    Args:
        blocks: [M, ..., D] the M >= 0 stored block sums, oldest first.
        partial: [..., D] the current partial sum (the last source).
        norm_weight: [D] the `*_res_norm.weight`; enters only the score vector.
        proj_weight: [1, D] the `*_res_proj.weight` (a bias-free Linear D -> 1): the pseudo-query.
        eps: the norm's eps (1e-5).

    Returns:
        [..., D] in `partial.dtype`: softmax-weighted sum of the unnormalized sources, computed in fp32.
        Differentiable in blocks, partial and both weights.

    On CUDA tensors (unless `kimik3.ops.backend.use_backend("torch")` is active) this runs the fused Triton
    kernels of `.triton` (one read of the sources per pass, no fp32 copies); otherwise `.reference`.
    """
    if use_fast(partial, "attnres") and has_triton():
        from kimik3.ops.attnres import triton as fast  # lazily: triton exists only on GPU machines

        return fast.attn_res_mix(blocks, partial, norm_weight, proj_weight, eps)
    return reference.attn_res_mix(blocks, partial, norm_weight, proj_weight, eps)
