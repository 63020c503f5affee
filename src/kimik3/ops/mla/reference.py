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



def paged_latent_attention(q_THK: Tensor, latent_pool_XC: Tensor, kv_b_weight: Tensor, *, block_tables_NM: Tensor,
                           cu_seqlens_q: Tensor, seq_lens_N: Tensor, block_size: int, qk_nope_head_dim: int,
                           scale: float, max_seq_len: int | None = None, attend=None) -> Tensor:
    """Absorbed latent attention of packed queries over a paged latent cache; see kimik3.ops.mla. The reference
    gathers each sequence's keys up to the longest length (not the whole block table), pads the queries to
    [N, Tq] and runs `attend` (default: the reference `mla_latent_attention`) under the causal mask."""
    T, H, _ = q_THK.shape
    N = seq_lens_N.shape[0]
    if N == 0:
        return q_THK.new_zeros(T, H, kv_b_weight.shape[0] // H - qk_nope_head_dim)
    S = int(seq_lens_N.max()) if max_seq_len is None else max_seq_len
    device = q_THK.device
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    tq = T if N == 1 else (1 if T == N else int(q_lens.max()))
    s = torch.arange(S, device=device)
    blocks_NS = block_tables_NM.gather(1, (s // block_size).clamp(max=block_tables_NM.shape[1] - 1).expand(N, -1))
    valid_NS = s[None] < seq_lens_N[:, None]
    # rows past a sequence's length may be stale or NaN: zeroed, as 0 * NaN in the value product would leak
    lat_NSX = torch.where(valid_NS[..., None], latent_pool_XC[blocks_NS * block_size + s % block_size], 0)
    j = torch.arange(tq, device=device)
    q_valid = j[None] < q_lens[:, None]
    q_index = torch.where(q_valid, cu_seqlens_q[:-1, None] + j, cu_seqlens_q[:-1, None])
    qpos_NJ = seq_lens_N[:, None] - q_lens[:, None] + j
    mask = valid_NS[:, None] & (s[None, None] <= qpos_NJ[..., None])
    mask = torch.where(q_valid[..., None], mask, s[None, None] == 0)  # padding queries: key 0, finite
    o_NJHV = (attend or mla_latent_attention)(q_THK[q_index], lat_NSX, kv_b_weight,
                                              qk_nope_head_dim=qk_nope_head_dim, scale=scale, mask=mask)
    if tq == 1:
        return o_NJHV[:, 0]
    seq = torch.repeat_interleave(torch.arange(N, device=device), q_lens, output_size=T)
    return o_NJHV.flatten(0, 1)[seq * tq + torch.arange(T, device=device) - cu_seqlens_q[seq]]
