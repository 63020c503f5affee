"""SiTU-GLU as one Triton kernel each way; the contract of `.reference`. Also the device functions the MXFP4
expert kernels use in their epilogue (`tanh`, `situ`).

Legend: n elements (gate and up flattened). With t = tanh(g / beta), s = sigmoid(g), v = tanh(u / linear_beta):
    forward   out = (beta t s) (linear_beta v)
    backward  d g = d out * linear_beta v * ((1 - t^2) s + beta t s (1 - s)),   d u = d out * beta t s * (1 - v^2)
All in fp32 from inputs of any float dtype; outputs in the inputs' dtype, rounded to nearest. Forward reads
gate and up and writes the output (6 bytes per element in bf16); backward reads them and d out and writes both
gradients (10 bytes): the inputs are what autograd keeps, not the reference's fp32 intermediates.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kimik3.ops.triton_utils import interpreting, round_to

__all__ = ["situ", "situ_glu", "tanh"]

BLOCK = 2048  # elements per program
NUM_WARPS = 8


@triton.jit
def tanh(x):
    # exp-based tanh, exact to a few fp32 ulps; the odd Taylor series near 0 avoids the 1 - e^(-2|x|) cancellation
    ax = tl.abs(x)
    t = tl.exp(-2.0 * ax)
    big = (1.0 - t) / (1.0 + t)
    x2 = ax * ax
    small = ax * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))))
    r = tl.where(ax < 0.0625, small, big)
    return tl.where(x < 0, -r, r)


@triton.jit
def situ(g, u, beta, linear_beta):
    """SiTU-GLU of gate / up values (fp32 in, fp32 out), as the reference."""
    a = beta * tanh(tl.div_rn(g, beta)) * tl.sigmoid(g)
    return a * (linear_beta * tanh(tl.div_rn(u, linear_beta)))


@triton.jit
def _forward_kernel(g_ptr, u_ptr, out_ptr, n, beta, linear_beta, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    out = situ(g, u, beta, linear_beta)
    tl.store(out_ptr + offs, round_to(out, out_ptr.dtype.element_ty, INTERPRET), mask=mask)


@triton.jit
def _backward_kernel(g_ptr, u_ptr, d_out_ptr, d_g_ptr, d_u_ptr, n, beta, linear_beta, BLOCK: tl.constexpr,
                     INTERPRET: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    d_out = tl.load(d_out_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    t = tanh(tl.div_rn(g, beta))
    s = tl.sigmoid(g)
    v = tanh(tl.div_rn(u, linear_beta))
    d_g = d_out * (linear_beta * v) * ((1.0 - t * t) * s + beta * t * s * (1.0 - s))
    d_u = d_out * (beta * t * s) * (1.0 - v * v)
    tl.store(d_g_ptr + offs, round_to(d_g, d_g_ptr.dtype.element_ty, INTERPRET), mask=mask)
    tl.store(d_u_ptr + offs, round_to(d_u, d_u_ptr.dtype.element_ty, INTERPRET), mask=mask)


def _launch(kernel, n: int, *args) -> None:
    interpret = interpreting()
    kernel[(triton.cdiv(n, BLOCK),)](*args, BLOCK=BLOCK, INTERPRET=interpret, num_warps=NUM_WARPS)


class _SituGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor, beta: float, linear_beta: float) -> Tensor:
        g, u = gate.contiguous(), up.contiguous()
        out = torch.empty_like(g)
        _launch(_forward_kernel, g.numel(), g, u, out, g.numel(), float(beta), float(linear_beta))
        ctx.save_for_backward(g, u)
        ctx.betas = (float(beta), float(linear_beta))
        return out

    @staticmethod
    def backward(ctx, d_out: Tensor):
        g, u = ctx.saved_tensors
        d_g, d_u = torch.empty_like(g), torch.empty_like(u)
        _launch(_backward_kernel, g.numel(), g, u, d_out.contiguous(), d_g, d_u, g.numel(), *ctx.betas)
        return d_g, d_u, None, None


def situ_glu(gate: Tensor, up: Tensor, beta: float, linear_beta: float) -> Tensor:
    """`reference.situ_glu` through the Triton kernels (gate and up of one shape and dtype)."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"situ_glu: gate and up must match, got {list(gate.shape)} {gate.dtype} and "
                         f"{list(up.shape)} {up.dtype}")
    if gate.numel() == 0:
        return torch.empty_like(gate)
    return _SituGLU.apply(gate, up, beta, linear_beta)
