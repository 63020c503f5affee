"""MLA on CUDA: SDPA for expanded prefill attention, bf16 batched matmuls for absorbed latent decode.

Legend: B batch, T new tokens, S cached positions, H heads, N nope dim, R shared-key dim, C latent rank,
V value dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def mla_attention(q: Tensor, k: Tensor, v: Tensor, *, scale: float, cu_seqlens: Tensor | None = None) -> Tensor:
    """SDPA (flash/cuDNN, qk 192 / v 128) per packed document; same contract as the reference."""
    q_BHTK, k_BHTK, v_BHTV = (x.transpose(1, 2) for x in (q, k, v))
    if cu_seqlens is None:
        o = F.scaled_dot_product_attention(q_BHTK, k_BHTK, v_BHTV, is_causal=True, scale=scale)
        return o.transpose(1, 2)
    # packed documents: one causal call per document (the boundaries are read on the host once)
    bounds = cu_seqlens.tolist()
    outs = [F.scaled_dot_product_attention(q_BHTK[:, :, a:b], k_BHTK[:, :, a:b], v_BHTV[:, :, a:b], is_causal=True,
                                           scale=scale) for a, b in zip(bounds, bounds[1:]) if b > a]
    return torch.cat(outs, dim=2).transpose(1, 2)


def mla_latent_attention(q: Tensor, latent: Tensor, kv_b_weight: Tensor, *, qk_nope_head_dim: int,
                         scale: float, mask: Tensor) -> Tensor:
    """Absorbed attention over the latent cache in the compute dtype (fp32 softmax); reference contract."""
    B, T, H, _ = q.shape
    N, C = qk_nope_head_dim, kv_b_weight.shape[1]
    w_HXC = kv_b_weight.view(H, -1, C)
    c_BSC, k_r_BSR = latent[..., :C], latent[..., C:]
    q_lat_BHTC = torch.einsum("bthn,hnc->bhtc", q[..., :N], w_HXC[:, :N])
    q_r_BHTR = q[..., N:].transpose(1, 2)
    # one matmul over the concatenated [latent | shared key] row: 576 wide for K3
    q_cat_BHTX = torch.cat([q_lat_BHTC, q_r_BHTR], dim=-1)
    s_BHTS = torch.matmul(q_cat_BHTX, torch.cat([c_BSC, k_r_BSR], -1).transpose(1, 2)[:, None]).float() * scale
    p_BHTS = s_BHTS.masked_fill(~mask[:, None], float("-inf")).softmax(-1).to(q.dtype)
    o_lat_BHTC = torch.matmul(p_BHTS, c_BSC[:, None])
    return torch.einsum("bhtc,hvc->bthv", o_lat_BHTC, w_HXC[:, N:])
