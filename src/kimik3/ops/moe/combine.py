"""The routed rows' two data movements in training, each as a gather with a summing partner: no scatter, no
atomics, no fp32 copy of the routed rows.

Legend: N tokens, A active experts per token, M = N*A routed rows sorted by expert, L latent width.
`inv` [N, A] int: the sorted row that holds token n's a-th choice (the inverse of the sort's `order`).

    dispatch   x[m] = z[tok[m]]                         backward  dz[n]   = sum_a dx[inv[n, a]]          (fp32 sum)
    combine    out[n] = sum_a w[n, a] y[inv[n, a]]      backward  dy[inv[n, a]] = w[n, a] dout[n]
                         (fp32 sum, rounded once)                  dw[n, a]      = dout[n] . y[inv[n, a]]   (fp32)

Their reference is `grouped.reference_combine` with autograd's `z[tok]` (fp32 copies of the M rows, weighted,
scatter-added with `index_add`; autograd differentiates both). The Triton kernels compute the same sums in a
fixed order: one program per (token, block of L) adds its A rows in fp32 and rounds once; the dispatch backward is
the same kernel without weights, and the combine backward writes each routed row's gradient and its weight's dot
product from one read of d out and the row. For K3 training (T=8192, A=16, L=3584) the reference moves the
131,072 routed rows through fp32 several times (each fp32 copy is 1.9 GB) and keeps one for backward; the kernels
read the bf16 rows once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kimik3.ops.triton_utils import interpreting, round_to

__all__ = ["combine", "dispatch", "inverse", "slot_sum"]

BLOCK_L = 512


@triton.jit
def _sum_rows_kernel(rows_ptr, inv_ptr, w_ptr, out_ptr, L: tl.constexpr, A: tl.constexpr, HAS_W: tl.constexpr,
                     HAS_INV: tl.constexpr, BLOCK_L: tl.constexpr, INTERPRET: tl.constexpr):
    """out[n, l-block] = sum_a (w[n, a] *) rows[inv[n, a] (or n * A + a), l-block], in fp32, rounded once."""
    n = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    mask = cols < L
    acc = tl.zeros([BLOCK_L], dtype=tl.float32)
    for a in range(A):
        if HAS_INV:
            row = tl.load(inv_ptr + n * A + a).to(tl.int64)
        else:
            row = n * A + a
        x = tl.load(rows_ptr + row * L + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_W:
            x = x * tl.load(w_ptr + n * A + a)
        acc += x
    tl.store(out_ptr + n * L + cols, round_to(acc, out_ptr.dtype.element_ty, INTERPRET), mask=mask)


@triton.jit
def _combine_backward_kernel(d_out_ptr, y_ptr, inv_ptr, w_ptr, d_y_ptr, d_w_ptr, L: tl.constexpr, A: tl.constexpr,
                             BLOCK_L: tl.constexpr, INTERPRET: tl.constexpr):
    """For routed choice (n, a) at sorted row r = inv[n, a]: d_y[r] = w[n, a] d_out[n], d_w[n, a] = d_out[n] . y[r]."""
    i = tl.program_id(0).to(tl.int64)  # n * A + a
    n = i // A
    row = tl.load(inv_ptr + i).to(tl.int64)
    w = tl.load(w_ptr + i)
    dot = tl.zeros([BLOCK_L], dtype=tl.float32)
    for start in range(0, L, BLOCK_L):
        cols = start + tl.arange(0, BLOCK_L)
        mask = cols < L
        d = tl.load(d_out_ptr + n * L + cols, mask=mask, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + row * L + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(d_y_ptr + row * L + cols, round_to(d * w, d_y_ptr.dtype.element_ty, INTERPRET), mask=mask)
        dot += d * y
    tl.store(d_w_ptr + i, tl.sum(dot, axis=0))


def _sum_rows(rows_ML: Tensor, inv_NA: Tensor | None, w_NA: Tensor | None, dtype: torch.dtype,
              shape: tuple[int, int] | None = None) -> Tensor:
    N, A = inv_NA.shape if inv_NA is not None else shape
    L = rows_ML.shape[1]
    out = torch.empty(N, L, dtype=dtype, device=rows_ML.device)
    if N and L:
        some = inv_NA if inv_NA is not None else rows_ML  # a pointer for the arguments a constexpr switches off
        _sum_rows_kernel[(N, triton.cdiv(L, BLOCK_L))](
            rows_ML, some, w_NA if w_NA is not None else some, out, L, A=A, HAS_W=w_NA is not None,
            HAS_INV=inv_NA is not None, BLOCK_L=BLOCK_L, INTERPRET=interpreting(), num_warps=4)
    return out


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z_NL: Tensor, tok_M: Tensor, inv_NA: Tensor) -> Tensor:
        ctx.save_for_backward(inv_NA)
        return z_NL[tok_M]

    @staticmethod
    def backward(ctx, d_x_ML: Tensor):
        (inv_NA,) = ctx.saved_tensors
        return _sum_rows(d_x_ML.contiguous(), inv_NA, None, d_x_ML.dtype), None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_ML: Tensor, inv_NA: Tensor, w_NA: Tensor) -> Tensor:
        y, w = y_ML.contiguous(), w_NA.float().contiguous()
        ctx.save_for_backward(y, inv_NA, w)
        ctx.w_dtype = w_NA.dtype
        return _sum_rows(y, inv_NA, w, y.dtype)

    @staticmethod
    def backward(ctx, d_out_NL: Tensor):
        y, inv_NA, w = ctx.saved_tensors
        N, A = inv_NA.shape
        d_y, d_w = torch.empty_like(y), torch.empty(N, A, dtype=torch.float32, device=y.device)
        if N and y.shape[1]:
            _combine_backward_kernel[(N * A,)](d_out_NL.contiguous(), y, inv_NA, w, d_y, d_w, y.shape[1], A=A,
                                               BLOCK_L=BLOCK_L, INTERPRET=interpreting(), num_warps=4)
        elif N:
            d_w.zero_()
        return d_y, None, d_w.to(ctx.w_dtype)


def dispatch(z_NL: Tensor, tok_M: Tensor, inv_NA: Tensor) -> Tensor:
    """z[tok] [M, L]; its gradient sums each token's A rows in fp32 (a gather, not a scatter-add)."""
    return _Dispatch.apply(z_NL, tok_M, inv_NA)


def combine(y_ML: Tensor, inv_NA: Tensor, w_NA: Tensor) -> Tensor:
    """[N, L] in y's dtype: sum_a w[n, a] y[inv[n, a]] in fp32, rounded once; `reference_combine`'s value."""
    return _Combine.apply(y_ML, inv_NA, w_NA)


def slot_sum(y_ML: Tensor, w_NA: Tensor) -> Tensor:
    """[N, L] in y's dtype: sum_a w[n, a] y[n * A + a] in fp32 in slot order, rounded once (inference: no
    autograd). The combine of the W4A16 kernels, whose rows come back in (token, slot) order."""
    return _sum_rows(y_ML, None, w_NA.float().contiguous(), y_ML.dtype, tuple(w_NA.shape))


def inverse(order_M: Tensor, N: int, A: int) -> Tensor:
    """[N, A] int32: the sorted position of each (token, choice), from the sort's `order` [M]."""
    inv = torch.empty_like(order_M, dtype=torch.int32)
    inv[order_M] = torch.arange(order_M.numel(), device=order_M.device, dtype=torch.int32)
    return inv.view(N, A)
