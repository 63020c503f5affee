"""The router's logits as one tensor-core GEMM: bf16 (or fp16) operands, fp32 sums and output; the contract
of `.reference`, which upcasts both operands and runs an fp32 (non-tensor-core) GEMM.

Why this is the reference's arithmetic in another order. Each product x_k * w_k is exact in fp32: two bf16
significands (8 bits) multiply into at most 16 bits, two fp16 ones (11 bits) into 22, and fp32 holds 24; the
reference's upcasts are exact too. So both paths add the same K = D exact products in fp32 and differ only in
the order of the additions (cuBLAS's tiling and split-K included). Any order of additions rounded to nearest
(unit roundoff u = 2^-24) ends within

    |s_hat - s| <= gamma_K * sum_k |x_k w_k|,    gamma_K = K u / (1 - K u)

of the exact sum s (Higham, Accuracy and Stability of Numerical Algorithms, §4.2), so two orders differ by
at most 2 gamma_K * sum_k |x_k w_k|: at K = 7168, 8.5e-4 of the absolute sum, a worst case; random signs give
errors near sqrt(K) u of it. The tensor cores' adds are not IEEE: inside each block FMA they align the
addends to the largest and truncate (Fasi, Higham, Mikaitis, Pranesh 2021, "Numerical behavior of NVIDIA tensor
cores"; Khattak, Mikaitis 2025 for H100), so for this path we count round toward zero, u = 2^-23: within
gamma_K(2u) of s, and within (gamma_K(u) + gamma_K(2u)) * sum_k |x_k w_k| of the reference. Products below
fp32's normal range (|x_k w_k| < 2^-126) may be flushed to zero there: K * 2^-126 more, absolute.
`torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction` need not be touched: it lets cuBLASLt
reduce split-K partials in the output type, and here that type is fp32.

The backward keeps the products exact. The fp32 gradient of the logits splits into three bf16 parts,
g = g1 + g2 + g3 exactly (each takes the next 8 of fp32's 24 significand bits; a rounding's residual is exact
in fp32), and both gradient GEMMs run over the three parts at once, bf16 in, fp32 sums:
    d x = [g1 g2 g3] @ [w; w; w]                    3E exact products per entry
    d w = sum of the 3 slices of [g1 g2 g3]^T @ x   N exact products per slice, then 2 adds
so each lies within gamma_3E (resp. gamma_(N+2)) of its sum of |products| before the final rounding to the
input's dtype, which the reference's upcast applies to its fp32 gradients too. fp16 has too little exponent
range to hold the parts of a gradient, so fp16 inputs take the reference's fp32 GEMMs backward.
"""

from __future__ import annotations

import torch
from torch import Tensor


def mm_f32(a: Tensor, b: Tensor) -> Tensor:
    """a @ b for 16-bit a, b of one dtype, summed in fp32 and written in fp32 (`aten::mm.dtype`, CUDA only)."""
    return torch.mm(a, b, out_dtype=torch.float32)


def split3(g: Tensor) -> Tensor:
    """fp32 [..., M] -> bf16 [..., 3M], the concatenation [g1 g2 g3] with g1 + g2 + g3 == g exactly (finite g
    above bf16's subnormal range, |g| >~ 2^-110)."""
    g1 = g.bfloat16()
    r = g - g1.float()
    g2 = r.bfloat16()
    return torch.cat([g1, g2, (r - g2.float()).bfloat16()], dim=-1)


class _RouterLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_ND: Tensor, w_ED: Tensor) -> Tensor:
        ctx.save_for_backward(x_ND, w_ED)
        return mm_f32(x_ND, w_ED.T)

    @staticmethod
    def backward(ctx, g_NE: Tensor) -> tuple[Tensor | None, Tensor | None]:
        x_ND, w_ED = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[:2]
        g_NE = g_NE.float()
        if x_ND.dtype != torch.bfloat16:
            dx = (g_NE @ w_ED.float()).to(x_ND.dtype) if need_x else None
            dw = (g_NE.T @ x_ND.float()).to(w_ED.dtype) if need_w else None
            return dx, dw
        E, D = w_ED.shape
        g_NS = split3(g_NE)  # S = 3E
        dx = mm_f32(g_NS, w_ED.repeat(3, 1)).to(x_ND.dtype) if need_x else None
        dw = mm_f32(g_NS.T, x_ND).view(3, E, D).sum(0).to(w_ED.dtype) if need_w else None
        return dx, dw


def router_logits(x_ND: Tensor, w_ED: Tensor) -> Tensor:
    """`.reference.router_logits` for CUDA x_ND [N, D] and w_ED [E, D] both bf16 or both fp16: [N, E] fp32."""
    return _RouterLogits.apply(x_ND, w_ED)
