"""The latent mixture of experts (`block_sparse_moe`, layers 1..92).

Legend: N tokens, D hidden, L latent width, F expert width, E experts, A active experts per token.

    scores = sigmoid(x @ gate.weight^T)               fp32, on the full-width hidden state
    idx    = top-A of (scores + e_score_correction_bias)   the bias only selects
    w      = scores[idx] / sum * routed_scaling_factor     fp32
    r      = up( norm( sum_i w_i * expert_i( down(x) ) ) )  experts run in the latent width L
    out    = r + shared_experts(x)
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kimik3.config import TextConfig
from kimik3.model.mlp import MLP
from kimik3.model.norm import RMSNorm
from kimik3.ops.moe import routed_experts


class Router(nn.Module):
    """Sigmoid router with a selection-only correction bias (a buffer: balancing updates it, not gradients)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, renormalize: bool, scaling: float,
                 dtype: torch.dtype | None = None):
        super().__init__()
        self.top_k, self.renormalize, self.scaling = top_k, renormalize, scaling
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))

    def forward(self, x_ND: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Returns (topk_idx [N, A] int64, topk_weight [N, A] fp32, scores [N, E] fp32)."""
        scores_NE = torch.sigmoid(x_ND.float() @ self.weight.float().T)
        _, idx_NA = torch.topk(scores_NE.detach() + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False)
        w_NA = scores_NE.gather(-1, idx_NA)
        if self.renormalize and self.top_k > 1:
            w_NA = w_NA / (w_NA.sum(-1, keepdim=True) + 1e-20)
        return idx_NA, w_NA * self.scaling, scores_NE


class Experts(nn.Module):
    """The E routed experts, stacked: w1 (gate) and w3 (up) [E, F, L], w2 (down) [E, L, F].

    The checkpoint stores them per expert (`experts.{e}.w1.weight_packed` ...); the key map unstacks them.
    """

    def __init__(self, num_experts: int, latent: int, width: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, width, latent, dtype=dtype))
        self.w3 = nn.Parameter(torch.empty(num_experts, width, latent, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty(num_experts, latent, width, dtype=dtype))


class LatentMoE(nn.Module):
    def __init__(self, cfg: TextConfig, dtype: torch.dtype | None = None):
        super().__init__()
        m, D = cfg.moe, cfg.hidden_size
        self.beta, self.linear_beta = cfg.situ_beta, cfg.situ_linear_beta
        self.gate = Router(D, m.num_experts, m.num_experts_per_token, m.renormalize, m.routed_scaling_factor, dtype)
        self.routed_expert_down_proj = nn.Linear(D, m.latent_dim, bias=False, dtype=dtype)
        self.experts = Experts(m.num_experts, m.latent_dim, m.expert_dim, dtype)
        self.routed_expert_norm = RMSNorm(m.latent_dim, cfg.rms_norm_eps, dtype) if m.use_latent_norm else None
        self.routed_expert_up_proj = nn.Linear(m.latent_dim, D, bias=False, dtype=dtype)
        self.shared_experts = MLP(D, m.shared_dim, cfg.situ_beta, cfg.situ_linear_beta, dtype)

    def forward(self, x: Tensor) -> Tensor:
        x_ND = x.reshape(-1, x.shape[-1])
        idx_NA, w_NA, _ = self.gate(x_ND)
        z_NL = self.routed_expert_down_proj(x_ND)
        ex = self.experts
        r_NL = routed_experts(z_NL, idx_NA, w_NA, ex.w1, ex.w3, ex.w2, self.beta, self.linear_beta)
        if self.routed_expert_norm is not None:
            r_NL = self.routed_expert_norm(r_NL)
        out_ND = self.routed_expert_up_proj(r_NL) + self.shared_experts(x_ND)
        return out_ND.view(x.shape)
