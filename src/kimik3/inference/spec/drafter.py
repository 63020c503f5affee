"""A DSpark-style draft model (arXiv 2607.05147): a parallel drafter over the target's hidden states, a low-rank
Markov head between draft positions, and a confidence head that sets the draft length.

Legend: B batch, C context positions, S block slots (block_size), D hidden (the target's), V vocabulary,
n tapped target layers, H heads, K head dim, r Markov rank.

    ctx   = hidden_norm( fc( [h_l1 | ... | h_ln] ) )          [B, C, D]  the target's taps (taps.py)
    x     = embed([anchor, mask, ..., mask]) + ctx[a - 1]     [B, S, D]  the target's embedding, frozen,
                                                                     plus the newest context row
    for each layer: x += attn(q = x, kv = [ctx ; x]);  x += mlp(x)   (non-causal within the block)
    base  = lm_head(norm(x))                                  [B, S, V]  the target's head, frozen
    logits_j = base_j + W2 W1[prev_j]                          Markov head: prev_j = token at slot j-1
    conf_j   = sigmoid(w . [norm(x)_j ; W1[prev_j]])           P(draft j accepted | drafts < j accepted)

Slot 0 holds the anchor (the newest committed token, whose own hidden state the target has not computed);
slot j >= 1 predicts the token j places after it. The context is the taps at every position before the anchor.
The backbone drafts all S-1 positions in one pass; only the Markov head runs per position (one row gather).
The attention is multi-head with rotary positions (the published K3 drafters use MLA layers; a small demo
drafter gains nothing from a latent KV), the MLP is K3's SiTU-GLU and the norms K3's RMSNorm.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kimik3.model.mlp import MLP
from kimik3.model.norm import RMSNorm


@dataclass(frozen=True)
class DraftConfig:
    """The drafter's shape; keys named as the published K3 DSpark configs where they have one (docs/speculative.md).

    Attributes:
        target_layer_ids: 0-based target decoder layers whose residual streams are tapped.
        target_hidden_size, target_num_hidden_layers, vocab_size: the target's (checked on load).
        hidden_size: the drafter's width; equal to the target's (it shares the target's embedding and LM head).
        num_hidden_layers, num_attention_heads, head_dim, intermediate_size: the backbone.
        block_size: slots per draft block (1 anchor + block_size - 1 drafts).
        markov_rank: rank r of the Markov head (0: none).
        enable_confidence_head: whether the confidence head exists.
        mask_token_id: the id whose (target) embedding fills the draft slots.
    """

    target_layer_ids: tuple[int, ...]
    target_hidden_size: int
    target_num_hidden_layers: int
    vocab_size: int
    mask_token_id: int
    hidden_size: int
    num_hidden_layers: int = 1
    num_attention_heads: int = 4
    head_dim: int = 64
    intermediate_size: int = 512
    block_size: int = 8
    markov_rank: int = 32
    enable_confidence_head: bool = True
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        checks = [
            ("target_layer_ids", len(self.target_layer_ids) >= 1 and len(set(self.target_layer_ids)) ==
             len(self.target_layer_ids) and all(0 <= i < self.target_num_hidden_layers for i in self.target_layer_ids),
             f"must be distinct layer indices in [0, {self.target_num_hidden_layers})"),
            ("hidden_size", self.hidden_size == self.target_hidden_size,
             f"must equal target_hidden_size ({self.target_hidden_size}): the embedding and LM head are the target's"),
            ("block_size", self.block_size >= 2, "must be >= 2 (an anchor and at least one draft)"),
            ("mask_token_id", 0 <= self.mask_token_id < self.vocab_size, f"must be in [0, {self.vocab_size})"),
            ("head_dim", self.head_dim > 0 and self.head_dim % 2 == 0, "must be a positive even number (rotary)"),
            ("markov_rank", self.markov_rank >= 0, "must be >= 0"),
        ]
        for name in ("num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size",
                     "target_hidden_size"):
            checks.append((name, getattr(self, name) >= 1, "must be >= 1"))
        for name, ok, msg in checks:
            if not ok:
                raise ValueError(f"draft config '{name}' {msg}, got {getattr(self, name)!r}")

    @property
    def num_drafts(self) -> int:
        return self.block_size - 1

    def to_dict(self) -> dict:
        return {"architectures": ["K3DSparkModel"], "model_type": "k3_dspark", **asdict(self),
                "target_layer_ids": list(self.target_layer_ids)}

    @classmethod
    def from_dict(cls, d: dict) -> DraftConfig:
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(d) - known - {"architectures", "model_type"})
        if unknown:
            raise ValueError(f"draft config: unknown keys {unknown}")
        return cls(**{k: v for k, v in d.items() if k in known})


def rotary(x_BHTK: Tensor, pos_BT: Tensor, theta: float) -> Tensor:
    """Rotate pairs (first half, second half) of the last dim by angle pos * theta^(-2i/K)."""
    K = x_BHTK.shape[-1]
    inv = theta ** (-torch.arange(0, K, 2, device=x_BHTK.device, dtype=torch.float32) / K)
    ang = pos_BT[:, None, :, None].float() * inv  # [B, 1, T, K/2]
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x_BHTK.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).to(x_BHTK.dtype)


class DraftAttention(nn.Module):
    """Queries from the block, keys/values from [context ; block]; which keys each query sees is the mask's."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        D, H, K = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        self.H, self.K, self.theta = H, K, cfg.rope_theta
        self.q_proj = nn.Linear(D, H * K, bias=False)
        self.k_proj = nn.Linear(D, H * K, bias=False)
        self.v_proj = nn.Linear(D, H * K, bias=False)
        self.o_proj = nn.Linear(H * K, D, bias=False)

    def forward(self, x_BSD: Tensor, kv_BND: Tensor, q_pos_BS: Tensor, kv_pos_BN: Tensor, mask_BSN: Tensor) -> Tensor:
        B, S, _ = x_BSD.shape
        N = kv_BND.shape[1]
        q = rotary(self.q_proj(x_BSD).view(B, S, self.H, self.K).transpose(1, 2), q_pos_BS, self.theta)
        k = rotary(self.k_proj(kv_BND).view(B, N, self.H, self.K).transpose(1, 2), kv_pos_BN, self.theta)
        v = self.v_proj(kv_BND).view(B, N, self.H, self.K).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_BSN[:, None])
        return self.o_proj(o.transpose(1, 2).reshape(B, S, self.H * self.K))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        D = cfg.hidden_size
        self.input_layernorm = RMSNorm(D, cfg.rms_norm_eps, torch.float32)
        self.self_attn = DraftAttention(cfg)
        self.post_attention_layernorm = RMSNorm(D, cfg.rms_norm_eps, torch.float32)
        self.mlp = MLP(D, cfg.intermediate_size, cfg.situ_beta, cfg.situ_linear_beta, torch.float32)

    def forward(self, x_BSD, ctx_BCD, q_pos_BS, kv_pos_BN, mask_BSN):
        a = self.input_layernorm(x_BSD)
        kv = torch.cat([self.input_layernorm(ctx_BCD), a], dim=1)
        x_BSD = x_BSD + self.self_attn(a, kv, q_pos_BS, kv_pos_BN, mask_BSN)
        return x_BSD + self.mlp(self.post_attention_layernorm(x_BSD))


