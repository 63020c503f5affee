"""Routed experts with bf16 weights as three grouped GEMMs (`torch._grouped_mm`), differentiable.

Legend: N tokens, A active experts per token, M = N*A routed rows, E experts, L latent width, F expert width.

The M routed rows are sorted by expert (stable), so each expert's rows are one contiguous run; `offs` [E] int32
holds the run ends (the cumulative row counts) and is computed on the device, so nothing waits on the host.
Then x = z[token of each row] goes through w1/w3 (rounded to bf16, as the reference's matmuls), SiTU, w2,
and each row's output (bf16) is weighted in fp32 and added into its token with `index_add`.
`torch._grouped_mm` has autograd (torch >= 2.8; CUDA needs sm90+ for the fast kernel): gradients flow to z,
w1, w3, w2 and topk_weight. An expert with no rows is an empty group; its weight gradient is zero.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kimik3.ops.backend import has_triton
from kimik3.ops.situ import situ_glu


def expert_offsets(sorted_e: Tensor, num_experts: int) -> Tensor:
    """[E] int32 end row of each expert's run in the expert-sorted rows `sorted_e` (= cumsum of counts)."""
    experts = torch.arange(num_experts, device=sorted_e.device, dtype=sorted_e.dtype)
    return torch.searchsorted(sorted_e, experts, right=True).to(torch.int32)


def routed_experts(z: Tensor, topk_idx: Tensor, topk_weight: Tensor, w1: Tensor, w3: Tensor, w2: Tensor,
                   beta: float, linear_beta: float, fused: bool | None = None) -> Tensor:
    """Grouped-GEMM path of `kimik3.ops.moe.routed_experts` (same contract; bf16 on CUDA sm90+ or CPU).

    `fused` (default: on CUDA with Triton) moves the routed rows with `.combine`'s gather kernels instead of
    autograd's scatter-adds and fp32 row copies (`reference_combine`); the sums are the same, in a fixed
    order."""
    N, A = topk_idx.shape
    fused = (z.is_cuda and has_triton()) if fused is None else fused
    # fp32 master weights under bf16 autocast: run the GEMMs in z's dtype, as autocast does for nn.Linear
    w1, w3, w2 = (w.to(z.dtype) for w in (w1, w3, w2))
    sorted_e, order = torch.sort(topk_idx.reshape(-1), stable=True)
    offs = expert_offsets(sorted_e, w1.shape[0])
    tok = order // A
    if fused:
        from kimik3.ops.moe import combine  # lazily: triton exists only on GPU machines

        inv_NA = combine.inverse(order, N, A)
        x_ML = combine.dispatch(z, tok, inv_NA)
    else:
        x_ML = z[tok]
    g_MF = torch._grouped_mm(x_ML, w1.transpose(-2, -1), offs=offs)
    u_MF = torch._grouped_mm(x_ML, w3.transpose(-2, -1), offs=offs)
    h_MF = situ_glu(g_MF, u_MF, beta, linear_beta)
    y_ML = torch._grouped_mm(h_MF, w2.transpose(-2, -1), offs=offs)
    return combine.combine(y_ML, inv_NA, topk_weight) if fused else reference_combine(y_ML, order, topk_weight)


def reference_combine(y_ML: Tensor, order: Tensor, w_NA: Tensor) -> Tensor:
    """[N, L] in y's dtype: each token's A sorted rows weighted in fp32 and summed with `index_add` into fp32."""
    N, A = w_NA.shape
    w_M1 = w_NA.reshape(-1)[order].float().unsqueeze(-1)
    out_NL = torch.zeros(N, y_ML.shape[1], dtype=torch.float32, device=y_ML.device)
    return out_NL.index_add(0, order // A, y_ML.float() * w_M1).to(y_ML.dtype)
