"""SiTU-GLU in torch: the reference (see `kimik3.ops.situ.situ_glu`).

Given the gate and up projections (same shape), in fp32:
    a = beta * tanh(gate / beta) * sigmoid(gate)
    u = linear_beta * tanh(up / linear_beta)
    out = (a * u) cast to the input dtype
K3: beta = activation_situ_beta = 4, linear_beta = activation_situ_linear_beta = 25.
The Triton kernels (`.triton`, and the MXFP4 experts' GEMM epilogue) compute the same formula.
"""

from __future__ import annotations

import torch
from torch import Tensor


def situ_glu(gate: Tensor, up: Tensor, beta: float, linear_beta: float) -> Tensor:
    """SiTU(gate) * soft-clipped up, computed in fp32, returned in `gate.dtype`. Shapes: any, equal."""
    g, u = gate.float(), up.float()
    a = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    return (a * (linear_beta * torch.tanh(u / linear_beta))).to(gate.dtype)
