"""`kimik3.ops.matmul.matmul` in Triton: one work split per weight shape, so a row's sums never depend on the others.

Legend: B batch, M rows, K the summed dim, N columns, S splits of K; BM x BN output tiles, BK the K step.

cuBLAS picks its kernel by the problem's shape, the row count included (a GEMV-like kernel for one row, split-K
for few rows, other tiles for many), and each kernel sums a row's K products in its own order: in bf16 a token's
logits then changed in their last bits with the batch it ran in (issue 39). Here the order is a function of (N, K)
alone: program (m tile, n tile, batch * S + split) walks its split's K range from its start in steps of BK,
accumulating in fp32 with `tl.dot`; with S > 1 the partial sums go to an fp32 workspace and a second kernel adds
the S of them in split order, then rounds once. The output tile follows M (`TILES`), the order does not: a row's
sums are the same whatever M is and wherever the row sits. fp32 inputs multiply in IEEE fp32 (torch's default,
TF32 off).

The split count (`splits`) fills the GPU at one row: the first version had none, and at M = 1 a weight of 7,168
rows was streamed by 112 programs, one an SM: the mode's batch-1 decode step took 4.7x the default's, 93% of it
here (BENCHMARKS.md). BM = 64 is a Hopper warpgroup MMA's M: rows wasted at decode (memory-bound: the weight bytes
dominate).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kimik3.ops.triton_utils import interpreting, round_to

__all__ = ["matmul", "splits"]

BK = 64  # the K step: with the split, what fixes a row's order of summation
# (up to M rows, BM, BN, warps, stages), the first that fits: 64 x 64 tiles at decode sizes (memory-bound: more
# programs stream the weight), 128 x 128 on two warpgroups above (prefill chunks: each loaded tile used twice as
# often). The tile is free to follow M: each output element is the same K16 MMA steps in the same order whatever
# the tile's shape (on the H200 every row of a slice-12 step's products came out bit for bit the same under five
# tilings at 1, 8, 64 and 2,048 rows: bench_matmul's "same bits"; tests/ops/test_matmul.py crosses the boundary)
TILES = ((64, 64, 64, 4, 4), (2**62, 128, 128, 8, 3))
TARGET_PROGRAMS = 256  # programs a one-row product should have: about two an H200 SM
SPLIT_TILE_N = 64  # the column tile `splits` counts programs in (the decode tile's): fixed, whatever tile runs
MIN_STEPS = 4  # BK steps a split walks at least
BLOCK = 1024  # workspace elements per program of the split sum


def tiling(M: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BM, BN, warps, stages) for a product of M rows (TILES). fp32 inputs keep the first tile at every M: their
    products run on FMA units, whose per-element order across tile shapes was not measured, and 128 x 128 fp32
    tiles in 3 stages would take 192 KB of shared memory."""
    return next(t[1:] for t in TILES if M <= t[0] or dtype == torch.float32)


def splits(N: int, K: int) -> int:
    """S, the splits of K for a [K, N] operand: enough programs at one row tile (column tiles x S ~
    TARGET_PROGRAMS), each walking at least MIN_STEPS steps of BK. A function of the weight's shape only, never of M."""
    return max(1, min(triton.cdiv(TARGET_PROGRAMS, triton.cdiv(N, SPLIT_TILE_N)), triton.cdiv(K, BK * MIN_STEPS)))


