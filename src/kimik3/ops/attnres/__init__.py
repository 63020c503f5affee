"""The AttnRes depth mix: one public function; a fused GPU kernel may be dispatched here later."""

from __future__ import annotations

from torch import Tensor

from kimik3.ops.attnres import reference


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
    """
    return reference.attn_res_mix(blocks, partial, norm_weight, proj_weight, eps)
