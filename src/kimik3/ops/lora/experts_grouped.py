"""Routed experts with LoRA over frozen MXFP4 experts as grouped GEMMs (CUDA): `experts.routed_experts_mxfp4_lora`'s
function, its per-expert loop replaced by one grouped GEMM per projection.

Legend: N tokens, A active experts per token, M = N*A routed rows sorted by expert, E experts, L latent width,
F expert width, R rank, I / O a projection's input / output width, E' = E or 1 (a shared factor).

Per projection k: base = x W_k^T with W_k decoded from the codes into a transient bf16 buffer (one Triton pass,
`kimik3.ops.mxfp4.decode`) that is freed as soon as the GEMM has read it and decoded again in backward for dx;
the LoRA term (s x A_k^T) B_k^T is a grouped GEMM to rank R (a plain one for a shared factor) and a rank-R product
added into the base output in place (`lowrank_add_`, a Triton kernel). Routed rows move with `.combine`'s gather
kernels, as in `grouped.routed_experts`. The sums are those of the reference loop with the GEMMs' own summation
order (bf16-level differences); with every B zero the LoRA terms add +0.

What the rank-R terms cost is passes over the M routed rows (each [M, F] or [M, L] bf16 tensor is ~0.8 GB at K3
training shapes), so each projection group is one autograd Function (`_LoraProjections`) with its backward
written out: the scale multiplies the [M, R] intermediates, never an [M, out] tensor; the rank-R products are
added where they land (the update into y forward, (s dt) A into dx backward) instead of being written and added;
w1 and w3 read their common input x once, through their A factors stacked to [E', 2R, L], so dA1, dA3 and their
part of dx are one GEMM each too.

The transient buffer is one projection's experts (E x O x I bf16: 2.8 GB at 128 experts of K3's widths); above
`CHUNK_BYTES` the experts are decoded and multiplied a chunk at a time (one host sync per projection for the chunks'
row bounds), so that K3's 896 experts need no 20 GB buffer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kimik3.ops.moe import combine
from kimik3.ops.moe.grouped import expert_offsets
from kimik3.ops.mxfp4 import decode
from kimik3.ops.situ import situ_glu
from kimik3.ops.triton_utils import interpreting, round_to

CHUNK_BYTES = 4 << 30  # the most bytes of decoded experts alive at once


def _chunks(offs_E: Tensor, E: int, per_expert: int) -> list[tuple[int, int, int, int]]:
    """(first expert, end expert, first row, end row) of each chunk of at most CHUNK_BYTES of decoded weights."""
    step = max(1, CHUNK_BYTES // per_expert)
    if step >= E:
        return [(0, E, 0, -1)]  # one chunk: no sync (the end row -1 stands for all rows)
    ends = [0, *offs_E.tolist()]
    return [(e0, min(e0 + step, E), ends[e0], ends[min(e0 + step, E)]) for e0 in range(0, E, step)]


def _grouped_packed(x_MI: Tensor, packed: Tensor, scale: Tensor, offs_E: Tensor, transpose: bool) -> Tensor:
    """x @ decode(W_e)^T per expert's rows (transpose=True: the forward) or x @ decode(W_e) (the input gradient)."""
    E, out_w, P = packed.shape  # W_e is [out_w, 2P]
    chunks = _chunks(offs_E, E, out_w * 2 * P * x_MI.element_size())
    if len(chunks) == 1:  # the GEMM writes the result itself (no copy into a preallocated output)
        w_EOI = decode(packed, scale, x_MI.dtype)
        return torch._grouped_mm(x_MI, w_EOI.transpose(-2, -1) if transpose else w_EOI, offs=offs_E)
    out = x_MI.new_empty(x_MI.shape[0], out_w if transpose else 2 * P)
    for e0, e1, r0, r1 in chunks:
        rows = slice(r0, None if r1 < 0 else r1)
        w_EOI = decode(packed[e0:e1], scale[e0:e1], x_MI.dtype)
        w = w_EOI.transpose(-2, -1) if transpose else w_EOI
        out[rows] = torch._grouped_mm(x_MI[rows], w, offs=offs_E[e0:e1] - r0)
        del w_EOI, w
    return out


