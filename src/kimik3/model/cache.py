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
