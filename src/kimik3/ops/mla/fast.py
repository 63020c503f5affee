"""MLA on CUDA: SDPA for expanded prefill attention, bf16 batched matmuls for absorbed latent decode.

Legend: B batch, T new tokens, S cached positions, H heads, N nope dim, R shared-key dim, C latent rank,
V value dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

MASKED_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]  # MATH: where efficient takes no input


def mla_attention(q: Tensor, k: Tensor, v: Tensor, *, scale: float, cu_seqlens: Tensor | None = None,
                  mask: Tensor | None = None) -> Tensor:
    """SDPA (qk 192 / v 128): causal per packed document (cuDNN), or under an explicit mask (memory-efficient);
    reference contract."""
    q_BHTK, k_BHSK, v_BHSV = (x.transpose(1, 2) for x in (q, k, v))
    if mask is not None:  # queries over a cache: the [B, T, S] mask broadcast over heads
        # the memory-efficient kernel, not the default cuDNN one: the engine's steps are ragged (sequences, rows
        # and key span change every step) and cuDNN builds a plan at each new shape, seconds on the requests'
        # critical path, where the efficient kernel's first call takes milliseconds (BENCHMARKS.md, "Measurements
        # behind code choices"; flash takes no mask)
        with sdpa_kernel(MASKED_BACKENDS):
            o = F.scaled_dot_product_attention(q_BHTK, k_BHSK, v_BHSV, attn_mask=mask[:, None], scale=scale)
        return o.transpose(1, 2)
    if cu_seqlens is None:
        o = F.scaled_dot_product_attention(q_BHTK, k_BHSK, v_BHSV, is_causal=True, scale=scale)
        return o.transpose(1, 2)
    # packed documents: one causal call per document (the boundaries are read on the host once)
    bounds = cu_seqlens.tolist()
    outs = [F.scaled_dot_product_attention(q_BHTK[:, :, a:b], k_BHSK[:, :, a:b], v_BHSV[:, :, a:b], is_causal=True,
                                           scale=scale) for a, b in zip(bounds, bounds[1:]) if b > a]
    return torch.cat(outs, dim=2).transpose(1, 2)


def mla_latent_attention(q: Tensor, latent: Tensor, kv_b_weight: Tensor, *, qk_nope_head_dim: int,
                         scale: float, mask: Tensor) -> Tensor:
    """Absorbed attention over the latent cache in the compute dtype (fp32 softmax); reference contract.

    The T*H query rows of a batch row share its one latent row per position (the keys are [c ; k_r] for every
    head), so each batch row is one plain matmul of [T*H, C+R] by [C+R, S]: the cache is read once, never
    copied per head (a broadcast matmul over a head axis would materialize H copies of it)."""
    B, T, H, _ = q.shape
    N, C = qk_nope_head_dim, kv_b_weight.shape[1]
    S = latent.shape[1]
    w_HXC = kv_b_weight.view(H, -1, C)
    q_lat_BTHC = torch.einsum("bthn,hnc->bthc", q[..., :N], w_HXC[:, :N])
    q_cat_BMX = torch.cat([q_lat_BTHC, q[..., N:]], dim=-1).reshape(B, T * H, -1)  # M = T*H query rows, X = C+R
    s_BTHS = torch.bmm(q_cat_BMX, latent.transpose(1, 2)).float().view(B, T, H, S) * scale
    p_BMS = s_BTHS.masked_fill(~mask[:, :, None], float("-inf")).softmax(-1).to(q.dtype).view(B, T * H, S)
    o_lat_BTHC = torch.bmm(p_BMS, latent[..., :C]).view(B, T, H, C)
    return torch.einsum("bthc,hvc->bthv", o_lat_BTHC, w_HXC[:, N:])
