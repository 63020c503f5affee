"""MLA attention: expanded (prefill, training), absorbed latent (decode) over a gathered cache, and absorbed over
the paged cache itself; SDPA / bf16 / Triton fast paths on CUDA."""

from __future__ import annotations

from torch import Tensor

from kimik3.ops.backend import has_triton, use_fast
from kimik3.ops.mla import fast, reference

# New tokens of a chunk from which a cached step expands the latents to per-head K/V instead of attending in the
# latent space. Per head and key, absorbed attention costs (C+R) + C = 1088 MACs per query and expanded
# (N+R) + V = 320, plus C*(N+V) = 131k once per key for the expansion: equal at ~170 queries for K3's dims.
EXPANDED_FROM_TOKENS = 128


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
    impl = fast.mla_attention if use_fast(q, "mla") else reference.mla_attention
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
    impl = fast.mla_latent_attention if use_fast(q, "mla") else reference.mla_latent_attention
    return impl(q, latent, kv_b_weight, qk_nope_head_dim=qk_nope_head_dim, scale=scale, mask=mask)


def paged_latent_attention(q_THK: Tensor, latent_pool_XC: Tensor, kv_b_weight: Tensor, *, block_tables_NM: Tensor,
                           cu_seqlens_q: Tensor, seq_lens_N: Tensor, block_size: int, qk_nope_head_dim: int,
                           scale: float, max_seq_len: int | None = None) -> Tensor:
    """Absorbed latent attention of packed queries over a paged latent cache.

    Legend: T packed query tokens, N sequences, H heads, K = N_nope + R query width, C latent rank, R shared-key
    width, X pool rows (= blocks * block_size), M blocks per table, V value head dim.

    Args:
        q_THK: [T, H, N_nope+R] queries of N sequences packed (sequence n's are rows cu_seqlens_q[n]:cu_seqlens_q[n+1]).
        latent_pool_XC: [X, C+R] the layer's latent pool: row b*block_size + i holds position i of block b
            (kv_a_layernorm(c) | k_r).
        kv_b_weight: [H*(N_nope+V), C] (kv_b_proj.weight), absorbed into the queries and the output.
        block_tables_NM: [N, M] int32/int64 block ids of each sequence (entries past its blocks: any valid id).
        cu_seqlens_q: [N+1] int query row boundaries.
        seq_lens_N: [N] keys of each sequence (cached + new; the new tokens' latents already in the pool).
        block_size: positions per block (a power of two).
        qk_nope_head_dim: N_nope.
        scale: softmax scale.
        max_seq_len: host upper bound on seq_lens (the reference gathers that span, the kernel sizes its grid by
            it; given, the fast path has no host sync); None = max(seq_lens), read on the host.

    Causality: sequence n's j-th query (of its q_n) sits at position seq_lens[n] - q_n + j and sees keys 0..that
    position (so every query sees >= 1 key). Pool rows at positions >= seq_len never reach the output (stale or NaN).

    Returns:
        [T, H, V] in q's dtype. On CUDA tensors (unless `use_backend("torch")`) a split-K Triton kernel reads only
        each sequence's live blocks (`paged_triton`); elsewhere the reference gathers max(seq_lens) positions.
    """
    if block_size <= 0 or block_size & (block_size - 1):
        raise ValueError(f"paged_latent_attention: block_size must be a power of two, got {block_size}")
    if cu_seqlens_q.shape != (seq_lens_N.shape[0] + 1,) or block_tables_NM.shape[0] != seq_lens_N.shape[0]:
        raise ValueError(f"paged_latent_attention: expected cu_seqlens_q [N+1] and block_tables [N, M] for seq_lens "
                         f"[N]; got {list(cu_seqlens_q.shape)}, {list(block_tables_NM.shape)}, "
                         f"{list(seq_lens_N.shape)}")
    kwargs = dict(block_tables_NM=block_tables_NM, cu_seqlens_q=cu_seqlens_q, seq_lens_N=seq_lens_N,
                  block_size=block_size, qk_nope_head_dim=qk_nope_head_dim, scale=scale, max_seq_len=max_seq_len)
    if use_fast(q_THK, "mla") and has_triton():
        from kimik3.ops.mla import paged_triton  # lazily: triton exists only on GPU machines

        return paged_triton.paged_latent_attention(q_THK, latent_pool_XC, kv_b_weight, **kwargs)
    return reference.paged_latent_attention(q_THK, latent_pool_XC, kv_b_weight, **kwargs)
