"""Routed experts of the latent MoE: the expert-ordered per-expert loop (the reference).

Legend: N tokens, L latent width (experts' input/output), F expert width, E experts, A active experts,
M = N * A routed rows in (token, slot) order.

Each expert i computes e_i = w2_i( SiTU([w1_i z | w3_i z]) ) in the compute dtype; its output is rounded
to that dtype BEFORE the fp32 weighted combine r = sum_i w_i * float(e_i) (spec 2.8, step 6), each token's
experts added in ascending expert order from 0.
The loop synchronizes with the host per expert; the grouped GEMM paths exist for speed.

`rows` and `combine` are the loop's two halves: the per-row outputs (each expert on all of its rows at once, so a
caller that computes some experts elsewhere gets, from here, the others' rows bit for bit) and the sum.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from kimik3.ops.mxfp4 import decode
from kimik3.ops.situ.reference import situ_glu

ExpertWeights = Callable[[int], tuple[Tensor, Tensor, Tensor]]  # expert -> (w1 [F, L], w3 [F, L], w2 [L, F])


def rows(z: Tensor, topk_idx: Tensor, num_experts: int, weights: ExpertWeights, beta: float,
         linear_beta: float, out: Tensor | None = None) -> Tensor:
    """y [M, L] in z's dtype: row n * A + a is expert topk_idx[n, a]'s output for token n; rows of expert E or more
    are skipped: zero, or as they were in `out` (written in place when given; no autograd then)."""
    A = topk_idx.shape[1]
    e_M = topk_idx.reshape(-1)
    order_M = torch.sort(e_M, stable=True).indices  # grouped by expert, tokens ascending within each
    # one gather for every expert: its backward sums each token's gradient over its slots in ascending expert
    # order, the order expert parallelism's dispatch sums them in (per-expert gathers would leave it to autograd)
    z_ML = z[order_M // A]
    y_ML = torch.zeros(e_M.numel(), z.shape[1], dtype=z.dtype, device=z.device) if out is None else out
    start = 0
    for e, n in enumerate(torch.bincount(e_M.clamp(max=num_experts), minlength=num_experts + 1)[:-1].tolist()):
        if n == 0:
            continue
        w1_FL, w3_FL, w2_LF = weights(e)
        h_nF = situ_glu(z_ML[start:start + n] @ w1_FL.T, z_ML[start:start + n] @ w3_FL.T, beta, linear_beta)
        y_nL = h_nF @ w2_LF.T
        if out is None:
            y_ML = y_ML.index_copy(0, order_M[start:start + n], y_nL)
        else:
            y_ML.index_copy_(0, order_M[start:start + n], y_nL)
        start += n
    return y_ML


def combine(y_ML: Tensor, topk_idx: Tensor, topk_weight: Tensor) -> Tensor:
    """[N, L] in y's dtype: each token's rows weighted in fp32 and added in ascending expert order, from 0."""
    (N, A), L = topk_idx.shape, y_ML.shape[1]
    order_NA = torch.sort(topk_idx, dim=1, stable=True).indices
    y_NAL = y_ML.view(N, A, L).gather(1, order_NA[..., None].expand(N, A, L))
    w_NA = topk_weight.gather(1, order_NA)
    out_NL = torch.zeros(N, L, dtype=torch.float32, device=y_ML.device)
    for a in range(A):
        out_NL = out_NL + y_NAL[:, a].float() * w_NA[:, a, None]
    return out_NL.to(y_ML.dtype)


def _expert_loop(z: Tensor, topk_idx: Tensor, topk_weight: Tensor, num_experts: int, weights: ExpertWeights,
                 beta: float, linear_beta: float) -> Tensor:
    return combine(rows(z, topk_idx, num_experts, weights, beta, linear_beta), topk_idx, topk_weight)


def routed_experts(z: Tensor, topk_idx: Tensor, topk_weight: Tensor, w1: Tensor, w3: Tensor, w2: Tensor,
                   beta: float, linear_beta: float) -> Tensor:
    return _expert_loop(z, topk_idx, topk_weight, w1.shape[0], lambda e: (w1[e], w3[e], w2[e]), beta, linear_beta)


def packed_weights(packed: tuple[Tensor, Tensor, Tensor], scales: tuple[Tensor, Tensor, Tensor],
                   dtype: torch.dtype) -> ExpertWeights:
    """expert -> its weights decoded exactly to `dtype`."""
    return lambda e: tuple(decode(p[e], s[e], dtype) for p, s in zip(packed, scales))


def routed_experts_mxfp4(z: Tensor, topk_idx: Tensor, topk_weight: Tensor, packed: tuple[Tensor, Tensor, Tensor],
                         scales: tuple[Tensor, Tensor, Tensor], beta: float, linear_beta: float) -> Tensor:
    # dequantization is exact, so this equals routed_experts on the decoded weights
    return _expert_loop(z, topk_idx, topk_weight, packed[0].shape[0], packed_weights(packed, scales, z.dtype), beta,
                        linear_beta)
