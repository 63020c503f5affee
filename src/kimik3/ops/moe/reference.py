"""Routed experts of the latent MoE: the expert-ordered per-expert loop (the reference).

Legend: N tokens, L latent width (experts' input/output), F expert width, E experts, A active experts.

Each expert i computes e_i = w2_i( SiTU([w1_i z | w3_i z]) ) in the compute dtype; its output is rounded
to that dtype BEFORE the fp32 weighted combine r = sum_i w_i * float(e_i) (spec 2.8, step 6).
The loop synchronizes with the host per expert; the grouped GEMM paths exist for speed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kimik3.ops.situ import situ_glu


def routed_experts(z: Tensor, topk_idx: Tensor, topk_weight: Tensor, w1: Tensor, w3: Tensor, w2: Tensor,
                   beta: float, linear_beta: float) -> Tensor:
    out_NL = torch.zeros(z.shape, dtype=torch.float32, device=z.device)
    for e in range(w1.shape[0]):
        tok, slot = (topk_idx == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        z_nL = z[tok]
        h_nF = situ_glu(z_nL @ w1[e].T, z_nL @ w3[e].T, beta, linear_beta)
        y_nL = h_nF @ w2[e].T
        out_NL = out_NL.index_add(0, tok, y_nL.float() * topk_weight[tok, slot, None])
    return out_NL.to(z.dtype)