# the row count, the batch strides (which follow it) and the split (which follows the weight) are not specialized
# on: Triton would compile a variant per value that is 1, a multiple of 16 or neither, mid-run, as steps of new
# sizes arrive. Unspecialized, their alignment is unknown to Triton, and an offset it cannot prove aligned makes
# it load element by element (2-byte loads, no asynchronous copies: the first two versions ran at a fifth of the
# copy rate); ALIGNED (checked at launch: every batch and split stride a multiple of 8 elements) restores it.
@triton.jit(do_not_specialize=["M", "S", "steps", "stride_ab", "stride_bb", "stride_cb", "stride_cs"])
def _matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, S, steps, stride_ab, stride_am, stride_ak, stride_bb, stride_bk,
                   stride_bn, stride_cb, stride_cs, stride_cm, stride_cn, BM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, ALIGNED: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr):
    """c[z, s] = a[z][:, K range s] @ b[z][K range s, :] (K range s = `steps` steps of BK from s * steps * BK), in
    fp32; with S == 1 the product itself, rounded to c's dtype."""
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    z = (tl.program_id(2) // S).to(tl.int64)
    split = tl.program_id(2) % S
    k = tl.arange(0, BK)
    a_at, b_at, c_at = z * stride_ab, z * stride_bb, z * stride_cb + split * stride_cs
    if ALIGNED:
        a_at, b_at, c_at = tl.multiple_of(a_at, 8), tl.multiple_of(b_at, 8), tl.multiple_of(c_at, 8)
    a_rows = a_ptr + a_at + m[:, None].to(tl.int64) * stride_am
    b_cols = b_ptr + b_at + n[None, :].to(tl.int64) * stride_bn
    acc = tl.zeros([BM, BN], tl.float32)
    for i in range(split * steps, tl.minimum(split * steps + steps, tl.cdiv(K, BK))):
        kk = i * BK + k
        a = tl.load(a_rows + kk[None, :] * stride_ak, mask=(m[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(b_cols + kk[:, None] * stride_bk, mask=(kk[:, None] < K) & (n[None, :] < N), other=0.0)
        if INTERPRET:  # Triton's interpreter has no bf16 arithmetic: the same values, multiplied in fp32
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    c = c_ptr + c_at + m[:, None].to(tl.int64) * stride_cm + n[None, :] * stride_cn
    tl.store(c, round_to(acc, c_ptr.dtype.element_ty, INTERPRET), mask=(m[:, None] < M) & (n[None, :] < N))


@triton.jit(do_not_specialize=["MN", "S", "stride_cb"])
def _sum_splits_kernel(w_ptr, c_ptr, MN, N, S, stride_cb, stride_cm, stride_cn, BLOCK: tl.constexpr,
                       ALIGNED: tl.constexpr, INTERPRET: tl.constexpr):
    """c[z] = the S fp32 partials of workspace w [B, S, M, N] added in split order, rounded once (ALIGNED: MN and
    c's batch stride multiples of 8)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    z = tl.program_id(1).to(tl.int64)
    live = i < MN
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(S):
        at = (z * S + s) * MN
        if ALIGNED:
            at = tl.multiple_of(at, 8)
        acc += tl.load(w_ptr + at + i, mask=live, other=0.0)
    c_at = z * stride_cb
    if ALIGNED:
        c_at = tl.multiple_of(c_at, 8)
    c = c_ptr + c_at + (i // N) * stride_cm + (i % N) * stride_cn
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
    steps = triton.cdiv(triton.cdiv(K, BK), S)  # each split's K range: whole BK steps
    # S > 1: fp32 partials [B, S, M, N], added in split order by the second kernel
    w = c if S == 1 else torch.empty(Bt, S, M, N, dtype=torch.float32, device=a.device)
    stride_wb, stride_ws, stride_wm, stride_wn = (c.stride(0), 0, *c.stride()[1:]) if S == 1 else w.stride()
    aligned = all(x % 8 == 0 for x in (a3.stride(0), b3.stride(0), stride_wb, stride_ws))
    BM, BN, warps, stages = tiling(M, a.dtype)
    _matmul_kernel[(triton.cdiv(M, BM), triton.cdiv(N, BN), Bt * S)](
        a3, b3, w, M, N, K, S, steps, *a3.stride(), *b3.stride(), stride_wb, stride_ws, stride_wm, stride_wn,
        BM=BM, BN=BN, BK=BK, ALIGNED=aligned, IEEE=a.dtype == torch.float32, INTERPRET=interpret, num_warps=warps,
        num_stages=stages)
    if S > 1:
        _sum_splits_kernel[(triton.cdiv(M * N, BLOCK), Bt)](
            w, c, M * N, N, S, *c.stride(), BLOCK=BLOCK, ALIGNED=(M * N) % 8 == 0 and c.stride(0) % 8 == 0,
            INTERPRET=interpret, num_warps=4)
    return c if batched else c[0]
