"""Routed experts on MXFP4-packed weights (W4A16): Triton grouped GEMMs that decode the codes in the kernel.

Legend: N tokens, A active experts per token, M = N*A routed rows, E experts, L latent width, F expert width,
T tiles (a static bound), BM rows per tile; packed weights [E, out, in/2] uint8, scales [E, out, in/32] uint8.

A copy of z, a sort and four launches; nothing waits on the host (grid sizes come from N, A, E and the shapes):
    route    a stable sort of the M rows by expert (torch), then one program: rows per expert (histogram) and
             per tile its expert, first and end sorted row. T = M // BM + min(E, M) bounds the tile count for
             any routing; surplus tiles are empty (first row == end row) and exit at once.
    stage 1  per (tile, F block): x @ w1^T and x @ w3^T with w1/w3 decoded in registers, each rounded to the
             compute dtype (as the reference's matmuls), SiTU in fp32 -> h [M, F] (sorted rows).
    stage 2  per (tile, L block): y = h @ w2^T rounded to the compute dtype -> y [M, L] in (token, slot) order.
    combine  per token: out = sum over its A slots of w * float(y), in fp32, then cast (`combine.slot_sum`).
The combine is a deterministic sum in slot order rather than fp32 atomics (the reference adds in ascending
expert order: the two differ by fp32 rounding only); the y round trip costs 4*M*L bytes, ~1% of the weight bytes
at decode, ~5% at 4096 tokens. Outputs are bitwise reproducible run to run.

Decode (exact, as `mxfp4.decode`): a code's magnitude bits placed at bf16 bits 6-8 with its sign at bit 15 is the
bf16 subnormal E2M1 * 2^-126; multiplying by 2^126 and then by 2^(s-127) (s = 0: the subnormal 2^-127; s = 255:
inf) rounds nothing. The K axis is split into the even and odd columns of each 32-column group (low and high
nibbles), x @ W^T = x_even @ W_lo^T + x_odd @ W_hi^T, and the activations are stored group-interleaved (16 even
then 16 odd columns) so that both halves load as plain runs.
fp16 activations decode through fp32 and round to fp16, as the reference does.

Tiles (`_CONFIGS`, measured on an H200 at K3 size, bench/bench_moe.py): with few rows per expert (decode, and
up to ~24 rows per expert) the weights are the MMA's M side (SWAP: acc^T = W @ x^T, 16 token columns) and the
kernels stream the weights, bound by the decode's ALU work; with many rows, 128-token tiles. topk_idx must hold
experts in [0, E) (not checked: that would need the host); `rows` skips the rows of expert E or more.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kimik3.ops.backend import batch_invariant_mode
from kimik3.ops.moe.combine import slot_sum
from kimik3.ops.mxfp4 import GROUP_SIZE
from kimik3.ops.mxfp4.triton import decode_tile, decode_tile_bf16
from kimik3.ops.situ.triton import situ
from kimik3.ops.triton_utils import interpreting, round_to


@triton.jit
def _mx_acc(acc, x_lo, x_hi, wp_ptr, ws_ptr, n, kb, ld_p, ld_s,
            BKH: tl.constexpr, SWAP: tl.constexpr, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """acc += x @ W[n, kb*2 : kb*2 + 2*BKH]^T for one K step (acc^T in SWAP orientation).

    x_lo/x_hi: [BM, BKH] even/odd columns of the activations; wp_ptr/ws_ptr: packed/scale rows of this expert.
    kb: first packed byte of the step (a multiple of 16, so whole scale groups).
    """
    BN: tl.constexpr = n.shape[0]
    jp = kb + tl.arange(0, BKH)
    js = kb // 16 + tl.arange(0, BKH // 16)
    p = tl.load(wp_ptr + n[:, None] * ld_p + jp[None, :])
    s = tl.load(ws_ptr + n[:, None] * ld_s + js[None, :])
    if INTERPRET:  # Triton's interpreter has no bf16 arithmetic: the same values, multiplied in fp32
        w_lo, w_hi = decode_tile(p, s, BN, BKH, tl.float32)
        x_lo = x_lo.to(tl.float32)
        x_hi = x_hi.to(tl.float32)
    elif DTYPE == tl.bfloat16:
        w_lo, w_hi = decode_tile_bf16(p, s, BN, BKH)
    else:
        w_lo, w_hi = decode_tile(p, s, BN, BKH, DTYPE)
    if SWAP:
        acc = tl.dot(w_lo, tl.trans(x_lo), acc)
        acc = tl.dot(w_hi, tl.trans(x_hi), acc)
    else:
        acc = tl.dot(x_lo, tl.trans(w_lo), acc)
        acc = tl.dot(x_hi, tl.trans(w_hi), acc)
    return acc


@triton.jit
def _load_x(x_ptr, rows, r_mask, k0, ld_x, BM: tl.constexpr, BKH: tl.constexpr):
    """Even and odd columns k0:k0+2*BKH of activation rows stored group-interleaved (see `_interleave`).

    Each 32-column group is stored as its 16 even columns then its 16 odd ones, so both halves are plain
    16-wide runs: no register shuffles to split them.
    """
    i = tl.arange(0, BKH)
    c = tl.max_contiguous(tl.multiple_of(k0 + (i // 16) * 32 + (i % 16), 16), 16)
    ptr = x_ptr + rows[:, None].to(tl.int64) * ld_x + c[None, :]
    x_lo = tl.load(ptr, mask=r_mask[:, None], other=0.0)
    x_hi = tl.load(ptr + 16, mask=r_mask[:, None], other=0.0)
    return x_lo, x_hi


@triton.jit
def _tiles_kernel(idx_ptr, tiles_ptr, M, T, E: tl.constexpr, EB: tl.constexpr, BM: tl.constexpr,
                  M_PAD: tl.constexpr, CH: tl.constexpr):
    """tiles[:, t] = (expert, first row, end row) of tile t over the expert-sorted rows; surplus tiles empty.
    Rows of expert E or more are skipped (they sort after every expert's rows and no tile covers them)."""
    ex = tl.arange(0, EB)
    counts = tl.zeros((EB,), tl.int32)
    for m0 in range(0, M_PAD, CH):
        m = m0 + tl.arange(0, CH)
        e = tl.load(idx_ptr + m, mask=m < M, other=0).to(tl.int32)
        counts += tl.histogram(e, EB, mask=(m < M) & (e < E))
    r_end = tl.cumsum(counts, 0)
    r_beg = r_end - counts
    n_t = (counts + BM - 1) // BM
    t_beg = tl.cumsum(n_t, 0) - n_t
    most = tl.max(n_t, 0)
    for j in range(0, (M_PAD + BM - 1) // BM):  # j-th tile of every expert that has one
        if j < most:
            has = j < n_t
            r0 = r_beg + j * BM
            tl.store(tiles_ptr + t_beg + j, ex, mask=has)
            tl.store(tiles_ptr + T + t_beg + j, r0, mask=has)
            tl.store(tiles_ptr + 2 * T + t_beg + j, tl.minimum(r0 + BM, r_end), mask=has)
    used = tl.sum(n_t, 0)
    for t0 in range(0, (M_PAD + BM - 1) // BM + E, CH):
        t = t0 + tl.arange(0, CH)
        for k in tl.static_range(3):
            tl.store(tiles_ptr + k * T + t, tl.zeros((CH,), tl.int32), mask=(t >= used) & (t < T))


@triton.jit
def _tile(tiles_ptr, T, tile):
    """(expert, first row, end row) of one tile; surplus tiles have first row >= end row."""
    return tl.load(tiles_ptr + tile).to(tl.int64), tl.load(tiles_ptr + T + tile), tl.load(tiles_ptr + 2 * T + tile)


@triton.jit
def _gate_up_kernel(z_ptr, order_ptr, tiles_ptr, T, w1p_ptr, w3p_ptr, w1s_ptr, w3s_ptr, h_ptr, beta, linear_beta,
                    A: tl.constexpr, L: tl.constexpr, F: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr, SWAP: tl.constexpr, INTERPRET: tl.constexpr):
    """h[rows, n block] = SiTU(round(x @ w1^T), round(x @ w3^T)) for one tile of one expert's rows."""
    pid_n = tl.program_id(0)
    e, r0, r1 = _tile(tiles_ptr, T, tl.program_id(1))
    if r0 >= r1:
        return
    DTYPE: tl.constexpr = z_ptr.dtype.element_ty
    rows = r0 + tl.arange(0, BM)
    r_mask = rows < r1
    tok = tl.load(order_ptr + rows, mask=r_mask, other=0) // A
    n = pid_n * BN + tl.arange(0, BN)
    n_ld = tl.minimum(n, F - 1)  # rows past F load row F-1 (unmasked loads) and are not stored
    w1p = w1p_ptr + e * F * (L // 2)
    w3p = w3p_ptr + e * F * (L // 2)
    w1s = w1s_ptr + e * F * (L // 32)
    w3s = w3s_ptr + e * F * (L // 32)
    shape: tl.constexpr = (BN, BM) if SWAP else (BM, BN)
    acc1 = tl.zeros(shape, tl.float32)
    acc3 = tl.zeros(shape, tl.float32)
    for k0 in range(0, L, BK):
        x_lo, x_hi = _load_x(z_ptr, tok, r_mask, k0, L, BM, BK // 2)
        acc1 = _mx_acc(acc1, x_lo, x_hi, w1p, w1s, n_ld, k0 // 2, L // 2, L // 32, BK // 2, SWAP, DTYPE, INTERPRET)
        acc3 = _mx_acc(acc3, x_lo, x_hi, w3p, w3s, n_ld, k0 // 2, L // 2, L // 32, BK // 2, SWAP, DTYPE, INTERPRET)
    g = round_to(acc1, DTYPE, INTERPRET).to(tl.float32)
    u = round_to(acc3, DTYPE, INTERPRET).to(tl.float32)
    h = round_to(situ(g, u, beta, linear_beta), DTYPE, INTERPRET)
    c = (n // 32) * 32 + (n % 2) * 16 + (n % 32) // 2  # h is stored group-interleaved, as stage 2 reads it
    if SWAP:
        ptr = h_ptr + rows[None, :].to(tl.int64) * F + c[:, None]
        tl.store(ptr, h, mask=r_mask[None, :] & (n < F)[:, None])
    else:
        ptr = h_ptr + rows[:, None].to(tl.int64) * F + c[None, :]
        tl.store(ptr, h, mask=r_mask[:, None] & (n < F)[None, :])


@triton.jit
def _down_kernel(h_ptr, order_ptr, tiles_ptr, T, w2p_ptr, w2s_ptr, y_ptr, L: tl.constexpr, F: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SWAP: tl.constexpr, INTERPRET: tl.constexpr):
    """y[flat rows, n block] = round(h[rows] @ w2^T) for one tile of one expert's (sorted) rows."""
    pid_n = tl.program_id(0)
    e, r0, r1 = _tile(tiles_ptr, T, tl.program_id(1))
    if r0 >= r1:
        return
    DTYPE: tl.constexpr = h_ptr.dtype.element_ty
    rows = r0 + tl.arange(0, BM)
    r_mask = rows < r1
    n = pid_n * BN + tl.arange(0, BN)
    n_ld = tl.minimum(n, L - 1)
    w2p = w2p_ptr + e * L * (F // 2)
    w2s = w2s_ptr + e * L * (F // 32)
    acc = tl.zeros((BN, BM) if SWAP else (BM, BN), tl.float32)
    for k0 in range(0, F, BK):
        x_lo, x_hi = _load_x(h_ptr, rows, r_mask, k0, F, BM, BK // 2)
        acc = _mx_acc(acc, x_lo, x_hi, w2p, w2s, n_ld, k0 // 2, F // 2, F // 32, BK // 2, SWAP, DTYPE, INTERPRET)
    y = round_to(acc, DTYPE, INTERPRET)
    flat = tl.load(order_ptr + rows, mask=r_mask, other=0).to(tl.int64)
    if SWAP:
        tl.store(y_ptr + flat[None, :] * L + n[:, None], y, mask=r_mask[None, :] & (n < L)[:, None])
    else:
        tl.store(y_ptr + flat[:, None] * L + n[None, :], y, mask=r_mask[:, None] & (n < L)[None, :])


# (rows per expert on average) -> (BM, BN, BK, SWAP, num_warps, num_stages) of stage 1 and of stage 2.
# Few rows (decode; even 256 tokens over 896 experts is ~5): 16-row tiles, weights on the MMA's M side (mma.sync,
# 2 warps, small shared memory so that many programs share an SM). Many rows (4096 tokens: ~73 per expert):
# 128-token tiles, 64 weight rows per program on one warpgroup (wgmma, A from registers). The middle row was not
# tuned on the device.
_CONFIGS = (
    (24.0, (16, 64, 128, True, 2, 3), (16, 64, 128, True, 2, 3)),
    (48.0, (32, 64, 256, False, 4, 4), (32, 64, 256, False, 4, 4)),
    (float("inf"), (128, 64, 128, True, 4, 3), (128, 64, 128, True, 4, 3)),
)


def _pick(rows_per_expert: float):
    return next((c1, c2) for bound, c1, c2 in _CONFIGS if rows_per_expert <= bound)


def _interleave(x: Tensor) -> Tensor:
    """[R, K] -> [R, K] with each 32-column group stored as its 16 even columns then its 16 odd columns."""
    R, K = x.shape
    return x.reshape(R, K // 32, 16, 2).transpose(-1, -2).reshape(R, K)


def _route(topk_idx: Tensor, num_experts: int, bm: int) -> tuple[Tensor, Tensor, int]:
    """(order [M] int64: flat row (token * A + slot) of each expert-sorted row, a stable sort;
    tiles [3, T] int32: expert, first and end sorted row of each tile; T)."""
    flat = topk_idx.reshape(-1)
    M = flat.numel()
    T = M // bm + min(num_experts, M)
    order = torch.sort(flat, stable=True).indices
    tiles = torch.empty(3, T, dtype=torch.int32, device=flat.device)
    m_pad = triton.next_power_of_2(M)
    _tiles_kernel[(1,)](flat, tiles, M, T, E=num_experts, EB=triton.next_power_of_2(num_experts), BM=bm,
                        M_PAD=m_pad, CH=min(m_pad, 1024), num_warps=4)
    return order, tiles, T


def _block_k(k: int, bk: int) -> int:
    """The largest power of two <= bk dividing k (k is a multiple of 32, so at least 32)."""
    while k % bk:
        bk //= 2
    return bk


def routed_experts_mxfp4(z: Tensor, topk_idx: Tensor, topk_weight: Tensor, packed: tuple[Tensor, Tensor, Tensor],
                         scales: tuple[Tensor, Tensor, Tensor], beta: float, linear_beta: float,
                         configs: tuple[tuple, tuple] | None = None) -> Tensor:
    """Triton path of `kimik3.ops.moe.PackedWeights` (same contract; z bf16 or fp16, CUDA or interpreter);
    `configs` as `rows`'."""
    return slot_sum(rows(z, topk_idx, packed, scales, beta, linear_beta, configs=configs), topk_weight)


def rows(z: Tensor, topk_idx: Tensor, packed: tuple[Tensor, Tensor, Tensor], scales: tuple[Tensor, Tensor, Tensor],
         beta: float, linear_beta: float, rows_per_expert: float | None = None,
         configs: tuple[tuple, tuple] | None = None, out: Tensor | None = None) -> Tensor:
    """y [N * A, L]: row n * A + a is expert topk_idx[n, a]'s output for token n, rounded to z's dtype; rows whose
    expert is E or more are skipped (left as they were in `out`, written in place when given).

    `rows_per_expert` picks the tiles (default: N * A / E, this call's own; always 0 in `batch_invariant_mode`); a
    row's value depends on the tiles and on nothing else in the call, so a cache of some experts' slots passes the full
    model's figure and gets the rows the full model computes. `configs` forces both stages' tiles (benchmarks)."""
    (N, L), A = z.shape, topk_idx.shape[1]
    if z.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"routed_experts_mxfp4 (triton): z must be bf16 or fp16, got {z.dtype}")
    w1p, w3p, w2p = (p.contiguous() for p in packed)
    w1s, w3s, w2s = (s.contiguous() for s in scales)
    E, F = w1p.shape[0], w1p.shape[1]
    if L % GROUP_SIZE or F % GROUP_SIZE:
        raise ValueError(f"routed_experts_mxfp4: L={L} and F={F} must be multiples of {GROUP_SIZE}")
    M = N * A
    y = torch.empty(M, L, dtype=z.dtype, device=z.device) if out is None else out
    if M == 0:
        return y
    if batch_invariant_mode():  # one tiling (the decode's) whatever the row count, a tiered layer's calls too
        rows_per_expert = 0.0
    elif rows_per_expert is None:
        rows_per_expert = M / E
    c1, c2 = configs or _pick(rows_per_expert)
    interpret = interpreting()
    order, tiles, T = _route(topk_idx, E, c1[0])
    h = torch.empty(M, F, dtype=z.dtype, device=z.device)
    bm, bn, bk, swap, nw, ns = c1
    _gate_up_kernel[(triton.cdiv(F, bn), T)](
        _interleave(z), order, tiles, T, w1p, w3p, w1s, w3s, h, float(beta), float(linear_beta), A=A, L=L, F=F,
        BM=bm, BN=bn, BK=_block_k(L, bk), SWAP=swap, INTERPRET=interpret, num_warps=nw, num_stages=ns)
    bm, bn, bk, swap, nw, ns = c2
    if bm != c1[0]:
        order, tiles, T = _route(topk_idx, E, bm)
    _down_kernel[(triton.cdiv(L, bn), T)](
        h, order, tiles, T, w2p, w2s, y, L=L, F=F,
        BM=bm, BN=bn, BK=_block_k(F, bk), SWAP=swap, INTERPRET=interpret, num_warps=nw, num_stages=ns)
    return y
