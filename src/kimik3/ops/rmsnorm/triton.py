"""RMSNorm as one Triton kernel each way; the contract of `.reference`.

Legend: R rows (the leading dims flattened), D normalized width, P backward programs. Per row, with
r = rsqrt(mean(x^2) + eps), n = x r (fp32) and n' = n rounded to x's dtype:
    forward   y = w n'  (fp32 product, rounded to y's dtype)                        reads x, writes y and r
    backward  dn = dy w rounded to x's dtype (autograd hands n' its gradient in the dtype of n')
              dx = r (dn - n mean(dn n))                                             reads x, dy; writes dx
              dw = sum over rows of dy n'   (fp32: per-program partial sums [P, D], added by torch)
The kernels keep a whole row in registers (D <= 16384: K3's norms are 7168, 3584, 1536 and 512 wide).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kimik3.ops.triton_utils import interpreting, round_to

__all__ = ["rms_norm"]

MAX_D = 16384
ROWS_PER_PROGRAM = 16  # backward: rows whose dw products one program adds before writing its partial sum


@triton.jit
def _forward_kernel(x_ptr, w_ptr, y_ptr, r_ptr, D: tl.constexpr, eps, BLOCK_D: tl.constexpr,
                    INTERPRET: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / D + eps)
    n = round_to(x * r, x_ptr.dtype.element_ty, INTERPRET).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * D + cols, round_to(w * n, y_ptr.dtype.element_ty, INTERPRET), mask=mask)
    tl.store(r_ptr + row, r)


@triton.jit
def _backward_kernel(x_ptr, w_ptr, r_ptr, dy_ptr, dx_ptr, dw_ptr, R, D: tl.constexpr, BLOCK_D: tl.constexpr,
                     ROWS: tl.constexpr, INTERPRET: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_D], dtype=tl.float32)
    for i in range(ROWS):
        row = pid * ROWS + i
        if row < R:
            x = tl.load(x_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
            r = tl.load(r_ptr + row)
            n = x * r
            dw += dy * round_to(n, x_ptr.dtype.element_ty, INTERPRET).to(tl.float32)
            dn = round_to(dy * w, x_ptr.dtype.element_ty, INTERPRET).to(tl.float32)
            dx = r * (dn - n * (tl.sum(dn * n, axis=0) / D))
            tl.store(dx_ptr + row * D + cols, round_to(dx, dx_ptr.dtype.element_ty, INTERPRET), mask=mask)
    tl.store(dw_ptr + pid * D + cols, dw, mask=mask)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        D = x.shape[-1]
        x_RD = x.reshape(-1, D).contiguous()
        R = x_RD.shape[0]
        y = torch.empty(R, D, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
        r = torch.empty(R, dtype=torch.float32, device=x.device)
        block = triton.next_power_of_2(D)
        if R:
            _forward_kernel[(R,)](x_RD, weight.contiguous(), y, r, D=D, eps=float(eps), BLOCK_D=block,
                                  INTERPRET=interpreting(), num_warps=8 if block >= 4096 else 4)
        ctx.save_for_backward(x_RD, weight, r)
        return y.view(*x.shape[:-1], D)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x_RD, weight, r = ctx.saved_tensors
        R, D = x_RD.shape
        P = triton.cdiv(R, ROWS_PER_PROGRAM)
        dx = torch.empty_like(x_RD)
        dw_partial = torch.empty(P, D, dtype=torch.float32, device=x_RD.device)
        block = triton.next_power_of_2(D)
        if R:
            _backward_kernel[(P,)](x_RD, weight.contiguous(), r, dy.reshape(R, D).contiguous(), dx, dw_partial, R,
                                   D=D, BLOCK_D=block, ROWS=ROWS_PER_PROGRAM, INTERPRET=interpreting(),
                                   num_warps=8 if block >= 4096 else 4)
        return dx.view(dy.shape), dw_partial.sum(0).to(weight.dtype), None


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """`reference.rms_norm` through the Triton kernels (x [..., D] with D <= MAX_D, weight [D])."""
    D = x.shape[-1]
    if weight.shape != (D,) or D > MAX_D:
        raise ValueError(f"rms_norm: weight must be [{D}] and D <= {MAX_D}, got weight {list(weight.shape)}")
    return _RMSNorm.apply(x, weight, eps)