@triton.jit
def _lowrank_add_kernel(c_ptr, t_ptr, f_ptr, e_ptr, M, N, stride_fe, stride_fk, stride_fn, K: tl.constexpr,
                        KP: tl.constexpr, SHARED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                        IEEE: tl.constexpr, INTERPRET: tl.constexpr):
    """c[m, n-block] += sum_k t[m, k] f[e_m, k, n-block] for a block of BM sorted rows: one rank-K product per
    expert present in the block (rows of other experts masked to zero), fp32 sums added to c and rounded once."""
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    ks = tl.arange(0, KP)
    r_ok, c_ok, k_ok = rows < M, cols < N, ks < K
    t = tl.load(t_ptr + rows[:, None] * K + ks[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
    f_off = ks[:, None] * stride_fk + cols[None, :] * stride_fn
    f_ok = k_ok[:, None] & c_ok[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if SHARED:
        f = tl.load(f_ptr + f_off, mask=f_ok, other=0.0)
        acc = tl.dot(t, f, acc, input_precision="ieee") if IEEE else tl.dot(t, f, acc)
    else:
        e_row = tl.load(e_ptr + rows, mask=r_ok, other=-1)
        first = tl.program_id(0).to(tl.int64) * BM
        last = tl.minimum(first + BM, M) - 1
        for e in range(tl.load(e_ptr + first), tl.load(e_ptr + last) + 1):  # the rows are sorted by expert
            f = tl.load(f_ptr + e * stride_fe + f_off, mask=f_ok, other=0.0)
            te = tl.where((e_row == e)[:, None], t, tl.zeros_like(t))
            acc = tl.dot(te, f, acc, input_precision="ieee") if IEEE else tl.dot(te, f, acc)
    ptrs = c_ptr + rows[:, None] * N + cols[None, :]
    ok = r_ok[:, None] & c_ok[None, :]
    c = tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
    tl.store(ptrs, round_to(c + acc, c_ptr.dtype.element_ty, INTERPRET), mask=ok)


def lowrank_add_(c_MN: Tensor, t_MK: Tensor, f_EKN: Tensor, e_M: Tensor) -> Tensor:
    """c += t_m f[e_m] for every row m, in place, and returns c: c [M, N] contiguous, t [M, K] (rank K = R or 2R),
    f [E', K, N] in c's dtype with any strides (E' = 1: one factor for all rows), e_M [M] the expert of each row,
    sorted. The sum of each row is fp32 (over K, then with c) and rounded once: `lowrank_add_reference`'s value to
    that rounding. It is the rank-R GEMM of a LoRA term with the add of its result fused: one read and one write
    of c, where a GEMM into a new [M, N] tensor and an add are four passes."""
    M, N = c_MN.shape
    K = t_MK.shape[1]
    assert c_MN.is_contiguous() and f_EKN.shape[1:] == (K, N) and f_EKN.dtype == c_MN.dtype == t_MK.dtype
    if M and N:
        BM, BN = 64, 128
        _lowrank_add_kernel[(triton.cdiv(M, BM), triton.cdiv(N, BN))](
            c_MN, t_MK.contiguous(), f_EKN, e_M, M, N, f_EKN.stride(0), f_EKN.stride(1), f_EKN.stride(2), K=K,
            KP=max(16, triton.next_power_of_2(K)), SHARED=f_EKN.shape[0] == 1, BM=BM, BN=BN,
            IEEE=c_MN.dtype == torch.float32, INTERPRET=interpreting(), num_warps=4)
    return c_MN


def lowrank_add_reference(c_MN: Tensor, t_MK: Tensor, f_EKN: Tensor, e_M: Tensor) -> Tensor:
    """`lowrank_add_`'s value, out of place, as a loop over experts (fp32 products and sums, rounded once)."""
    out = c_MN.float()
    for e in range(f_EKN.shape[0]):
        rows = (e_M == e) if f_EKN.shape[0] > 1 else slice(None)
        out[rows] += t_MK[rows].float() @ f_EKN[e].float()
    return out.to(c_MN.dtype)


def _factor(x_MI: Tensor, f: Tensor, offs_E: Tensor) -> Tensor:
    """x @ f_e^T for the factor f [E', out, in] (x's dtype): grouped per expert, or one GEMM when shared."""
    if f.shape[0] == 1:
        return x_MI @ f[0].T
    return torch._grouped_mm(x_MI, f.transpose(-2, -1), offs=offs_E)


def _per_expert_outer(u_MP: Tensor, v_MQ: Tensor, offs_E: Tensor, shared: bool) -> Tensor:
    """[E', P, Q]: sum over expert e's rows of u^T v (a factor's gradient), or over all rows when shared."""
    if shared:
        return (u_MP.T @ v_MQ).unsqueeze(0)
    return torch._grouped_mm(u_MP.T, v_MQ, offs=offs_E)


class _LoraProjections(torch.autograd.Function):
    """y_k = x W_k^T + (s x A_k^T) B_k^T for the n projections k that read the same x (w1 and w3, or w2), over each
    expert's rows; gradients for x and the factors only.

    a: [E', nR, I] the n A factors stacked; then b_1..b_n ([E', O, R]) and the codes (packed_1, scale_1, ...).
    Forward: one GEMM t = s x A^T [M, nR] (saved, with x), per projection the base GEMM over the decoded codes and
    `lowrank_add_` of t_k B_k^T into it. Backward: dx = sum_k dy_k W_k (decoded again) + (s dt) A with
    dt = [dy_1 B_1 | ...], dA = (s dt)^T x, dB_k = dy_k^T t_k, each per expert."""

    @staticmethod
    def forward(ctx, x_MI: Tensor, a: Tensor, e_M: Tensor, offs_E: Tensor, scale: float, n: int, *rest: Tensor):
        b, codes = rest[:n], rest[n:]
        t_MK = _factor(x_MI, a, offs_E) * scale
        ts = [t.contiguous() for t in t_MK.split(a.shape[1] // n, dim=1)]  # [M, R] each: small
        ys = []
        for k in range(n):
            y = _grouped_packed(x_MI, codes[2 * k], codes[2 * k + 1], offs_E, transpose=True)
            ys.append(lowrank_add_(y, ts[k], b[k].transpose(-2, -1), e_M))
        ctx.save_for_backward(x_MI, a, e_M, offs_E, *ts, *rest)
        ctx.n, ctx.scale = n, scale
        return tuple(ys)

    @staticmethod
    def backward(ctx, *dys: Tensor):
        x_MI, a, e_M, offs_E, *rest = ctx.saved_tensors
        n = ctx.n
        ts, b, codes = rest[:n], rest[n:2 * n], rest[2 * n:]
        dx = None
        dts, dbs = [], []
        for k in range(n):
            dy = dys[k].contiguous() if dys[k] is not None else x_MI.new_zeros(x_MI.shape[0], b[k].shape[1])
            part = _grouped_packed(dy, codes[2 * k], codes[2 * k + 1], offs_E, transpose=False)
            dx = part if dx is None else dx.add_(part)
            dts.append(_factor(dy, b[k].transpose(-2, -1), offs_E))
            dbs.append(_per_expert_outer(dy, ts[k], offs_E, b[k].shape[0] == 1))
        dt = (torch.cat(dts, dim=1) if n > 1 else dts[0]) * ctx.scale
        lowrank_add_(dx, dt, a, e_M)
        da = _per_expert_outer(dt, x_MI, offs_E, a.shape[0] == 1)
        return dx, da, None, None, None, None, *dbs, *(None,) * len(codes)


def _projections(x: Tensor, a: list[Tensor], b: list[Tensor], codes: list[Tensor], e_M: Tensor, offs_E: Tensor,
                 scale: float) -> tuple[Tensor, ...]:
    """`_LoraProjections` with the fp32 master factors cast to x's dtype (and the A's stacked) under autograd."""
    a_all = (torch.cat(a, dim=1) if len(a) > 1 else a[0]).to(x.dtype)
    return _LoraProjections.apply(x, a_all, e_M, offs_E, scale, len(a), *(f.to(x.dtype) for f in b), *codes)


def supports(z: Tensor, lora_a: tuple[Tensor, ...]) -> bool:
    """Whether this path runs the call: bf16 on CUDA with ranks that meet the grouped GEMM's 16-byte strides."""
    return z.is_cuda and z.dtype == torch.bfloat16 and all(a.shape[1] % 8 == 0 for a in lora_a)


def routed_experts_mxfp4_lora(z: Tensor, topk_idx: Tensor, topk_weight: Tensor, packed, scales, lora_a, lora_b,
                              scale: float, beta: float, linear_beta: float) -> Tensor:
    """`.experts.routed_experts_mxfp4_lora` (same contract) as grouped GEMMs; see the module docstring."""
    N, A = topk_idx.shape
    sorted_e, order = torch.sort(topk_idx.reshape(-1), stable=True)
    offs_E = expert_offsets(sorted_e, packed[0].shape[0])
    inv_NA = combine.inverse(order, N, A)
    x_ML = combine.dispatch(z, order // A, inv_NA)

    if lora_a[0].shape == lora_a[1].shape:  # w1 and w3 in one: x read once, dx from one rank-2R product
        g_MF, u_MF = _projections(x_ML, [lora_a[0], lora_a[1]], [lora_b[0], lora_b[1]],
                                  [packed[0], scales[0], packed[1], scales[1]], sorted_e, offs_E, scale)
    else:
        (g_MF,), (u_MF,) = (_projections(x_ML, [lora_a[k]], [lora_b[k]], [packed[k], scales[k]], sorted_e, offs_E,
                                         scale) for k in (0, 1))
    h_MF = situ_glu(g_MF, u_MF, beta, linear_beta)
    (y_ML,) = _projections(h_MF, [lora_a[2]], [lora_b[2]], [packed[2], scales[2]], sorted_e, offs_E, scale)
    return combine.combine(y_ML, inv_NA, topk_weight)
