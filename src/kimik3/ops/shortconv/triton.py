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

from kimik3.ops.situ.triton import round_to

__all__ = ["decode_short_conv"]

BLOCK_P = 256  # channels per program: 32 programs per sequence at K3's P = 8192, so B = 1 still fills SMs
NUM_WARPS = 2


@triton.jit
def _decode_kernel(x_ptr, tails_ptr, slots_ptr, w_ptr, out_ptr, P, stride_xn, stride_ts, stride_tw, stride_wp,
                   W: tl.constexpr, BLOCK_P: tl.constexpr, INTERPRET: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    mask = p < P
    tail = tails_ptr + tl.load(slots_ptr + n).to(tl.int64) * stride_ts + p
    w = w_ptr + p * stride_wp
    row = tl.load(tail, mask=mask, other=0.0)
    y = row.to(tl.float32) * tl.load(w, mask=mask, other=0.0)
    for j in tl.static_range(1, W - 1):
        row = tl.load(tail + j * stride_tw, mask=mask, other=0.0)
        y += row.to(tl.float32) * tl.load(w + j, mask=mask, other=0.0)
        tl.store(tail + (j - 1) * stride_tw, row, mask=mask)  # row j-1 was read in the step before
    x = tl.load(x_ptr + n * stride_xn + p, mask=mask, other=0.0)
    y += x.to(tl.float32) * tl.load(w + (W - 1), mask=mask, other=0.0)
    tl.store(tail + (W - 2) * stride_tw, x, mask=mask)
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
        weight_PW.stride(0), W=W, BLOCK_P=BLOCK_P, INTERPRET=bool(triton.knobs.runtime.interpret),
        num_warps=NUM_WARPS, enable_fp_fusion=False)
    return out_NP
