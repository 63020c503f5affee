"""Attention of the vision tower: bidirectional, each image attends only to itself (varlen).

One public function: on CUDA tensors it runs `.sdpa` (one unmasked fused SDPA call per image); elsewhere, or
under `use_backend("torch")`, `.reference`, the same contract written as an explicit fp32 softmax per image.
"""

from __future__ import annotations

from torch import Tensor

from kimik3.ops.backend import use_fast
from kimik3.ops.vision_attn import reference, sdpa

__all__ = ["vision_attention"]


def vision_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, *, scale: float) -> Tensor:
    """softmax(q k^T * scale) v within each image of a packed batch (not causal).

    Shapes (T packed tokens of all images, H heads, K head dim, N images):
        q, k, v: [T, H, K], any float dtype.
        cu_seqlens: [N + 1] integer image boundaries (0 first, T last; any device), as in flash-attention's
            varlen API. A token of image n sees exactly the tokens cu_seqlens[n]:cu_seqlens[n+1].

    Args:
        scale: softmax scale (the tower uses K ** -0.5).

    Returns:
        [T, H, K] in q.dtype, differentiable in q, k, v. The SDPA path computes in the input dtype with fp32
        softmax statistics (like FA2 in the reference); the reference computes in fp32 and holds one
        [H, T_n, T_n] fp32 score matrix per image (1.6 GB for a 1024x1024 image).

    Raises:
        ValueError naming the argument: q not 3-D, k/v shaped unlike q, cu_seqlens not rising from 0 to T.
    """
    if use_fast(q, "vision_attn"):
        return sdpa.vision_attention(q, k, v, cu_seqlens, scale=scale)
    return reference.vision_attention(q, k, v, cu_seqlens, scale=scale)
