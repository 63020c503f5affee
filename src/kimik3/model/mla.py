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

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from kimik3.config import TextConfig
from kimik3.model.norm import RMSNorm
from kimik3.model.state import MLAStateSpec, MLAView
from kimik3.model.step import Step
from kimik3.ops.mla import mla_attention, paged_latent_attention


@dataclass
class LatentUpdates:
    """Low-rank updates of kv_b_proj served per sequence (LoRA adapters: `kimik3.lora.serving` sets a layer's
    `kv_b_updates`): under adapter k the weight is W + B[k] @ A[k] (its scale folded into B). `index()` gives the
    adapter of each token row of the running step ([T] int64, -1: none), or None (no row has one).

    The cached attention applies them exactly on both of its paths: absorbed (short chunks), as one call per adapter
    over latents extended by A c with kv_b extended by B ([W | B] [c ; A c] = (W + B A) c: the keys' update folded
    into the queries, the values' applied after attention); expanded (long chunks), as B A c added per key.
    Legend: K adapters, R their largest rank, C latent rank, O = H*(N+V) kv_b's rows."""

    A: Tensor  # [K, R, C]
    B: Tensor  # [K, O, R]
    index: Callable[[], Tensor | None]


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
        self.kv_b_updates: LatentUpdates | None = None  # served adapters' kv_b updates (the cached path only)

    def state_spec(self) -> MLAStateSpec:
        """What this layer keeps per token: the normed latent and the shared key."""
        return MLAStateSpec(self.kv_a_proj_with_mqa.out_features)

    def forward(self, x_BTD: Tensor, cu_seqlens: Tensor | None = None, state: MLAView | None = None,
                step: Step | None = None) -> Tensor | tuple[Tensor, None]:
        """Without state: expanded causal attention (training, packed documents), x [B, T, D] -> [B, T, D]. With
        this layer's `state` and a `step`: `cached` (a pair, as KDA's: the output, None)."""
        if state is not None:
            return self.cached(x_BTD, state, step)
        q_BTHK, c_BTC, k_r_BTR = self._project(x_BTD)
        k_BTHK, v_BTHV = self._expand(c_BTC, k_r_BTR)
        o_BTHV = mla_attention(q_BTHK, k_BTHK, v_BTHV, scale=self.cfg.softmax_scale, cu_seqlens=cu_seqlens)
        return self._out(o_BTHV, x_BTD)

    def cached(self, x_1TD: Tensor, pool: MLAView, step: Step) -> tuple[Tensor, None]:
        """The step's packed chunks [1, T, D] -> ([1, T, D], None: nothing beyond the pool). The new latents are
        written into their blocks, then each chunk attends over its sequence's cached keys (short chunks in the
        latent space, long ones expanded; see `Step`)."""
        q_BTHK, c_BTC, k_r_BTR = self._project(x_1TD)
        o_THV = self._cached(q_BTHK[0], torch.cat([c_BTC, k_r_BTR], dim=-1)[0], pool, step)
        return self._out(o_THV[None], x_1TD), None

    def _project(self, x_BTD: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(queries [B, T, H, N+R], normed latents [B, T, C], shared keys [B, T, R])."""
        m = self.cfg
        B, T, _ = x_BTD.shape
        q_BTHK = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BTD))).view(B, T, m.num_heads, m.qk_head_dim)
        c_BTC, k_r_BTR = self.kv_a_proj_with_mqa(x_BTD).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        return q_BTHK, self.kv_a_layernorm(c_BTC), k_r_BTR

    def _out(self, o_BTHV: Tensor, x_BTD: Tensor) -> Tensor:
        B, T = x_BTD.shape[:2]
        o_BTP = o_BTHV.reshape(B, T, -1) * torch.sigmoid(self.g_proj(x_BTD))
        return self.o_proj(o_BTP)

    def _cached(self, q_THK: Tensor, latent_TX: Tensor, pool: MLAView, step: Step) -> Tensor:
        """[T, H, V]: the packed chunks over the paged latent pool."""
        m = self.cfg
        pool.latent.index_copy_(0, step.write_index, latent_TX)
        kw = dict(block_tables_NM=step.short_tables, cu_seqlens_q=step.short_cu, seq_lens_N=step.short_lens,
                  block_size=step.block_size, qk_nope_head_dim=m.qk_nope_head_dim, scale=m.softmax_scale,
                  max_seq_len=step.short_max_len)
        # the served adapter of each row (None: none in this step), of each short sequence, of each long chunk
        index_T = self.kv_b_updates.index() if self.kv_b_updates is not None else None
        if step.long is None:
            return self._absorbed(q_THK, pool.latent, kw, None if index_T is None else index_T[step.short_cu[:-1]])
        o_THV = q_THK.new_empty(q_THK.shape[0], m.num_heads, m.v_head_dim)
        if step.num_short:
            rows = step.short_rows
            short = None if index_T is None else index_T[rows][step.short_cu[:-1]]
            o_THV[rows] = self._absorbed(q_THK[rows], pool.latent, kw, short)
        lc = step.long
        # rows past a chunk's keys may be stale (or NaN-poisoned in tests): zeroed, as 0 * NaN would leak
        lat_NSX = torch.where(lc.key_valid[..., None], pool.latent[lc.key_index], 0)
        c_NSC, k_r_NSR = lat_NSX.split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        k_NSHK, v_NSHV = self._expand(c_NSC, k_r_NSR, None if index_T is None else
                                      self._key_updates(c_NSC, index_T[lc.rows[lc.q_index[:, 0]]]))
        o_NJHV = mla_attention(q_THK[lc.rows][lc.q_index], k_NSHK, v_NSHV, scale=m.softmax_scale, mask=lc.mask)
        o_THV[lc.rows] = o_NJHV.flatten(0, 1)[lc.unpack]
        return o_THV

    def _absorbed(self, q_THK: Tensor, latent_XC: Tensor, kw: dict, adapters_N: Tensor | None) -> Tensor:
        """Absorbed attention of the short chunks ([T, H, V]); with served updates (`adapters_N`: each sequence's
        adapter), one call per adapter among them (`LatentUpdates`)."""
        kv_b = self._kv_b_weight()
        if adapters_N is None:
            return paged_latent_attention(q_THK, latent_XC, kv_b, **kw)
        m, u, cu = self.cfg, self.kv_b_updates, kw["cu_seqlens_q"]
        o_THV = q_THK.new_empty(q_THK.shape[0], m.num_heads, m.v_head_dim)
        for a in adapters_N.unique().tolist():  # served adapters run eagerly: a host read per layer is allowed
            sel = (adapters_N == a).nonzero()[:, 0]
            q_lens = (cu[1:] - cu[:-1])[sel]
            firsts = q_lens.cumsum(0) - q_lens
            rows = torch.repeat_interleave(cu[:-1][sel] - firsts, q_lens) + torch.arange(int(q_lens.sum()),
                                                                                         device=cu.device)
            sub = {**kw, "block_tables_NM": kw["block_tables_NM"][sel], "seq_lens_N": kw["seq_lens_N"][sel],
                   "cu_seqlens_q": torch.cat([q_lens.new_zeros(1), q_lens.cumsum(0)])}
            if a < 0:
                o_THV[rows] = paged_latent_attention(q_THK[rows], latent_XC, kv_b, **sub)
                continue
            # the sequences' blocks only, in a pool of their own: [c ; A c ; k_r] per position
            blocks, tables = sub["block_tables_NM"].unique(return_inverse=True)
            Bs = kw["block_size"]
            c_XC, k_r_XR = latent_XC[(blocks[:, None] * Bs + torch.arange(Bs, device=blocks.device)).flatten()].split(
                [m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
            ext = torch.cat([c_XC, c_XC @ u.A[a].T.to(c_XC.dtype), k_r_XR], dim=-1)
            o_THV[rows] = paged_latent_attention(q_THK[rows], ext, torch.cat([kv_b, u.B[a].to(kv_b.dtype)], dim=1),
                                                 **{**sub, "block_tables_NM": tables})
        return o_THV

    def _key_updates(self, c_NSC: Tensor, adapters_N: Tensor) -> Tensor:
        """[N, S, O]: B A c of each long chunk's keys under its adapter (zero for none)."""
        u = self.kv_b_updates
        on = adapters_N >= 0
        pick = adapters_N.clamp(min=0)
        a_NRC = u.A[pick].to(c_NSC.dtype) * on[:, None, None]
        return torch.einsum("nsr,nor->nso", torch.einsum("nsc,nrc->nsr", c_NSC, a_NRC), u.B[pick].to(c_NSC.dtype))

    def _kv_b_weight(self) -> Tensor:
        """kv_b_proj's weight as the latent attention absorbs it (no module forward runs): with a LoRA adapter on it
        (`kimik3.lora.LoraLinear`, which has `delta`) the adapter's update merged in, in fp32, then rounded."""
        w = self.kv_b_proj.weight
        delta = getattr(self.kv_b_proj, "delta", None)
        return w if delta is None else (w.float() + delta()).to(w.dtype)

    def _expand(self, c_BSC: Tensor, k_r_BSR: Tensor, update_BSO: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Per-head keys [k_n ; k_r] [B, S, H, N+R] and values [B, S, H, V] from normed latents and shared keys
        (`update_BSO`: a served adapter's B A c, added to kv_b's output)."""
        m = self.cfg
        B, S, _ = c_BSC.shape
        H, N, R, V = m.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        kv_BSO = self.kv_b_proj(c_BSC) if update_BSO is None else self.kv_b_proj(c_BSC) + update_BSO
        k_n_BSHN, v_BSHV = kv_BSO.view(B, S, H, N + V).split([N, V], dim=-1)
        return torch.cat([k_n_BSHN, k_r_BSR.unsqueeze(2).expand(B, S, H, R)], dim=-1), v_BSHV
