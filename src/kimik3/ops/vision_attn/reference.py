"""Non-causal attention restricted to each image of a packed batch (the vision tower). Reference, fp32 math.

Legend: T packed tokens of all images, H heads, K head dim, N images (len(cu_seqlens) - 1).
Image n owns tokens cu_seqlens[n]:cu_seqlens[n+1] and attends to exactly those, in both directions.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kimik3.ops.varlen import check_cu_seqlens


def check_inputs(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor) -> list[int]:
    """Raise ValueError on malformed arguments; return the boundaries as Python ints."""
    if q.dim() != 3:
        raise ValueError(f"q must be [T, H, K] (packed tokens, heads, head dim), got shape {tuple(q.shape)}")
    for name, x in (("k", k), ("v", v)):
        if x.shape != q.shape:
            raise ValueError(f"{name} must have the shape of q {tuple(q.shape)}, got {tuple(x.shape)}")
    check_cu_seqlens(cu_seqlens, q.shape[0], 1)
    return [int(b) for b in cu_seqlens.tolist()]


def vision_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, *, scale: float) -> Tensor:
    bounds = check_inputs(q, k, v, cu_seqlens)
    out = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        q_THK, k_THK, v_THK = (x[start:end].float() for x in (q, k, v))
        p_HTT = (torch.einsum("thk,shk->hts", q_THK, k_THK) * scale).softmax(-1)
        out.append(torch.einsum("hts,shk->thk", p_HTT, v_THK))
    return torch.cat(out).to(q.dtype)
