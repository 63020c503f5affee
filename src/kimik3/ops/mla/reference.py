"""Causal softmax attention for MLA prefill (expanded per-head K/V). Reference, fp32 math.

Legend: B batch, T tokens, H heads, K query/key head dim (192), V value head dim (128).
With `cu_seqlens` (B == 1) the mask is block-diagonal causal: no token sees another document.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kimik3.ops.varlen import check_cu_seqlens, sequence_ids


def mla_attention(q: Tensor, k: Tensor, v: Tensor, *, scale: float, cu_seqlens: Tensor | None = None,
                  mask: Tensor | None = None) -> Tensor:
    B, T = q.shape[:2]
    s_BHTS = torch.einsum("bthk,bshk->bhts", q.float(), k.float()) * scale
    if mask is None:
        mask_TT = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        if cu_seqlens is not None:
            check_cu_seqlens(cu_seqlens, T, B)
            doc = sequence_ids(cu_seqlens.to(q.device), T)
            mask_TT = mask_TT & (doc[:, None] == doc[None, :])
        mask = mask_TT[None]
    p_BHTS = s_BHTS.masked_fill(~mask[:, None], float("-inf")).softmax(-1)
    return torch.einsum("bhts,bshv->bthv", p_BHTS, v.float()).to(q.dtype)


def mla_latent_attention(q: Tensor, latent: Tensor, kv_b_weight: Tensor, *, qk_nope_head_dim: int,
                         scale: float, mask: Tensor) -> Tensor:
    """Absorbed MLA over the latent cache; see kimik3.ops.mla.mla_latent_attention."""
    B, T, H, _ = q.shape
    N = qk_nope_head_dim
    C = kv_b_weight.shape[1]
    w_HXC = kv_b_weight.float().view(H, -1, C)
    w_kb_HNC, w_vb_HVC = w_HXC[:, :N], w_HXC[:, N:]
    c_BSC, k_r_BSR = latent.float().split([C, latent.shape[-1] - C], dim=-1)
    # fold the key up-projection into the query: q_nope . (W_kb c) = (W_kb^T q_nope) . c
    q_lat_BTHC = torch.einsum("bthn,hnc->bthc", q[..., :N].float(), w_kb_HNC)
    s_BHTS = torch.einsum("bthc,bsc->bhts", q_lat_BTHC, c_BSC) + torch.einsum("bthr,bsr->bhts", q[..., N:].float(),
                                                                             k_r_BSR)
    p_BHTS = (s_BHTS * scale).masked_fill(~mask[:, None], float("-inf")).softmax(-1)
    # and the value up-projection into the output: sum_s p W_vb c_s = W_vb (sum_s p c_s)
    o_lat_BTHC = torch.einsum("bhts,bsc->bthc", p_BHTS, c_BSC)
    return torch.einsum("bthc,hvc->bthv", o_lat_BTHC, w_vb_HVC).to(q.dtype)
