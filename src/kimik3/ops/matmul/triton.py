"""`kimik3.ops.matmul.matmul` in Triton: one work split per weight shape, so a row's sums never depend on the others.

Legend: B batch, M rows, K the summed dim, N columns, S splits of K; BM x BN output tiles, BK the K step.

cuBLAS picks its kernel by the problem's shape, the row count included (a GEMV-like kernel for one row, split-K
for few rows, other tiles for many), and each kernel sums a row's K products in its own order: in bf16 a token's
logits then changed in their last bits with the batch it ran in (issue 39). Here the order is a function of (N, K)
alone: program (m tile, n tile, batch * S + split) walks its split's K range from its start in steps of BK,
accumulating in fp32 with `tl.dot` on fixed BM, BN, BK and warps (one MMA instruction shape); with S > 1 the
partial sums go to an fp32 workspace and a second kernel adds the S of them in split order, then rounds once. A
row's sums are the same whatever M is and wherever the row sits. fp32 inputs multiply in IEEE fp32 (torch's
default, TF32 off).

The split count (`splits`) fills the GPU at one row: the first version had none, and at M = 1 a weight of 7,168
rows was streamed by 112 programs, one an SM, at ~0.56 TB/s: the mode's batch-1 decode step took 4.7x the default's,
93% of it here (BENCHMARKS.md). BM = 64 is a Hopper warpgroup MMA's M: rows wasted at decode (memory-bound: the
weight bytes dominate), 64-row tiles at prefill.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kimik3.ops.triton_utils import interpreting, round_to

__all__ = ["matmul", "splits"]

BM, BN, BK = 64, 64, 64
NUM_WARPS, NUM_STAGES = 4, 4
TARGET_PROGRAMS = 256  # programs a one-row product should have: about two an H200 SM
MIN_STEPS = 4  # BK steps a split walks at least
BLOCK = 1024  # workspace elements per program of the split sum


def splits(N: int, K: int) -> int:
    """S, the splits of K for a [K, N] operand: enough programs at one row tile (n tiles x S ~ TARGET_PROGRAMS),
    each walking at least MIN_STEPS steps of BK. A function of the weight's shape only, never of M."""
    return max(1, min(triton.cdiv(TARGET_PROGRAMS, triton.cdiv(N, BN)), triton.cdiv(K, BK * MIN_STEPS)))


# the row count, the batch strides (which follow it) and the split (which follows the weight) are not specialized
# on: Triton would compile a variant per value that is 1, a multiple of 16 or neither, mid-run, as steps of new
# sizes arrive
@triton.jit(do_not_specialize=["M", "S", "chunk", "stride_ab", "stride_bb", "stride_cb", "stride_cs"])
def _matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, S, chunk, stride_ab, stride_am, stride_ak, stride_bb, stride_bk,
                   stride_bn, stride_cb, stride_cs, stride_cm, stride_cn, BM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr):
    """c[z, s] = a[z][:, K range s] @ b[z][K range s, :] (K range s = [s * chunk, (s + 1) * chunk)), in fp32; with
    S == 1 the product itself, rounded to c's dtype."""
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    z = (tl.program_id(2) // S).to(tl.int64)
    split = tl.program_id(2) % S
    k = tl.arange(0, BK)
    a_rows = a_ptr + z * stride_ab + m[:, None].to(tl.int64) * stride_am
    b_cols = b_ptr + z * stride_bb + n[None, :].to(tl.int64) * stride_bn
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(split * chunk, tl.minimum(split * chunk + chunk, K), BK):
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
    c = c_ptr + z * stride_cb + split * stride_cs + m[:, None].to(tl.int64) * stride_cm + n[None, :] * stride_cn
    tl.store(c, round_to(acc, c_ptr.dtype.element_ty, INTERPRET), mask=(m[:, None] < M) & (n[None, :] < N))


@triton.jit(do_not_specialize=["MN", "S", "stride_cb"])
def _sum_splits_kernel(w_ptr, c_ptr, MN, N, S, stride_cb, stride_cm, stride_cn, BLOCK: tl.constexpr,
                       INTERPRET: tl.constexpr):
    """c[z] = the S fp32 partials of workspace w [B, S, M, N] added in split order, rounded once."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    z = tl.program_id(1).to(tl.int64)
    live = i < MN
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(S):
        acc += tl.load(w_ptr + (z * S + s) * MN + i, mask=live, other=0.0)
    c = c_ptr + z * stride_cb + (i // N) * stride_cm + (i % N) * stride_cn
    tl.store(c, round_to(acc, c_ptr.dtype.element_ty, INTERPRET), mask=live)


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
    if not c.numel():
        return c if batched else c[0]
    if K == 0:
        c.zero_()
        return c if batched else c[0]
    S, interpret = splits(N, K), interpreting()
    chunk = triton.cdiv(triton.cdiv(K, BK), S) * BK  # each split's K range: whole BK steps
    # S > 1: fp32 partials [B, S, M, N], added in split order by the second kernel
    w = c if S == 1 else torch.empty(Bt, S, M, N, dtype=torch.float32, device=a.device)
    stride_wb, stride_ws, stride_wm, stride_wn = (c.stride(0), 0, *c.stride()[1:]) if S == 1 else w.stride()
    _matmul_kernel[(triton.cdiv(M, BM), triton.cdiv(N, BN), Bt * S)](
        a3, b3, w, M, N, K, S, chunk, *a3.stride(), *b3.stride(), stride_wb, stride_ws, stride_wm, stride_wn,
        BM=BM, BN=BN, BK=BK, IEEE=a.dtype == torch.float32, INTERPRET=interpret, num_warps=NUM_WARPS,
        num_stages=NUM_STAGES)
    if S > 1:
        _sum_splits_kernel[(triton.cdiv(M * N, BLOCK), Bt)](w, c, M * N, N, S, *c.stride(), BLOCK=BLOCK,
                                                            INTERPRET=interpret, num_warps=4)
    return c if batched else c[0]
