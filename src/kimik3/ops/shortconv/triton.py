"""The decode short convolution as one Triton kernel; the contract of `.reference`.

Legend: N sequences, S slots, W conv window, P channels. Program (n, b) owns channels b*BLOCK_P.. of slot
slots[n]: it reads that slot's W-1 tail rows and x[n] there, writes the output and the tail moved on by one.
No two programs touch the same tail elements (the slots are distinct), and within a program each tail row is
read before the row below it is stored over it, by the same thread, so the in-place update needs no barrier.

Sum: fp32 products added one at a time from tap 0 (oldest) to W-1, as the reference; fp contraction (FMA) is
off, so the sum is the reference's to the bit. silu is y / (1 + exp(-y)) as torch's; its exp may differ from
torch's by an fp32 ulp or so, hence the stated bounds (tests): fp32 outputs within 1e-6 relative, bf16 within
one bf16 ulp (2^-7 relative); the tails are copies, bitwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kimik3.ops.triton_utils import interpreting, round_to

__all__ = ["decode_short_conv"]

BLOCK_P = 256  # channels per program: 48 programs per sequence at K3's P = 12288, so B = 1 still fills SMs
NUM_WARPS = 2


@triton.jit
def _decode_kernel(x_ptr, tails_ptr, slots_ptr, w_ptr, out_ptr, P, stride_xn, stride_ts, stride_tw, stride_wp,
                   W: tl.constexpr, BLOCK_P: tl.constexpr, INTERPRET: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    mask = p < P
    tail = tails_ptr + tl.load(slots_ptr + n).to(tl.int64) * stride_ts + p
    w = w_ptr + p * stride_wp
    # newest tap first, as the prefill and gathered kernels sum (a decode row equals its row in a verification or
    # prefill step); each tail row, once read, takes the row after it (the new input goes last)
    x = tl.load(x_ptr + n * stride_xn + p, mask=mask, other=0.0)
    y = x.to(tl.float32) * tl.load(w + (W - 1), mask=mask, other=0.0)
    newer = x
    for s in tl.static_range(1, W):
        row = tl.load(tail + (W - 1 - s) * stride_tw, mask=mask, other=0.0)
        y += row.to(tl.float32) * tl.load(w + (W - 1 - s), mask=mask, other=0.0)
        tl.store(tail + (W - 1 - s) * stride_tw, newer, mask=mask)
        newer = row
    out = tl.div_rn(y, 1.0 + tl.exp(-y))
    tl.store(out_ptr + n * P + p, round_to(out, out_ptr.dtype.element_ty, INTERPRET), mask=mask)


def decode_short_conv(x_NP: Tensor, tails_SWP: Tensor, slots_N: Tensor, weight_PW: Tensor) -> Tensor:
    """`reference.decode_short_conv` in one kernel launch (no host sync: CUDA-graph capturable)."""
    (N, P), (_, Wm1, P_t), W = x_NP.shape, tails_SWP.shape, weight_PW.shape[-1]
    if P_t != P or weight_PW.shape != (P, W) or Wm1 != W - 1 or W < 2 or slots_N.shape != (N,):
        raise ValueError(f"decode_short_conv: expected x [N, P], tails [S, W-1, P], slots [N], weight [P, W]; got "
                         f"{list(x_NP.shape)}, {list(tails_SWP.shape)}, {list(slots_N.shape)}, "
                         f"{list(weight_PW.shape)}")
    if tails_SWP.dtype != x_NP.dtype or weight_PW.dtype != torch.float32:
        raise ValueError(f"decode_short_conv: tails must be in x's dtype {x_NP.dtype} and weight fp32, got "
                         f"{tails_SWP.dtype} and {weight_PW.dtype}")
    if x_NP.stride(-1) != 1 or tails_SWP.stride(-1) != 1 or weight_PW.stride(-1) != 1:
        raise ValueError("decode_short_conv: x, tails and weight must be contiguous along P (and W for weight)")
    out_NP = torch.empty(N, P, dtype=x_NP.dtype, device=x_NP.device)
    if N == 0:
        return out_NP
    _decode_kernel[(N, triton.cdiv(P, BLOCK_P))](
        x_NP, tails_SWP, slots_N, weight_PW, out_NP, P, x_NP.stride(0), tails_SWP.stride(0), tails_SWP.stride(1),
        weight_PW.stride(0), W=W, BLOCK_P=BLOCK_P, INTERPRET=interpreting(),
        num_warps=NUM_WARPS, enable_fp_fusion=False)
    return out_NP


# ---- over whole sequences (`short_conv`): prefill and training ----
# Rows r of x flattened to [R = B*T, P]; t = r % T its place in its batch row and pos[t] its place in its document
# (t itself without cu_seqlens). Tap W-1-s reads row r - s where pos >= s. The sum runs s = 0 .. W-1 (newest tap
# first, the reference's order), one fp32 product and add at a time with FMA off: the pre-activation equals the
# reference's to the bit, the output within silu's ulp (as the decode kernel). The backward recomputes the
# pre-activation of each output row that reads x[r] (rows r .. r+W-1 of the same document), so nothing but x is
# saved; d w is summed per block of rows into fp32 partials, then over the blocks (a fixed order: deterministic).
BLOCK_R, BLOCK_P_SEQ = 32, 128


@triton.jit
def _pre_activation(x_ptr, w_ptr, r, pos, p, rmask, pmask, P, W: tl.constexpr):
    """fp32 [BLOCK_R, BLOCK_P]: sum over s of w[:, W-1-s] * x[r - s] where pos >= s (and r is a row)."""
    pm = pmask[None, :]
    acc = tl.load(x_ptr + r[:, None] * P + p[None, :], mask=rmask[:, None] & pm, other=0.0).to(tl.float32) \
        * tl.load(w_ptr + p * W + (W - 1), mask=pmask, other=0.0)[None, :]
    for s in tl.static_range(1, W):
        m = (rmask & (pos >= s))[:, None] & pm
        prev = tl.load(x_ptr + (r - s)[:, None] * P + p[None, :], mask=m, other=0.0).to(tl.float32)
        acc += prev * tl.load(w_ptr + p * W + (W - 1 - s), mask=pmask, other=0.0)[None, :]
    return acc


@triton.jit
def _seq_fwd_kernel(x_ptr, w_ptr, pos_ptr, y_ptr, R, T, P, W: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_P: tl.constexpr, INTERPRET: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    p = tl.program_id(1).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    rmask, pmask = r < R, p < P
    pos = tl.load(pos_ptr + r % T, mask=rmask, other=0)
    pre = _pre_activation(x_ptr, w_ptr, r, pos, p, rmask, pmask, P, W)
    out = tl.div_rn(pre, 1.0 + tl.exp(-pre))
    tl.store(y_ptr + r[:, None] * P + p[None, :], round_to(out, y_ptr.dtype.element_ty, INTERPRET),
             mask=rmask[:, None] & pmask[None, :])


@triton.jit
def _seq_bwd_kernel(x_ptr, w_ptr, pos_ptr, dy_ptr, dx_ptr, dw_ptr, R, T, P, W: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_P: tl.constexpr, INTERPRET: tl.constexpr):
    """d x[r] = sum over s of w[:, W-1-s] * d pre[r + s]; d w partials [blocks, W, P] of this block's rows."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    p = tl.program_id(1).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    rmask, pmask = r < R, p < P
    t = r % T
    x = tl.load(x_ptr + r[:, None] * P + p[None, :], mask=rmask[:, None] & pmask[None, :], other=0.0).to(tl.float32)
    dx = tl.zeros([BLOCK_R, BLOCK_P], tl.float32)
    for s in tl.static_range(0, W):
        q, tq = r + s, t + s  # the output row that reads x[r] through tap W-1-s, if in the same document
        in_row = rmask & (tq < T)
        pos_q = tl.load(pos_ptr + tq, mask=in_row, other=0)
        valid = in_row & (pos_q >= s)
        pre = _pre_activation(x_ptr, w_ptr, q, pos_q, p, valid, pmask, P, W)
        dy = tl.load(dy_ptr + q[:, None] * P + p[None, :], mask=valid[:, None] & pmask[None, :],
                     other=0.0).to(tl.float32)
        sig = 1.0 / (1.0 + tl.exp(-pre))
        dpre = tl.where(valid[:, None], dy * (sig * (1.0 + pre * (1.0 - sig))), 0.0)
        dx += dpre * tl.load(w_ptr + p * W + (W - 1 - s), mask=pmask, other=0.0)[None, :]
        tl.store(dw_ptr + (tl.program_id(0).to(tl.int64) * W + (W - 1 - s)) * P + p, tl.sum(dpre * x, 0),
                 mask=pmask)
    tl.store(dx_ptr + r[:, None] * P + p[None, :], round_to(dx, dx_ptr.dtype.element_ty, INTERPRET),
             mask=rmask[:, None] & pmask[None, :])


