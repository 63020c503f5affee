"""Routed experts of the latent MoE: the expert-ordered per-expert loop (the reference).

Legend: N tokens, L latent width (experts' input/output), F expert width, E experts, A active experts.

Each expert i computes e_i = w2_i( SiTU([w1_i z | w3_i z]) ) in the compute dtype; its output is rounded
to that dtype BEFORE the fp32 weighted combine r = sum_i w_i * float(e_i) (spec 2.8, step 6).
The loop synchronizes with the host per expert; the grouped GEMM paths exist for speed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from kimik3.ops.mxfp4 import decode
from kimik3.ops.situ.reference import situ_glu

ExpertWeights = Callable[[int], tuple[Tensor, Tensor, Tensor]]  # expert -> (w1 [F, L], w3 [F, L], w2 [L, F])


def _expert_loop(z: Tensor, topk_idx: Tensor, topk_weight: Tensor, num_experts: int, weights: ExpertWeights,
                 beta: float, linear_beta: float) -> Tensor:
    out_NL = torch.zeros(z.shape, dtype=torch.float32, device=z.device)
    A = topk_idx.shape[1]
    e_M = topk_idx.reshape(-1)  # M = N * A (token, slot) pairs
    order_M = torch.sort(e_M, stable=True).indices  # grouped by expert, tokens ascending within each
    # one gather for every expert: its backward sums each token's gradient over its slots in ascending expert
    # order, the order expert parallelism's dispatch sums them in (per-expert gathers would leave it to autograd)
    z_ML = z[order_M // A]
    start = 0
    for e, n in enumerate(torch.bincount(e_M, minlength=num_experts).tolist()):
        if n == 0:
            continue
        rows = order_M[start:start + n]
        tok, slot, z_nL = rows // A, rows % A, z_ML[start:start + n]
        start += n
        w1_FL, w3_FL, w2_LF = weights(e)
        h_nF = situ_glu(z_nL @ w1_FL.T, z_nL @ w3_FL.T, beta, linear_beta)
        y_nL = h_nF @ w2_LF.T
        out_NL = out_NL.index_add(0, tok, y_nL.float() * topk_weight[tok, slot, None])
    return out_NL.to(z.dtype)


def routed_experts(z: Tensor, topk_idx: Tensor, topk_weight: Tensor, w1: Tensor, w3: Tensor, w2: Tensor,
                   beta: float, linear_beta: float) -> Tensor:
    return _expert_loop(z, topk_idx, topk_weight, w1.shape[0], lambda e: (w1[e], w3[e], w2[e]), beta, linear_beta)


def routed_experts_mxfp4(z: Tensor, topk_idx: Tensor, topk_weight: Tensor, packed: tuple[Tensor, Tensor, Tensor],
                         scales: tuple[Tensor, Tensor, Tensor], beta: float, linear_beta: float) -> Tensor:
    # dequantization is exact, so this equals routed_experts on the decoded weights
    def weights(e: int) -> tuple[Tensor, Tensor, Tensor]:
        return tuple(decode(p[e], s[e], z.dtype) for p, s in zip(packed, scales))

    return _expert_loop(z, topk_idx, topk_weight, packed[0].shape[0], weights, beta, linear_beta)
