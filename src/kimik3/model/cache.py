"""The explicit cache: B sequences over one `StatePool`, for calling the model by hand (docs/inference.md shows it).

    cache = model.new_cache(batch_size=2, max_length=4096)
    logits = model(ids_BT, cache=cache, attention_mask=mask_BT)   # row b appends its tokens where mask is 1
    logits = model(next_B1, cache=cache)                          # one (or more) new tokens per row

It is a convenience over the serving engine's state and step (the same pool, the same `Step`, the same layer
code): row b owns slot b and a fixed run of blocks. Tokens masked out (left padding, say) are simply not
appended; their logits rows are zeros. Legend: B rows, T new tokens per row, Bs block size, MB blocks per row.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kimik3.config import TextConfig
from kimik3.model.state import KDAStateSpec, MLAStateSpec, StatePool, state_specs
from kimik3.model.step import Step, build_step

BLOCK_SIZE = 64  # the engine's default block size (a divisor of the KDA chunk)


class Cache:
    def __init__(self, lm, batch_size: int, max_length: int):
        if batch_size < 1 or max_length < 1:
            raise ValueError(f"cache needs batch_size >= 1 and max_length >= 1, got {batch_size}, {max_length}")
        w = lm.lm_head.weight
        self.batch_size, self.max_length = batch_size, max_length
        self.blocks_per_row = -(-max_length // BLOCK_SIZE)
        self.pool = StatePool(state_specs(lm), batch_size, batch_size * self.blocks_per_row, BLOCK_SIZE, w.dtype,
                              w.device)
        self.lengths = [0] * batch_size

    @property
    def length(self) -> int:
        """The longest row's length."""
        return max(self.lengths)

    def step(self, lens: list[int]) -> tuple[Step | None, list[int]]:
        """Reserve `lens[b]` more positions of each row; the step of the rows with new tokens, and those rows."""
        for b, n in enumerate(lens):
            if self.lengths[b] + n > self.max_length:
                raise ValueError(f"the cache holds {self.max_length} tokens per sequence; row {b} has "
                                 f"{self.lengths[b]} and {n} more were given")
        rows = [b for b, n in enumerate(lens) if n]
        if not rows:
            return None, rows
        MB, Bs = self.blocks_per_row, BLOCK_SIZE
        tables = [list(range(b * MB, b * MB + -(-(self.lengths[b] + lens[b]) // Bs))) for b in rows]
        step = build_step(slots=rows, cached=[self.lengths[b] for b in rows], lens=[lens[b] for b in rows],
                          tables=tables, block_size=Bs, conv_window=self.pool.conv_window,
                          pad_block=self.pool.scratch_block, device=self.pool.device)
        for b in rows:
            self.lengths[b] += lens[b]
        return step, rows

    def nbytes(self) -> dict[str, int]:
        return self.pool.nbytes()


def cached_hidden(lm, input_ids: Tensor, cache: Cache, attention_mask: Tensor | None,
                  inputs_embeds: Tensor | None) -> Tensor:
    """The final hidden state [B, T, D] of `lm(input_ids, cache=...)`: each row's kept tokens packed into one
    step and run, then unpacked (zeros where the mask is 0, so the untied, bias-free head gives zero logits)."""
    B, T = input_ids.shape
    if B != cache.batch_size:
        raise ValueError(f"the cache was made for {cache.batch_size} rows, input_ids has {B}")
    if attention_mask is not None and tuple(attention_mask.shape) != (B, T):
        raise ValueError(f"attention_mask must be [batch, new tokens] = [{B}, {T}], got {tuple(attention_mask.shape)}")
    keep_BT = None if attention_mask is None else attention_mask.to(input_ids.device).bool()
    lens = [T] * B if keep_BT is None else keep_BT.sum(1).tolist()
    step, rows = cache.step(lens)
    if step is None:
        return lm.lm_head.weight.new_zeros(B, T, lm.config.hidden_size)
    keep = torch.zeros(B, T, dtype=torch.bool, device=input_ids.device)
    keep[rows] = True if keep_BT is None else keep_BT[rows]
    embeds = None if inputs_embeds is None else inputs_embeds[keep][None]
    h_TD = lm.model.cached(input_ids[keep][None], cache.pool, step, embeds)[0][0]
    out = h_TD.new_zeros(B, T, h_TD.shape[-1])
    out[keep] = h_TD
    return out


def config_state_specs(cfg: TextConfig) -> list[KDAStateSpec | MLAStateSpec]:
    """The layers' declared state, from the config alone (what the unsharded modules' `state_spec()` return)."""
    k, m = cfg.kda, cfg.mla
    return [KDAStateSpec(k.num_heads, k.head_dim, k.proj_dim, k.short_conv_kernel_size) if kind == "kda"
            else MLAStateSpec(m.kv_lora_rank + m.qk_rope_head_dim) for kind in cfg.layer_types]


def state_bytes(cfg: TextConfig, dtype: torch.dtype) -> dict[str, int]:
    """Per sequence: KDA recurrent state and conv tails over all KDA layers; per token: MLA latents over all MLA
    layers; and the layer counts (from a one-slot, one-row pool on the meta device)."""
    specs = config_state_specs(cfg)
    pool = StatePool(specs, 1, 1, 1, dtype, "meta")
    return {"kda_state_per_sequence": pool.recurrent[:, 0].nbytes, "kda_conv_per_sequence": pool.conv[:, :, 0].nbytes,
            "mla_latent_per_token": pool.latent[:, 0].nbytes,
            "kda_layers": sum(isinstance(s, KDAStateSpec) for s in specs),
            "mla_layers": sum(isinstance(s, MLAStateSpec) for s in specs)}
