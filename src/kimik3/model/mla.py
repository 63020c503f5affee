"""Gated NoPE multi-head latent attention (MLA) layer.

Legend: B batch, T tokens, D hidden, H heads, C kv latent rank, R shared-key width ("rope" slot, never rotated),
N qk_nope head dim, V value head dim, Q q latent rank.

    q        = q_b( q_a_layernorm( q_a(x) ) )               [B, T, H, N+R]
    c, k_r   = split( kv_a_proj_with_mqa(x) )               [B, T, C], [B, T, R] (one key slot shared by heads)
    k_n, v   = split( kv_b( kv_a_layernorm(c) ) )           [B, T, H, N], [B, T, H, V]
    o        = causal_softmax( q [k_n ; k_r] / sqrt(N+R) ) v
    out      = o_proj( o * sigmoid(g_proj x) )              gate in the compute dtype, before o_proj
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kimik3.config import TextConfig
from kimik3.model.cache import CacheStep, MLALatents, MLAPool, PagedStep
from kimik3.model.norm import RMSNorm
from kimik3.ops.mla import mla_attention, mla_latent_attention

# New tokens per step from which a cached step expands the latents to per-head K/V instead of attending in the
# latent space. Per head and key, absorbed attention costs (C+R) + C = 1088 MACs per query and expanded
# (N+R) + V = 320, plus C*(N+V) = 131k once per key for the expansion: equal at ~170 queries for K3's dims.
# Below that the absorbed scores ([B, T*H, S] fp32) stay small; from there SDPA never materializes them.
EXPANDED_FROM_TOKENS = 128


class MultiHeadLatentAttention(nn.Module):
    def __init__(self, cfg: TextConfig, dtype: torch.dtype | None = None):
        super().__init__()
        c, D = cfg.mla, cfg.hidden_size
        self.cfg = c
        H = c.num_heads
        self.q_a_proj = nn.Linear(D, c.q_lora_rank, bias=False, dtype=dtype)
        self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.latent_norm_eps, dtype)
        self.q_b_proj = nn.Linear(c.q_lora_rank, H * c.qk_head_dim, bias=False, dtype=dtype)
        self.kv_a_proj_with_mqa = nn.Linear(D, c.kv_lora_rank + c.qk_rope_head_dim, bias=False, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.latent_norm_eps, dtype)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, H * (c.qk_nope_head_dim + c.v_head_dim), bias=False, dtype=dtype)
        self.g_proj = nn.Linear(D, H * c.v_head_dim, bias=False, dtype=dtype)
        self.o_proj = nn.Linear(H * c.v_head_dim, D, bias=False, dtype=dtype)

    def forward(self, x_BTD: Tensor, cu_seqlens: Tensor | None = None, cache: MLALatents | None = None,
                step: CacheStep | None = None) -> Tensor:
        """x [B, T, D] -> [B, T, D]. Without a cache: expanded causal attention (prefill, training).
        With `cache`: append the new latents and attend over the cache, with the up-projections absorbed for
        fewer than EXPANDED_FROM_TOKENS new tokens (decode), else through per-head K/V expanded from it."""
        c = self.cfg
        B, T, _ = x_BTD.shape
        H, N, R, V = c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        q_BTHK = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BTD))).view(B, T, H, N + R)
        c_BTC, k_r_BTR = self.kv_a_proj_with_mqa(x_BTD).split([c.kv_lora_rank, R], dim=-1)
        c_BTC = self.kv_a_layernorm(c_BTC)
        if isinstance(step, PagedStep):
            o_BTHV = self._paged(q_BTHK[0], torch.cat([c_BTC, k_r_BTR], dim=-1)[0], cache, step)[None]
        elif cache is not None:
            cache.latent.index_copy_(1, step.positions, torch.cat([c_BTC, k_r_BTR], dim=-1))
            span = step.mla_mask.shape[-1]
            latent_BSX = cache.latent[:, :span]
            if T < EXPANDED_FROM_TOKENS:  # decode: attend in the latent space, nothing expanded per head
                o_BTHV = mla_latent_attention(q_BTHK, latent_BSX, self.kv_b_proj.weight, qk_nope_head_dim=N,
                                              scale=c.softmax_scale, mask=step.mla_mask)
            else:  # a prefill over the cache: expand the cached latents once, SDPA under the cache mask
                k_BSHK, v_BSHV = self._expand(*latent_BSX.split([c.kv_lora_rank, R], dim=-1))
                o_BTHV = mla_attention(q_BTHK, k_BSHK, v_BSHV, scale=c.softmax_scale, mask=step.mla_mask)
        else:
            k_BTHK, v_BTHV = self._expand(c_BTC, k_r_BTR)
            o_BTHV = mla_attention(q_BTHK, k_BTHK, v_BTHV, scale=c.softmax_scale, cu_seqlens=cu_seqlens)
        o_BTP = o_BTHV.reshape(B, T, H * V) * torch.sigmoid(self.g_proj(x_BTD))
        return self.o_proj(o_BTP)

    def _paged(self, q_THK: Tensor, latent_TX: Tensor, pool: MLAPool, step: PagedStep) -> Tensor:
        """The engine's packed sequences over the paged latent pool: write the new latents into their blocks,
        gather each sequence's keys through its block table, attend per sequence (padded to [N, Tq]).
        Returns [T, H, V]."""
        c = self.cfg
        pool.latent.index_copy_(0, step.write_index, latent_TX)
        # rows past a sequence's length may be stale (or NaN-poisoned in tests): zero them, as 0 * NaN in the
        # value product would otherwise leak through the masked softmax weights
        lat_NSX = torch.where(step.key_valid[..., None], pool.latent[step.key_index], 0)
        q_NTHK = q_THK[step.q_index]
        if step.expanded:
            k_NSHK, v_NSHV = self._expand(*lat_NSX.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1))
            o_NTHV = mla_attention(q_NTHK, k_NSHK, v_NSHV, scale=c.softmax_scale, mask=step.mla_mask)
        else:
            o_NTHV = mla_latent_attention(q_NTHK, lat_NSX, self.kv_b_proj.weight, qk_nope_head_dim=c.qk_nope_head_dim,
                                          scale=c.softmax_scale, mask=step.mla_mask)
        return o_NTHV.flatten(0, 1)[step.unpack]

    def _expand(self, c_BSC: Tensor, k_r_BSR: Tensor) -> tuple[Tensor, Tensor]:
        """Per-head keys [k_n ; k_r] [B, S, H, N+R] and values [B, S, H, V] from normed latents and shared keys."""
        c = self.cfg
        B, S, _ = c_BSC.shape
        H, N, R, V = c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        k_n_BSHN, v_BSHV = self.kv_b_proj(c_BSC).view(B, S, H, N + V).split([N, V], dim=-1)
        return torch.cat([k_n_BSHN, k_r_BSR.unsqueeze(2).expand(B, S, H, R)], dim=-1), v_BSHV
