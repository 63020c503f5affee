"""`kimik3.ops.optim` as Triton kernels: the contract of `.reference`.

Legend: n elements of one parameter (flat), BLOCK elements per program.

AdamW: program b reads param, grad and both moments of its BLOCK elements once and writes param and the
moments once: 14 bytes per bf16 parameter (torch's fused kernel with a grad_scale also writes the gradient
back: 16). The math is the reference's, in its order, with correctly rounded sqrt and division and no FMA
contraction, so the results are the reference's to the bit (tests, under Triton's interpreter and on the GPU).

Norm: program b of tensor i writes the fp32 sum of squares of its block to partials[offset_i + b]; the norm is
the sqrt of the partials' sum (one torch reduction in a fixed order: deterministic).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kimik3.ops.optim.reference import scalars
from kimik3.ops.triton_utils import interpreting, round_to

__all__ = ["adamw_update_", "grad_norm"]

BLOCK = 4096  # elements per program: 8 KB of each bf16 operand, 16 per thread at 8 warps
NUM_WARPS = 8
NORM_BLOCK = 8192


@triton.jit
def _adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, scale_ptr, n, decay, beta1, one_minus_beta1, beta2, one_minus_beta2,
                  step_size, bc2_sqrt, eps, HAS_SCALE: tl.constexpr, HAS_DECAY: tl.constexpr, BLOCK: tl.constexpr,
                  INTERPRET: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        g = tl.div_rn(g, tl.load(scale_ptr).to(tl.float32))
    if HAS_DECAY:
        p = p - decay * p
    m = beta1 * m + one_minus_beta1 * g
    v = beta2 * v + one_minus_beta2 * (g * g)
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = p - tl.div_rn(step_size * m, denom)
    tl.store(p_ptr + offs, round_to(p, p_ptr.dtype.element_ty, INTERPRET), mask=mask)
    tl.store(m_ptr + offs, round_to(m, m_ptr.dtype.element_ty, INTERPRET), mask=mask)
    tl.store(v_ptr + offs, round_to(v, v_ptr.dtype.element_ty, INTERPRET), mask=mask)


@triton.jit
def _sumsq_kernel(x_ptr, partials_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(partials_ptr + tl.program_id(0), tl.sum(x * x, axis=0))


def adamw_update_(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, *, step: int, lr: float,
                  beta1: float, beta2: float, eps: float, weight_decay: float,
                  grad_scale: Tensor | None = None) -> None:
    """`reference.adamw_update_` in one launch (contiguous tensors of one shape; no host sync)."""
    n = param.numel()
    if n == 0:
        return
    c = scalars(step, lr, beta1, beta2, weight_decay)
    scale = grad_scale if grad_scale is not None else param  # a placeholder pointer when there is no scale
    _adamw_kernel[(triton.cdiv(n, BLOCK),)](
        param, grad, exp_avg, exp_avg_sq, scale, n, c["decay"], c["beta1"], c["one_minus_beta1"], c["beta2"],
        c["one_minus_beta2"], c["step_size"], c["bc2_sqrt"], float(eps), HAS_SCALE=grad_scale is not None,
        HAS_DECAY=weight_decay != 0, BLOCK=BLOCK, INTERPRET=interpreting(), num_warps=NUM_WARPS,
        enable_fp_fusion=False)


def grad_norm(grads: list[Tensor]) -> Tensor:
    """`reference.grad_norm` as one read of every gradient (contiguous ones; others are copied first)."""
    blocks = [triton.cdiv(g.numel(), NORM_BLOCK) for g in grads]
    partials = torch.zeros(max(1, sum(blocks)), dtype=torch.float32, device=grads[0].device)
    at = 0
    for g, nb in zip(grads, blocks):
        if nb:
            _sumsq_kernel[(nb,)](g.contiguous(), partials[at:], g.numel(), BLOCK=NORM_BLOCK, num_warps=8)
        at += nb
    return partials.sum().sqrt()