@triton.jit
def _gathered_fwd_kernel(ext_ptr, index_ptr, w_ptr, y_ptr, T, P, W: tl.constexpr, BLOCK_R: tl.constexpr,
                         BLOCK_P: tl.constexpr, INTERPRET: tl.constexpr):
    """y[t] = silu(sum over s of w[:, W-1-s] * ext[index[W-1-s, t]]), newest tap first (as `_pre_activation`)."""
    t = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    p = tl.program_id(1).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    tmask, pmask = t < T, p < P
    m = tmask[:, None] & pmask[None, :]
    row = tl.load(index_ptr + (W - 1) * T + t, mask=tmask, other=0)
    acc = tl.load(ext_ptr + row[:, None] * P + p[None, :], mask=m, other=0.0).to(tl.float32) \
        * tl.load(w_ptr + p * W + (W - 1), mask=pmask, other=0.0)[None, :]
    for s in tl.static_range(1, W):
        row = tl.load(index_ptr + (W - 1 - s) * T + t, mask=tmask, other=0)
        x = tl.load(ext_ptr + row[:, None] * P + p[None, :], mask=m, other=0.0).to(tl.float32)
        acc += x * tl.load(w_ptr + p * W + (W - 1 - s), mask=pmask, other=0.0)[None, :]
    out = tl.div_rn(acc, 1.0 + tl.exp(-acc))
    tl.store(y_ptr + t[:, None] * P + p[None, :], round_to(out, y_ptr.dtype.element_ty, INTERPRET), mask=m)


