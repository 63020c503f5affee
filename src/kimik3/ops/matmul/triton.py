"""`kimik3.ops.matmul.matmul` in Triton: one tiling for every row count, so a row's sums never depend on the others.

Legend: B batch, M rows, K the summed dim, N columns; BM x BN output tiles, BK the K step.

cuBLAS picks its kernel by the problem's shape, the row count included (a GEMV-like kernel for one row, split-K
for few rows, other tiles for many), and each kernel sums a row's K products in its own order: in bf16 a token's
logits then changed in their last bits with the batch it ran in (issue 39). Here every call of a given dtype runs
one kernel: program (m tile, n tile, batch) walks K from 0 in steps of BK, accumulating in fp32 with `tl.dot` on
fixed BM, BN, BK and warps (so one MMA instruction shape), then rounds once. A row's sums are therefore the same
whatever M is and wherever the row sits: no split-K, no shape-dependent choice. fp32 inputs multiply in IEEE fp32
(torch's default, TF32 off).

The cost is the row count's tuning that cuBLAS would do: BM = 64 is a Hopper warpgroup MMA's M, wasted rows at
decode (memory-bound: the weight bytes dominate) and 64-row tiles at prefill. BENCHMARKS.md has the measured cost.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kimik3.ops.triton_utils import interpreting, round_to

__all__ = ["matmul"]

BM, BN, BK = 64, 64, 64
NUM_WARPS, NUM_STAGES = 4, 4


# the row count and the batch strides (which follow it) are not specialized on: Triton would compile a variant per
# value that is 1, a multiple of 16 or neither, mid-run, as steps of new sizes arrive
@triton.jit(do_not_specialize=["M", "stride_ab", "stride_bb", "stride_cb"])
def _matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_ab, stride_am, stride_ak, stride_bb, stride_bk, stride_bn,
                   stride_cb, stride_cm, stride_cn, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   IEEE: tl.constexpr, INTERPRET: tl.constexpr):
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    z = tl.program_id(2).to(tl.int64)
    k = tl.arange(0, BK)
    a_rows = a_ptr + z * stride_ab + m[:, None].to(tl.int64) * stride_am
    b_cols = b_ptr + z * stride_bb + n[None, :].to(tl.int64) * stride_bn
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + k
        a = tl.load(a_rows + kk[None, :] * stride_ak, mask=(m[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(b_cols + kk[:, None] * stride_bk, mask=(kk[:, None] < K) & (n[None, :] < N), other=0.0)
        if INTERPRET:  # Triton's interpreter has no bf16 arithmetic: the same values, multiplied in fp32
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    c = c_ptr + z * stride_cb + m[:, None].to(tl.int64) * stride_cm + n[None, :] * stride_cn
    tl.store(c, round_to(acc, c_ptr.dtype.element_ty, INTERPRET), mask=(m[:, None] < M) & (n[None, :] < N))


def matmul(a: Tensor, b: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
    """`reference.matmul` (same contract): a [M, K] @ b [K, N] or a [B, M, K] @ b [B, K, N], any strides, 16-bit or
    fp32 inputs of one dtype."""
    batched = a.dim() == 3
    a3, b3 = (a, b) if batched else (a.unsqueeze(0), b.unsqueeze(0))
    (Bt, M, K), N = a3.shape, b3.shape[2]
    if b3.shape[0] != Bt or b3.shape[1] != K:
        raise ValueError(f"matmul: shapes {list(a.shape)} and {list(b.shape)} do not multiply")
    if a.dtype != b.dtype:
        raise ValueError(f"matmul: a and b must have one dtype, got {a.dtype} and {b.dtype}")
    c = torch.empty(Bt, M, N, dtype=out_dtype or a.dtype, device=a.device)
    if c.numel():
        if K == 0:
            c.zero_()
        else:
            grid = (triton.cdiv(M, BM), triton.cdiv(N, BN), Bt)
            _matmul_kernel[grid](a3, b3, c, M, N, K, *a3.stride(), *b3.stride(), *c.stride(), BM=BM, BN=BN, BK=BK,
                                 IEEE=a.dtype == torch.float32, INTERPRET=interpreting(), num_warps=NUM_WARPS,
                                 num_stages=NUM_STAGES)
    return c if batched else c[0]