class MarkovHead(nn.Module):
    """bias(prev) = w2(w1[prev]): a rank-r table of next-token logits given the previous token."""

    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.w1 = nn.Embedding(vocab, rank)
        self.w2 = nn.Linear(rank, vocab, bias=False)
        nn.init.normal_(self.w1.weight, std=0.02)
        nn.init.zeros_(self.w2.weight)  # starts as no bias: the backbone's logits alone


class DSparkDrafter(nn.Module):
    """The drafter's own parameters (fc, hidden_norm, layers, norm, markov_head, confidence_head); the target's
    `embed` and `lm_head` are passed to each call, never stored (see the module docstring)."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.config = cfg
        D, n = cfg.hidden_size, len(cfg.target_layer_ids)
        self.fc = nn.Linear(n * cfg.target_hidden_size, D, bias=False)
        self.hidden_norm = RMSNorm(D, cfg.rms_norm_eps, torch.float32)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(D, cfg.rms_norm_eps, torch.float32)
        r = cfg.markov_rank
        self.markov_head = MarkovHead(cfg.vocab_size, r) if r else None
        self.confidence_head = nn.Linear(D + r, 1) if cfg.enable_confidence_head else None
        for m in self.modules():
            if isinstance(m, nn.Linear) and m is not getattr(self.markov_head, "w2", None):
                nn.init.normal_(m.weight, std=1 / math.sqrt(m.in_features))
        for layer in self.layers:  # residual branches start small: the block first reads the anchor and context
            nn.init.normal_(layer.self_attn.o_proj.weight, std=0.02 / math.sqrt(cfg.num_hidden_layers))
            nn.init.normal_(layer.mlp.down_proj.weight, std=0.02 / math.sqrt(cfg.num_hidden_layers))

    def context(self, taps_BCX: Tensor) -> Tensor:
        """[B, C, n*D_target] taps (taps.stack_taps) -> [B, C, D] context features (computed once per position)."""
        return self.hidden_norm(self.fc(taps_BCX.float()))

    def backbone(self, ctx_BCD: Tensor, block_ids_BS: Tensor, embed: nn.Embedding, ctx_pos_BC: Tensor,
                 block_pos_BS: Tensor, mask_BSN: Tensor | None, last_BS: Tensor | None = None) -> Tensor:
        """Normed block hidden states [B, S, D] (fp32).

        Args:
            ctx_BCD: `context(taps)` of the positions before the anchor.
            block_ids_BS: [B, S] anchor and mask ids (in training: several blocks side by side).
            ctx_pos_BC, block_pos_BS: absolute positions (rotary).
            mask_BSN: [B, S, C + S] bool: which context positions and block slots each slot attends to
                (None: all of them, one block at inference).
            last_BS: [B, S] the context row just before each slot's anchor (None: the last row, one block),
                added to every slot's input so the block starts from the target's newest state.
        """
        if last_BS is None:
            last_BS = torch.full(block_ids_BS.shape, ctx_BCD.shape[1] - 1, device=ctx_BCD.device)
        x = embed(block_ids_BS).float() + ctx_BCD.gather(1, last_BS[..., None].expand(-1, -1, ctx_BCD.shape[2]))
        kv_pos = torch.cat([ctx_pos_BC, block_pos_BS], dim=1)
        if mask_BSN is None:
            mask_BSN = torch.ones(x.shape[0], x.shape[1], kv_pos.shape[1], dtype=torch.bool, device=x.device)
        for layer in self.layers:
            x = layer(x, ctx_BCD, block_pos_BS, kv_pos, mask_BSN)
        return self.norm(x)

    def markov(self, prev_ids: Tensor) -> tuple[Tensor | None, Tensor | None]:
        """(logit bias [..., V], rank-r features [..., r]) for the previous tokens, or (None, None) without a head."""
        if self.markov_head is None:
            return None, None
        z = self.markov_head.w1(prev_ids)
        return self.markov_head.w2(z), z

    def heads(self, h_SD: Tensor, prev_S: Tensor, lm_head: nn.Linear) -> tuple[Tensor, Tensor | None]:
        """Draft logits [..., V] fp32 and confidence logits [...] (None without the head) for slots whose
        previous tokens are `prev_S`."""
        return self.finish_heads(lm_head(h_SD.to(lm_head.weight.dtype)).float(), h_SD, prev_S)

    def finish_heads(self, logits: Tensor, h_SD: Tensor, prev_S: Tensor) -> tuple[Tensor, Tensor | None]:
        """`heads` given the target head's logits of `h_SD` (the part that does not depend on `prev_S`: a
        proposer drafting token by token computes it for the whole block in one GEMM)."""
        bias, z = self.markov(prev_S)
        if bias is not None:
            logits = logits + bias
        conf = None
        if self.confidence_head is not None:
            feats = h_SD if z is None else torch.cat([h_SD, z], dim=-1)
            conf = self.confidence_head(feats).squeeze(-1)
        return logits, conf
