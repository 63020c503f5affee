"""Causal softmax attention for MLA prefill (expanded per-head K/V). Reference, fp32 math.

Legend: B batch, T tokens, H heads, K query/key head dim (192), V value head dim (128).
With `cu_seqlens` (B == 1) the mask is block-diagonal causal: no token sees another document.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kimik3.ops.rows import in_row_groups
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


def query_rows(cu_seqlens_q: Tensor, seq_lens_N: Tensor, T: int) -> tuple[Tensor, Tensor]:
    """(seq_T, kv_len_T): the sequence of each packed query row and how many keys it sees (its position + 1).

    Row j of sequence n's q_n queries sits at position seq_lens[n] - q_n + j. Device ops only (no host sync), so
    the fast path shares it inside a CUDA graph."""
    cu = cu_seqlens_q.to(torch.int64)
    t_T = torch.arange(T, device=cu.device)
    seq_T = torch.searchsorted(cu[1:], t_T, right=True)
    kv_len_T = seq_lens_N.to(torch.int64)[seq_T] - cu[seq_T + 1] + t_T + 1
    return seq_T, kv_len_T


def paged_latent_attention(q_THK: Tensor, latent_pool_XC: Tensor, kv_b_weight: Tensor, *, block_tables_NM: Tensor,
                           cu_seqlens_q: Tensor, seq_lens_N: Tensor, block_size: int, qk_nope_head_dim: int,
                           scale: float, max_seq_len: int | None = None) -> Tensor:
    """Absorbed MLA of packed queries over a paged latent cache; see kimik3.ops.mla.paged_latent_attention.

    Gathers each sequence's rows through its block table over max(seq_lens) positions only (S below, whole blocks),
    zeroes those past its length (they may hold stale or NaN rows: 0 * NaN would reach the output), then the math
    of `mla_latent_attention` per query row. The probabilities times the values are summed block by block in a
    fixed order (a block's product, then the blocks one after another), so a row's output does not depend on how
    far the step's other sequences reach: one product over the whole span blocks its sum by the span's length,
    and a row's last bits then changed with the batch it ran in (in bf16, another greedy token)."""
    T, H, _ = q_THK.shape
    N, C, bs = qk_nope_head_dim, kv_b_weight.shape[1], block_size
    S = int(seq_lens_N.max()) if max_seq_len is None else max_seq_len
    S = min(-(-S // bs) * bs, block_tables_NM.shape[1] * bs)
    pos_S = torch.arange(S, device=q_THK.device)
    rows_NS = block_tables_NM.to(torch.int64)[:, pos_S // bs] * bs + pos_S % bs
    seq_T, kv_len_T = query_rows(cu_seqlens_q.to(q_THK.device), seq_lens_N.to(q_THK.device), T)
    live_NS = pos_S[None] < seq_lens_N.to(q_THK.device)[:, None]
    latent_NSX = latent_pool_XC[rows_NS].float().masked_fill(~live_NS[..., None], 0.0)
    c_NSC, k_r_NSR = latent_NSX.split([C, latent_NSX.shape[-1] - C], dim=-1)
    w_HXC = kv_b_weight.float().view(H, -1, C)
    # the products over the T query rows in fixed groups (`in_row_groups`): a row's result is the same in any step
    q_lat_THC = in_row_groups(lambda q: torch.einsum("thn,hnc->thc", q, w_HXC[:, :N]), q_THK[..., :N].float())
    s_THS = (torch.einsum("thc,tsc->ths", q_lat_THC, c_NSC[seq_T])
             + torch.einsum("thr,tsr->ths", q_THK[..., N:].float(), k_r_NSR[seq_T])) * scale
    mask_TS = pos_S[None] < kv_len_T[:, None]
    p_THS = s_THS.masked_fill(~mask_TS[:, None], float("-inf")).softmax(-1)
    nb = S // bs  # blocks: a block past a row's keys adds exact zeros
    o_THbC = torch.einsum("thbs,tbsc->thbc", p_THS.view(T, H, nb, bs), c_NSC[seq_T].view(T, nb, bs, C))
    o_lat_THC = o_THbC.cumsum(2)[:, :, -1]  # cumsum adds the blocks in order (a sum would pair them by their count)
    return in_row_groups(lambda o: torch.einsum("thc,hvc->thv", o, w_HXC[:, N:]), o_lat_THC).to(q_THK.dtype)