def gathered_short_conv(ext_XP: Tensor, index_WT: Tensor, weight_PW: Tensor) -> Tensor:
    """`reference.gathered_short_conv` in one kernel (no autograd)."""
    (_, P), (W, T) = ext_XP.shape, index_WT.shape
    if weight_PW.shape != (P, W):
        raise ValueError(f"gathered_short_conv: expected ext [X, P], index [W, T], weight [P, W]; got "
                         f"{list(ext_XP.shape)}, {list(index_WT.shape)}, {list(weight_PW.shape)}")
    ext, index, w = ext_XP.contiguous(), index_WT.contiguous(), weight_PW.float().contiguous()
    y = torch.empty(T, P, dtype=ext.dtype, device=ext.device)
    if y.numel():
        _gathered_fwd_kernel[_grid(T, P)](ext, index, w, y, T, P, W=W, BLOCK_R=BLOCK_R, BLOCK_P=BLOCK_P_SEQ,
                                          INTERPRET=interpreting(), num_warps=4,
                                          enable_fp_fusion=False)
    return y


def _positions(cu_seqlens: Tensor | None, T: int, device: torch.device) -> Tensor:
    from kimik3.ops.varlen import positions

    return positions(cu_seqlens, T, device).to(torch.int32)


def _grid(R: int, P: int) -> tuple[int, int]:
    return triton.cdiv(R, BLOCK_R), triton.cdiv(P, BLOCK_P_SEQ)


class _ShortConv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_BTP: Tensor, weight_PW: Tensor, pos_T: Tensor) -> Tensor:
        (B, T, P), W = x_BTP.shape, weight_PW.shape[-1]
        x, w = x_BTP.contiguous(), weight_PW.float().contiguous()
        y = torch.empty_like(x)
        if x.numel():
            _seq_fwd_kernel[_grid(B * T, P)](x, w, pos_T, y, B * T, T, P, W=W, BLOCK_R=BLOCK_R,
                                             BLOCK_P=BLOCK_P_SEQ, INTERPRET=interpreting(),
                                             num_warps=4, enable_fp_fusion=False)
        ctx.save_for_backward(x, w, pos_T)
        ctx.weight_dtype = weight_PW.dtype
        return y

    @staticmethod
    def backward(ctx, dy_BTP: Tensor):
        x, w, pos_T = ctx.saved_tensors
        (B, T, P), W = x.shape, w.shape[-1]
        grid = _grid(B * T, P)
        dx = torch.empty_like(x)
        dw_parts = torch.empty(grid[0], W, P, dtype=torch.float32, device=x.device)
        if x.numel():
            _seq_bwd_kernel[grid](x, w, pos_T, dy_BTP.contiguous(), dx, dw_parts, B * T, T, P, W=W,
                                  BLOCK_R=BLOCK_R, BLOCK_P=BLOCK_P_SEQ,
                                  INTERPRET=interpreting(), num_warps=4,
                                  enable_fp_fusion=False)
        dw = dw_parts.sum(0).t().to(ctx.weight_dtype)
        return dx, dw, None


def short_conv(x_BTP: Tensor, weight_PW: Tensor, cu_seqlens: Tensor | None = None) -> Tensor:
    """`reference.short_conv` as one kernel each way."""
    if x_BTP.dim() != 3 or weight_PW.dim() != 2 or weight_PW.shape[0] != x_BTP.shape[-1]:
        raise ValueError(f"short_conv: expected x [B, T, P] and weight [P, W]; got {list(x_BTP.shape)} and "
                         f"{list(weight_PW.shape)}")
    if cu_seqlens is not None and x_BTP.shape[0] != 1:
        raise ValueError(f"short_conv: cu_seqlens needs packed rows (B = 1), got B = {x_BTP.shape[0]}")
    return _ShortConv.apply(x_BTP, weight_PW, _positions(cu_seqlens, x_BTP.shape[1], x_BTP.device))
