"""Inference caches: explicit state containers, allocated from `config.layer_types`, passed to the model.

Legend: B batch, S cached positions (max_length), T new tokens, H heads, K = V KDA head dim,
P = H*K KDA projection width, W conv window, C MLA latent rank, R shared-key width.

Per KDA layer: the last W-1 pre-conv inputs of q, k and v ([B, W-1, P] each) and the recurrent state
[B, H, K, V] fp32 -- a fixed size per sequence, whatever the context. Per MLA layer: the normalized latent
plus the shared key, [B, S, C+R] (576 wide for K3) per token; decode attends over it with the
up-projections absorbed, never expanding per-head K/V.
AttnRes needs no cache: it mixes over depth, per token, within one forward.

Ragged batches are LEFT-padded: `attention_mask` marks real tokens; pad positions are kept out of every
MLA softmax, leave the KDA state untouched (beta = 0, no decay) and feed zeros to the short convs, so each
row computes exactly what it would alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kimik3.config import TextConfig


@dataclass
class KDAState:
    conv_q: Tensor  # [B, W-1, P] compute dtype
    conv_k: Tensor
    conv_v: Tensor
    recurrent: Tensor  # [B, H, K, V] fp32


@dataclass
class MLALatents:
    latent: Tensor  # [B, S, C+R] compute dtype: kv_a_layernorm(c) | k_r


@dataclass(frozen=True)
class CacheStep:
    """Where the new tokens of one forward go, and what their MLA queries may see (device tensors only, so a
    CUDA graph can capture a decode step whose position changes between replays)."""

    positions: Tensor  # [T] int64 cache positions of the new tokens (the same for every row: left padding)
    valid: Tensor  # [B, T] bool, False for left padding
    mla_mask: Tensor  # [B, T, span] bool: real keys at or before each query (pads see only themselves)


class HybridCache:
    """All layers' inference state for a batch of B sequences of up to `max_length` tokens."""

    def __init__(self, cfg: TextConfig, batch_size: int, max_length: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        if batch_size < 1 or max_length < 1:
            raise ValueError(f"cache needs batch_size >= 1 and max_length >= 1, got {batch_size}, {max_length}")
        self.batch_size, self.max_length, self.length = batch_size, max_length, 0
        B, k, m = batch_size, cfg.kda, cfg.mla
        self.valid = torch.zeros(B, max_length, dtype=torch.bool, device=device)
        self.layers: list[KDAState | MLALatents] = []
        for kind in cfg.layer_types:
            if kind == "kda":
                tail = lambda: torch.zeros(B, k.short_conv_kernel_size - 1, k.proj_dim, dtype=dtype,  # noqa: E731
                                           device=device)
                state = torch.zeros(B, k.num_heads, k.head_dim, k.head_dim, dtype=torch.float32, device=device)
                self.layers.append(KDAState(tail(), tail(), tail(), state))
            else:
                width = m.kv_lora_rank + m.qk_rope_head_dim
                self.layers.append(MLALatents(torch.zeros(B, max_length, width, dtype=dtype, device=device)))

    def advance(self, num_new: int, attention_mask: Tensor | None = None) -> CacheStep:
        """Reserve the next `num_new` positions of every row and build their step (eager use)."""
        start, end = self.length, self.length + num_new
        if end > self.max_length:
            raise ValueError(f"the cache holds {self.max_length} tokens per sequence; {start} are used and "
                             f"{num_new} more were given")
        if attention_mask is not None and tuple(attention_mask.shape) != (self.batch_size, num_new):
            raise ValueError(f"attention_mask must be [batch, new tokens] = [{self.batch_size}, {num_new}], "
                             f"got {tuple(attention_mask.shape)}")
        self.length = end
        return self.make_step(torch.arange(start, end, device=self.valid.device), attention_mask, span=end)

    def make_step(self, positions: Tensor, attention_mask: Tensor | None, span: int) -> CacheStep:
        """The step for new tokens at device `positions` [T], attending over the first `span` cache rows.

        Device operations only (no host reads): a CUDA-graphed decode step calls it inside the capture with
        a positions buffer it refills before each replay, and span = max_length.
        """
        device = self.valid.device
        T = positions.shape[0]
        valid_BT = (torch.ones(self.batch_size, T, dtype=torch.bool, device=device) if attention_mask is None
                    else attention_mask.to(device=device, dtype=torch.bool))
        self.valid.index_copy_(1, positions, valid_BT)
        keys_S = torch.arange(span, device=device)
        causal_TS = keys_S[None, :] <= positions[:, None]
        mask_BTS = self.valid[:, None, :span] & causal_TS
        # a pad query sees only itself: its (ignored) output stays finite instead of a 0/0 softmax
        own_TS = keys_S[None, :] == positions[:, None]
        return CacheStep(positions, valid_BT, mask_BTS | (~valid_BT[:, :, None] & own_TS))

    def nbytes(self) -> dict[str, int]:
        """Bytes held, by kind: {"kda_state": ..., "kda_conv": ..., "mla_latent": ...}."""
        out = {"kda_state": 0, "kda_conv": 0, "mla_latent": 0}
        for layer in self.layers:
            if isinstance(layer, KDAState):
                out["kda_state"] += layer.recurrent.nbytes
                out["kda_conv"] += sum(t.nbytes for t in (layer.conv_q, layer.conv_k, layer.conv_v))
            else:
                out["mla_latent"] += layer.latent.nbytes
        return out


# Legend (besides the above): N sequences in a step, Ns KDA slots, Nb MLA blocks of Bs tokens, Tq the longest
# chunk of the step, Sk the key span of the step, E exported snapshots, MB blocks per block table.


@dataclass
class KDAPool:
    """One KDA layer's state for every slot: conv tails [Ns, W-1, P] (compute dtype), recurrent [Ns, H, K, V] fp32."""

    conv_q: Tensor
    conv_k: Tensor
    conv_v: Tensor
    recurrent: Tensor

    def tensors(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return self.recurrent, self.conv_q, self.conv_k, self.conv_v


@dataclass
class MLAPool:
    """One MLA layer's latents for every block: [Nb * Bs, C+R]; a sequence's block table maps its positions."""

    latent: Tensor


class PagedCache:
    """The engine's state pools, allocated from `config.layer_types`: KDA state by slot, MLA latents by block.

    Slots and blocks are handed out by the engine; the model only reads and writes the rows a `PagedStep`
    names. The last slot and the last block are scratch rows for the padding of CUDA-graphed decode steps.
    """

    def __init__(self, cfg: TextConfig, num_slots: int, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        if num_slots < 1 or num_blocks < 1 or block_size < 1:
            raise ValueError(f"a paged cache needs num_slots, num_blocks, block_size >= 1, got {num_slots}, "
                             f"{num_blocks}, {block_size}")
        self.num_slots, self.num_blocks, self.block_size = num_slots, num_blocks, block_size
        self.scratch_slot, self.scratch_block = num_slots, num_blocks
        k, m = cfg.kda, cfg.mla
        self.conv_window = k.short_conv_kernel_size
        self.layers: list[KDAPool | MLAPool] = []
        for kind in cfg.layer_types:
            if kind == "kda":
                tail = lambda: torch.zeros(num_slots + 1, k.short_conv_kernel_size - 1, k.proj_dim,  # noqa: E731
                                           dtype=dtype, device=device)
                state = torch.zeros(num_slots + 1, k.num_heads, k.head_dim, k.head_dim, dtype=torch.float32,
                                    device=device)
                self.layers.append(KDAPool(tail(), tail(), tail(), state))
            else:
                width = m.kv_lora_rank + m.qk_rope_head_dim
                self.layers.append(MLAPool(torch.zeros((num_blocks + 1) * block_size, width, dtype=dtype,
                                                       device=device)))
        self.kda = [p for p in self.layers if isinstance(p, KDAPool)]
        self.mla = [p for p in self.layers if isinstance(p, MLAPool)]

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot's state over all KDA layers (what one prefix snapshot costs)."""
        return sum(t[0].nbytes for p in self.kda for t in p.tensors())

    @property
    def block_bytes(self) -> int:
        """Bytes of one MLA block over all MLA layers."""
        return sum(p.latent[: self.block_size].nbytes for p in self.mla)


@dataclass
class PagedStep:
    """One engine step: the chunks of N sequences packed in one row [1, T] (device index tensors, built by
    `paged_step`). Sequence n owns KDA slot `slots[n]` and the MLA blocks of its block table."""

    decode_only: bool  # every chunk is one token: KDA runs its recurrent kernel over N rows
    expanded: bool  # MLA expands per-head K/V (chunks of EXPANDED_FROM_TOKENS or more) instead of absorbing
    cu_seqlens: Tensor  # [N+1] chunk boundaries in the packed row
    slots: Tensor  # [N]
    conv_index: Tensor  # [W, T] rows of cat(new pre-conv inputs [T], slot tails [N*(W-1)]) feeding each tap
    tail_index: Tensor  # [N, W-1] rows of the same that become each slot's new tail
    write_index: Tensor  # [T] latent pool rows of the new tokens
    q_index: Tensor  # [N, Tq] packed rows of each sequence's queries (padded with its first row)
    unpack: Tensor  # [T] rows of the flattened [N*Tq] outputs that are the packed tokens
    key_index: Tensor  # [N, Sk] latent pool rows of each sequence's keys
    key_valid: Tensor  # [N, Sk] bool
    mla_mask: Tensor  # [N, Tq, Sk] bool
    checkpoints: list[list[int]] | None = None  # per sequence: chunk offsets (< its length) to export inside
    export_tail_index: Tensor | None = None  # [E, W-1] conv-tail rows of each export
    export_pick: Tensor | None = None  # [E] rows of cat(interior checkpoints [M], final states [N])
    kda_exports: list[tuple[Tensor, Tensor, Tensor, Tensor]] | None = None  # filled per KDA layer, in order


def paged_step(*, total: int, slots: Tensor, starts: Tensor, lens: Tensor, cached: Tensor, block_tables: Tensor,
               block_size: int, conv_window: int, max_len: int, span: int, expanded_from: int,
               exports: list[list[int]] | None = None) -> PagedStep:
    """Build the index tensors of a step (device tensor math only, so a CUDA graph can capture it).

    Args:
        total: T, the packed tokens (the sum of lens).
        slots, starts, lens, cached: [N] int64: each sequence's KDA slot, the packed row of its first new
            token, its number of new tokens and the tokens it already has cached.
        block_tables: [N, MB] int64 MLA block ids (entries past a sequence's blocks: any valid id).
        max_len: the longest chunk (Tq); span: key positions to attend over (>= every cached + len).
        exports: per sequence, offsets from its chunk start (multiples of the KDA chunk, at most its length)
            where the KDA state (recurrent + conv tails) is exported into `step.kda_exports`.
    """
    device = slots.device
    N, W, T = slots.shape[0], conv_window, total
    seq_T = torch.repeat_interleave(torch.arange(N, device=device), lens, output_size=T)
    off_T = torch.arange(T, device=device) - starts[seq_T]

    def ext_rows(seq: Tensor, off: Tensor) -> Tensor:
        """Row in cat(new [T], tails [N*(W-1)]) of the pre-conv input at chunk offset `off` of sequence `seq`
        (negative offsets reach into the sequence's cached tail, oldest row first)."""
        return torch.where(off >= 0, starts[seq] + off, T + seq * (W - 1) + (W - 1) + off)

    taps = torch.arange(W, device=device)
    conv_index = ext_rows(seq_T[None], off_T[None] - (W - 1) + taps[:, None])
    rows = torch.arange(W - 1, device=device)
    tail_index = ext_rows(torch.arange(N, device=device)[:, None], lens[:, None] - (W - 1) + rows)

    pos_T = cached[seq_T] + off_T
    write_index = block_tables[seq_T, pos_T // block_size] * block_size + pos_T % block_size
    j = torch.arange(max_len, device=device)
    q_valid = j[None] < lens[:, None]
    q_index = torch.where(q_valid, starts[:, None] + j, starts[:, None])
    unpack = seq_T * max_len + off_T
    s = torch.arange(span, device=device)
    blocks = block_tables.gather(1, (s // block_size).clamp(max=block_tables.shape[1] - 1).expand(N, -1))
    key_index = blocks * block_size + s % block_size
    key_valid = s[None] < (cached + lens)[:, None]
    qpos = cached[:, None] + j
    mask = key_valid[:, None] & (s[None, None] <= qpos[..., None])
    # a padding query sees only key 0 (always real): its ignored output stays finite
    mask = torch.where(q_valid[..., None], mask, s[None, None] == 0)
    cu = torch.zeros(N + 1, dtype=torch.long, device=device)
    cu[1:] = lens.cumsum(0)
    step = PagedStep(decode_only=max_len == 1, expanded=max_len >= expanded_from, cu_seqlens=cu, slots=slots,
                     conv_index=conv_index, tail_index=tail_index, write_index=write_index, q_index=q_index,
                     unpack=unpack, key_index=key_index, key_valid=key_valid, mla_mask=mask)
    if exports is not None and any(exports):
        lens_host = lens.tolist()
        interior = [[o for o in offs if o < n] for offs, n in zip(exports, lens_host)]
        M, pick, e_seq, e_off = sum(map(len, interior)), [], [], []
        m = 0
        for n, offs in enumerate(exports):
            for o in offs:
                if not 0 < o <= lens_host[n]:
                    raise ValueError(f"export offset {o} is outside sequence {n}'s chunk of {lens_host[n]} tokens")
                pick.append(m if o < lens_host[n] else M + n)
                m += o < lens_host[n]
                e_seq.append(n)
                e_off.append(o)
        e_seq_t = torch.tensor(e_seq, device=device)
        e_off_t = torch.tensor(e_off, device=device)
        step.checkpoints = interior if M else None
        step.export_tail_index = ext_rows(e_seq_t[:, None], e_off_t[:, None] - (W - 1) + rows)
        step.export_pick = torch.tensor(pick, device=device)
        step.kda_exports = []
    return step
