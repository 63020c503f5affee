"""The SiTU-GLU MLP: the dense FFN of layer 0 and the latent MoE's shared expert.

Legend: N tokens (any leading dims), D hidden, F intermediate width.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kimik3.ops.situ import situ_glu


class MLP(nn.Module):
    """down_proj( SiTU([gate_proj(x) | up_proj(x)]) ), bias-free."""

    def __init__(self, hidden: int, intermediate: int, beta: float, linear_beta: float,
                 dtype: torch.dtype | None = None):
        super().__init__()
        self.beta, self.linear_beta = beta, linear_beta
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False, dtype=dtype)

    def forward(self, x_ND: Tensor) -> Tensor:
        h_NF = situ_glu(self.gate_proj(x_ND), self.up_proj(x_ND), self.beta, self.linear_beta)
        return self.down_proj(h_NF)
