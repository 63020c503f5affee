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
    combine  per token: out = sum over its A slots of w * float(y), in fp32, then cast.
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
experts in [0, E) (not checked: that would need the host).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kimik3.ops.mxfp4 import GROUP_SIZE
from kimik3.ops.situ.triton import interpreting, round_to, situ


@triton.jit
def _decode(packed, scale, BR: tl.constexpr, BKH: tl.constexpr, DTYPE: tl.constexpr):
    """MXFP4 tile -> (even, odd) columns in DTYPE, through fp32 (fp16 activations; Triton's interpreter).

    packed: uint8 [BR, BKH] (byte j = columns 2j (low nibble) and 2j+1 (high nibble));
    scale:  uint8 [BR, BKH // 16] E8M0 exponents, one per 16 bytes.
    Returns two [BR, BKH] tensors: W[:, 0::2] and W[:, 1::2] of this tile, exactly as mxfp4.decode.
    """
    b = packed.to(tl.uint32)
    s = scale.to(tl.uint32)
    lo = (((b & 0x08) << 28) | ((b & 0x07) << 22)).to(tl.float32, bitcast=True)
    hi = (((b & 0x80) << 24) | ((b & 0x70) << 18)).to(tl.float32, bitcast=True)
    sc = tl.maximum(s << 23, 0x00400000).to(tl.float32, bitcast=True)  # 2^(s-127); s = 0 is subnormal
    sc = tl.reshape(tl.broadcast_to(sc[:, :, None], (BR, BKH // 16, 16)), (BR, BKH))
    two126 = tl.full((1, 1), 0x7E800000, tl.uint32).to(tl.float32, bitcast=True)
    # (subnormal E2M1 * 2^-126) * 2^126 is E2M1 exactly; times 2^(s-127) it is exact or overflows, as decode
    lo = ((lo * two126) * sc).to(DTYPE)
    hi = ((hi * two126) * sc).to(DTYPE)
    return lo, hi


@triton.jit
def _decode_bf16(packed, scale, BR: tl.constexpr, BKH: tl.constexpr):
    """`_decode` to bf16 in 3 instructions per value (GPU only: inline PTX over 4 packed bytes at a time).

    Per 32-bit word of 4 bytes b0..b3, one byte permute puts (b0, b1) in the low bytes of two 16-bit lanes and
    (b2, b3) in their high bytes; shifts and masks then move each nibble's magnitude to bits 6-8 and its sign
    to bit 15 of a lane: the bf16 subnormal E2M1 * 2^-126. Two paired bf16 multiplies, by 2^126 and by the
    group's 2^(s-127), are exact (or overflow, as the reference does).
    """
    s = scale.to(tl.uint32)
    sc = tl.maximum(s << 7, 0x0040).to(tl.uint16).to(tl.bfloat16, bitcast=True)  # 2^(s-127); s = 0: subnormal
    sc = tl.reshape(tl.broadcast_to(sc[:, :, None], (BR, BKH // 16, 16)), (BR, BKH))
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 q, m, sg, c;
        prmt.b32 q, $4, 0, 0x3120;
        mov.b32 c, 0x7E807E80;
        shl.b32 m, q, 6;
        and.b32 m, m, 0x01C001C0;
        shl.b32 sg, q, 12;
        and.b32 sg, sg, 0x80008000;
        or.b32 $0, m, sg;
        shr.b32 m, q, 2;
        and.b32 m, m, 0x01C001C0;
        shl.b32 sg, q, 4;
        and.b32 sg, sg, 0x80008000;
        or.b32 $1, m, sg;
        shl.b32 m, q, 2;
        and.b32 m, m, 0x01C001C0;
        shl.b32 sg, q, 8;
        and.b32 sg, sg, 0x80008000;
        or.b32 $2, m, sg;
        shr.b32 m, q, 6;
        and.b32 m, m, 0x01C001C0;
        and.b32 sg, q, 0x80008000;
        or.b32 $3, m, sg;
        mul.rn.bf16x2 $0, $0, c;
        mul.rn.bf16x2 $1, $1, c;
        mul.rn.bf16x2 $2, $2, c;
        mul.rn.bf16x2 $3, $3, c;
        mul.rn.bf16x2 $0, $0, $5;
        mul.rn.bf16x2 $1, $1, $6;
        mul.rn.bf16x2 $2, $2, $5;
        mul.rn.bf16x2 $3, $3, $6;
        }
        """,
        constraints="=r,=r,=r,=r,r,r,r",
        args=[packed, sc],
        dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=4,
    )


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
        w_lo, w_hi = _decode(p, s, BN, BKH, tl.float32)
        x_lo = x_lo.to(tl.float32)
        x_hi = x_hi.to(tl.float32)
    elif DTYPE == tl.bfloat16:
        w_lo, w_hi = _decode_bf16(p, s, BN, BKH)
    else:
        w_lo, w_hi = _decode(p, s, BN, BKH, DTYPE)
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
    """tiles[:, t] = (expert, first row, end row) of tile t over the expert-sorted rows; surplus tiles empty."""
    ex = tl.arange(0, EB)
    counts = tl.zeros((EB,), tl.int32)
    for m0 in range(0, M_PAD, CH):
        m = m0 + tl.arange(0, CH)
        counts += tl.histogram(tl.load(idx_ptr + m, mask=m < M, other=0).to(tl.int32), EB, mask=m < M)
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


@triton.jit
def _combine_kernel(y_ptr, w_ptr, out_ptr, A: tl.constexpr, L: tl.constexpr, BL: tl.constexpr,
                    INTERPRET: tl.constexpr):
    """out[t, block] = sum over slots a (in order) of w[t, a] * float(y[t * A + a, block]), in fp32."""
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BL + tl.arange(0, BL)
    acc = tl.zeros((BL,), tl.float32)
    for a in range(A):
        w = tl.load(w_ptr + t * A + a)
        acc += w * tl.load(y_ptr + (t * A + a) * L + c, mask=c < L, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * L + c, round_to(acc, out_ptr.dtype.element_ty, INTERPRET), mask=c < L)


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
                         scales: tuple[Tensor, Tensor, Tensor], beta: float, linear_beta: float) -> Tensor:
    """Triton path of `kimik3.ops.moe.routed_experts_mxfp4` (same contract; z bf16 or fp16, CUDA or interpreter)."""
    c1, c2 = _pick(topk_idx.numel() / packed[0].shape[0])
    return _forward(z, topk_idx, topk_weight, packed, scales, beta, linear_beta, c1, c2)


def _forward(z, topk_idx, topk_weight, packed, scales, beta, linear_beta, c1, c2) -> Tensor:
    """routed_experts_mxfp4 with explicit stage configs (BM, BN, BK, SWAP, num_warps, num_stages)."""
    (N, L), A = z.shape, topk_idx.shape[1]
    if z.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"routed_experts_mxfp4 (triton): z must be bf16 or fp16, got {z.dtype}")
    w1p, w3p, w2p = (p.contiguous() for p in packed)
    w1s, w3s, w2s = (s.contiguous() for s in scales)
    E, F = w1p.shape[0], w1p.shape[1]
    if L % GROUP_SIZE or F % GROUP_SIZE:
        raise ValueError(f"routed_experts_mxfp4: L={L} and F={F} must be multiples of {GROUP_SIZE}")
    M = N * A
    if M == 0:
        return torch.zeros_like(z)
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
    y = torch.empty(M, L, dtype=z.dtype, device=z.device)
    _down_kernel[(triton.cdiv(L, bn), T)](
        h, order, tiles, T, w2p, w2s, y, L=L, F=F,
        BM=bm, BN=bn, BK=_block_k(F, bk), SWAP=swap, INTERPRET=interpret, num_warps=nw, num_stages=ns)
    out = torch.empty_like(z)
    bl = min(1024, triton.next_power_of_2(L))
    _combine_kernel[(N, triton.cdiv(L, bl))](y, topk_weight.float().contiguous(), out, A=A, L=L, BL=bl,
                                              INTERPRET=interpret, num_warps=4)
    return out
