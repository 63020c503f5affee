"""Causal softmax attention for MLA prefill (expanded per-head K/V). Reference, fp32 math.

Legend: B batch, T tokens, H heads, K query/key head dim (192), V value head dim (128).
With `cu_seqlens` (B == 1) the mask is block-diagonal causal: no token sees another document.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kimik3.ops.varlen import check_cu_seqlens, sequence_ids


def mla_attention(q: Tensor, k: Tensor, v: Tensor, *, scale: float, cu_seqlens: Tensor | None = None) -> Tensor:
    B, T = q.shape[:2]
    s_BHTT = torch.einsum("bthk,bshk->bhts", q.float(), k.float()) * scale
    mask_TT = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, T, B)
        doc = sequence_ids(cu_seqlens.to(q.device), T)
        mask_TT = mask_TT & (doc[:, None] == doc[None, :])
    p_BHTT = s_BHTT.masked_fill(~mask_TT, float("-inf")).softmax(-1)
    return torch.einsum("bhts,bshv->bthv", p_BHTT, v.float()).to(q.dtype)
