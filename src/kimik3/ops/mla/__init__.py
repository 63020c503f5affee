"""MLA attention: expanded (prefill, training) and absorbed latent (decode); SDPA / bf16 fast paths on CUDA."""

from __future__ import annotations

from torch import Tensor

from kimik3.ops.backend import use_fast
from kimik3.ops.mla import fast, reference


def mla_attention(q: Tensor, k: Tensor, v: Tensor, *, scale: float, cu_seqlens: Tensor | None = None,
                  mask: Tensor | None = None) -> Tensor:
    """Multi-head attention over expanded keys and values: causal, or under an explicit mask.

    Args:
        q: [B, T, H, K]; k: [B, S, H, K]; v: [B, S, H, V] (any float dtype; math in fp32). S == T unless `mask`.
        scale: softmax scale (K3: 192**-0.5, no mscale).
        cu_seqlens: optional [N+1] int document boundaries of one packed row (B == 1).
        mask: optional [B, T, S] bool, True where a query may attend a key; replaces the causal mask (a prefill
            over a cache: S cached + new positions). Every query must see at least one key.

    Returns:
        [B, T, H, V] in `q.dtype`.
    """
    impl = fast.mla_attention if use_fast(q) else reference.mla_attention
    return impl(q, k, v, scale=scale, cu_seqlens=cu_seqlens, mask=mask)


def mla_latent_attention(q: Tensor, latent: Tensor, kv_b_weight: Tensor, *, qk_nope_head_dim: int,
                         scale: float, mask: Tensor) -> Tensor:
    """Attention of new queries over the MLA latent cache, up-projections absorbed (no per-head K/V).

    Args:
        q: [B, T, H, N+R] queries as produced by q_b_proj (per head: N nope dims, then R shared-key dims).
        latent: [B, S, C+R] cache rows: kv_a_layernorm(c) (C) then the shared key k_r (R).
        kv_b_weight: [H*(N+V), C] the kv_b_proj weight (per head: N key rows, then V value rows).
        qk_nope_head_dim: N.
        scale: softmax scale ((N+R)**-0.5).
        mask: [B, T, S] bool, True where a query may attend a cached position.

    Returns:
        [B, T, H, V] in `q.dtype`; equal to expanded attention with K = [W_kb c ; k_r], V = W_vb c.
    """
    impl = fast.mla_latent_attention if use_fast(q) else reference.mla_latent_attention
    return impl(q, latent, kv_b_weight, qk_nope_head_dim=qk_nope_head_dim, scale=scale, mask=mask)
