"""One decoder layer with block attention residuals (AttnRes) over depth (spec 2.3).

Legend: B batch, T tokens, D hidden, M stored blocks. `blocks` [M, B, T, D] holds the stored block sums.

    a = MIX(p, blocks) if blocks else p              # attention input (p = running block sum)
    if layer starts a block: blocks += [p]; p = 0    # snapshot the PRE-mix sum, start a new block
    p = p + attn(input_layernorm(a))
    m = MIX(p, blocks)
    p = p + ffn(post_attention_layernorm(m))         # the layer's output is the new running sum
The mixed tensors feed only the norms, never the running sum.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kimik3.config import TextConfig
from kimik3.model.kda import KimiDeltaAttention
from kimik3.model.mla import MultiHeadLatentAttention
from kimik3.model.mlp import MLP
from kimik3.model.moe import LatentMoE
from kimik3.model.norm import RMSNorm
from kimik3.model.state import KDAView, MLAView
from kimik3.model.step import KDAStepIO, Step
from kimik3.ops.attnres import attn_res_mix


def depth_mix(blocks: Tensor, partial: Tensor, norm: RMSNorm, proj: nn.Linear) -> Tensor:
    """AttnRes mix of the stored blocks and the running sum with one layer's (norm, proj) pair."""
    return attn_res_mix(blocks, partial, norm.weight, proj.weight, norm.eps)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig, layer_idx: int, dtype: torch.dtype | None = None):
        super().__init__()
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.starts_block = layer_idx % cfg.attn_res_block_size == 0
        kind = cfg.layer_types[layer_idx]
        self.self_attn = KimiDeltaAttention(cfg, dtype) if kind == "kda" else MultiHeadLatentAttention(cfg, dtype)
        if cfg.moe_layers[layer_idx]:
            self.block_sparse_moe = LatentMoE(cfg, dtype)
        else:
            self.mlp = MLP(D, cfg.intermediate_size, cfg.situ_beta, cfg.situ_linear_beta, dtype)
        self.input_layernorm = RMSNorm(D, eps, dtype)
        self.post_attention_layernorm = RMSNorm(D, eps, dtype)
        self.self_attention_res_norm = RMSNorm(D, eps, dtype)
        self.self_attention_res_proj = nn.Linear(D, 1, bias=False, dtype=dtype)
        self.mlp_res_norm = RMSNorm(D, eps, dtype)
        self.mlp_res_proj = nn.Linear(D, 1, bias=False, dtype=dtype)

    @property
    def ffn(self) -> nn.Module:
        return self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp

    def forward(self, partial: Tensor, blocks: Tensor, cu_seqlens: Tensor | None = None,
                state: KDAView | MLAView | None = None, step: Step | None = None
                ) -> tuple[Tensor, Tensor, KDAStepIO | None]:
        """Returns the new running sum, the (possibly extended) stack of stored blocks [M, B, T, D], and what a
        cached attention gave back (`KDAStepIO`; None without state).

        `state` is this layer's view of a StatePool (updated in place) and `step` where this call's tokens go.
        """
        a = depth_mix(blocks, partial, self.self_attention_res_norm, self.self_attention_res_proj) if len(blocks) \
            else partial
        x = self.input_layernorm(a)
        out = self.self_attn(x, cu_seqlens, state, step)
        o, io = (out, None) if state is None else out
        if self.starts_block:
            blocks = torch.cat([blocks, partial[None]])  # once per block: 8 times in K3's 93 layers
            partial = o
        else:
            partial = partial + o
        m = depth_mix(blocks, partial, self.mlp_res_norm, self.mlp_res_proj)
        return partial + self.ffn(self.post_attention_layernorm(m)), blocks, io
