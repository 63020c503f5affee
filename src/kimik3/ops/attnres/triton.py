"""Fused Triton kernels for the AttnRes depth mix, forward and backward; the contract of `.reference`.

Legend: M stored blocks, S = M + 1 sources (the blocks, then the partial sum), N rows (all leading dims
flattened), D hidden. Per row, with w = norm_weight * proj_weight (fp32) and r_j = (mean_D(v_j^2) + eps)^-1/2:
    s_j = r_j <v_j, w>;  pi = softmax_j(s);  out = sum_j pi_j v_j
so the score needs only two per-source sums, sum(v_j^2) and <v_j, w>, gathered in one pass over D.

Forward, one row at a time per program (a persistent grid of a few programs per SM): pass 1 reads the D
chunks of all sources ([M, BLOCK_D] of blocks in one load, plus the partial's chunk, all in flight at once)
and folds the two sums per source into per-thread partial sums, so the loop has no cross-thread reductions
or barriers; the softmax runs in registers; pass 2 reads the chunks again and writes the weighted sum. A
row's sources (129 KB at D = 7168, S = 9, bf16) do not fit in a program's registers, so they are read
twice; with a few rows in flight per SM (~33 MB over the chip) the second read should come from L2: DRAM
traffic 1 read + 1 write when it does, 2 + 1 at worst. Saved for backward: pi, r and s, fp32 [3, S, N].

Backward, with g = d out and a_j = <g, v_j>:
    d s_j = pi_j (a_j - sum_i pi_i a_i)                   (softmax)
    d v_j = pi_j g + d s_j (r_j w - s_j r_j^2 v_j / D)    (d s_j / d v_j, through r_j and <v_j, w>)
    d w   = sum_rows sum_j d s_j r_j v_j;  d norm_weight = d w * proj_weight;  d proj_weight = d w * norm_weight
Pass 1 gathers a_j, pass 2 writes every d v_j and adds the row's share of d w into the program's own row of
a [programs, D] fp32 buffer (in registers when one chunk spans D), summed by torch afterwards: deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from kimik3.ops.attnres import reference

__all__ = ["Config", "attn_res_mix", "default_config", "mix_backward", "mix_forward"]


@dataclass(frozen=True)
class Config:
    """Launch shape: D chunk, warps per program, persistent programs per SM.

    Keep block_d >= 8 * 32 * num_warps (bf16) so that the warps split D and the sum over sources in pass 2
    stays inside each thread.
    """

    block_d: int = 2048
    num_warps: int = 8
    programs_per_sm: int = 2
    evict_first: bool = True  # pass 2's loads and the stores: last use, so let L2 drop them first


def default_config(M: int, backward: bool) -> Config:
    """Launch shape for S = M + 1 sources (guessed from ptxas reports, the backward's for S <= 5 measured;
    `bench/bench_attnres.py` sweeps them).

    Each SM should keep ~40-70 KB of loads in flight (a D chunk of every source per program) while the rows
    it holds between the two passes (programs_per_sm rows of S * D) stay ~250 KB, ~33 MB over the chip,
    inside the 50 MB L2.
    """
    S = M + 1
    if backward and S <= 5:  # the fastest of bench_attnres.py's sweep (BENCHMARKS.md, code choices)
        return Config(4096, 16, 2) if S <= 2 else Config(8192, 16, 1)
    if backward:
        return Config(1024, 4, max(2, min(8, 24 // (S + 1))))
    return Config(2048, 8, max(2, min(8, 18 // S)))


@triton.jit
def _fold(x, VEC: tl.constexpr):
    """[R, BLOCK_D] -> [R, BLOCK_D // VEC]: sums of VEC neighbours, held by one thread when VEC elements are
    one 16-byte load (sources and weights of one dtype), so the D loops need no shuffles or barriers."""
    return tl.sum(tl.reshape(x, [x.shape[0], x.shape[1] // VEC, VEC]), 2)


@triton.jit
def _blocks_at(ptr, row, N, D, c, cmask, M: tl.constexpr, M_PAD: tl.constexpr):
    """Pointers and mask of chunk c ([1, BLOCK_D]) of this row of every stored block: [M_PAD, BLOCK_D]."""
    m = tl.arange(0, M_PAD)[:, None]
    return ptr + (m * N + row) * D + c, (m < M) & cmask


@triton.jit
def _load_sources(blocks_ptr, partial_ptr, row, N, D, c, cmask, M: tl.constexpr, M_PAD: tl.constexpr,
                  EVICT: tl.constexpr):
    """Chunk c of this row of every source in fp32: ([M_PAD, BLOCK_D] blocks, zero past M; [1, BLOCK_D] partial)."""
    ptrs, mask = _blocks_at(blocks_ptr, row, N, D, c, cmask, M, M_PAD)
    vb = tl.load(ptrs, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    vp = tl.load(partial_ptr + row * D + c, mask=cmask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    return vb, vp


@triton.jit
def _load_w(nw_ptr, pw_ptr, c, cmask):
    return tl.load(nw_ptr + c, mask=cmask, other=0.0).to(tl.float32) * \
        tl.load(pw_ptr + c, mask=cmask, other=0.0).to(tl.float32)


@triton.jit
def _fwd_kernel(blocks_ptr, partial_ptr, nw_ptr, pw_ptr, out_ptr, stats_ptr, N, D, eps,
                M: tl.constexpr, M_PAD: tl.constexpr, BLOCK_D: tl.constexpr, VEC: tl.constexpr, EVICT: tl.constexpr):
    S: tl.constexpr = M + 1
    cols = tl.arange(0, BLOCK_D)[None, :]
    m = tl.arange(0, M_PAD)
    for row32 in range(tl.program_id(0), N, tl.num_programs(0)):
        row = tl.cast(row32, tl.int64)
        ss_b = tl.zeros([M_PAD, BLOCK_D // VEC], tl.float32)
        vw_b = tl.zeros([M_PAD, BLOCK_D // VEC], tl.float32)
        ss_p = tl.zeros([1, BLOCK_D // VEC], tl.float32)
        vw_p = tl.zeros([1, BLOCK_D // VEC], tl.float32)
        for d0 in range(0, D, BLOCK_D):
            c = d0 + cols
            cmask = c < D
            w = _load_w(nw_ptr, pw_ptr, c, cmask)
            vb, vp = _load_sources(blocks_ptr, partial_ptr, row, N, D, c, cmask, M, M_PAD, "")
            ss_b += _fold(vb * vb, VEC)
            vw_b += _fold(vb * w, VEC)
            ss_p += _fold(vp * vp, VEC)
            vw_p += _fold(vp * w, VEC)
        rstd_b = tl.rsqrt(tl.sum(ss_b, 1) / D + eps)
        rstd_p = tl.rsqrt(tl.sum(ss_p) / D + eps)
        score_b = tl.where(m < M, tl.sum(vw_b, 1) * rstd_b, float("-inf"))
        score_p = tl.sum(vw_p) * rstd_p
        top = tl.maximum(tl.max(score_b, 0), score_p)
        e_b = tl.exp(score_b - top)
        e_p = tl.exp(score_p - top)
        pi_b = e_b / (tl.sum(e_b, 0) + e_p)
        pi_p = e_p / (tl.sum(e_b, 0) + e_p)
        stat_b = stats_ptr + m * N + row
        tl.store(stat_b, pi_b, mask=m < M)
        tl.store(stat_b + S * N, rstd_b, mask=m < M)
        tl.store(stat_b + 2 * S * N, score_b, mask=m < M)
        stat_p = stats_ptr + M * N + row
        tl.store(stat_p, pi_p)
        tl.store(stat_p + S * N, rstd_p)
        tl.store(stat_p + 2 * S * N, score_p)
        pi_b = pi_b[:, None]
        for d0 in range(0, D, BLOCK_D):
            c = d0 + cols
            cmask = c < D
            vb, vp = _load_sources(blocks_ptr, partial_ptr, row, N, D, c, cmask, M, M_PAD, EVICT)
            out = tl.sum(pi_b * vb, 0)[None, :] + pi_p * vp
            tl.store(out_ptr + row * D + c, out.to(out_ptr.dtype.element_ty), mask=cmask, eviction_policy=EVICT)


@triton.jit
def _bwd_kernel(g_ptr, blocks_ptr, partial_ptr, nw_ptr, pw_ptr, stats_ptr, gblocks_ptr, gpartial_ptr, dw_ptr,
                N, D, M: tl.constexpr, M_PAD: tl.constexpr, BLOCK_D: tl.constexpr, VEC: tl.constexpr,
                ONE_CHUNK: tl.constexpr, EVICT: tl.constexpr):
    S: tl.constexpr = M + 1
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)[None, :]
    m = tl.arange(0, M_PAD)
    dw_row = dw_ptr + pid.to(tl.int64) * D
    dw_own = tl.zeros([1, BLOCK_D], tl.float32)  # ONE_CHUNK: this program's d w, kept in registers
    for row32 in range(pid, N, tl.num_programs(0)):
        row = tl.cast(row32, tl.int64)
        a_b = tl.zeros([M_PAD, BLOCK_D // VEC], tl.float32)
        a_p = tl.zeros([1, BLOCK_D // VEC], tl.float32)
        for d0 in range(0, D, BLOCK_D):
            c = d0 + cols
            cmask = c < D
            g = tl.load(g_ptr + row * D + c, mask=cmask, other=0.0).to(tl.float32)
            vb, vp = _load_sources(blocks_ptr, partial_ptr, row, N, D, c, cmask, M, M_PAD, "")
            a_b += _fold(g * vb, VEC)
            a_p += _fold(g * vp, VEC)
        ab = tl.sum(a_b, 1)
        ap = tl.sum(a_p)
        stat_b = stats_ptr + m * N + row
        pi_b = tl.load(stat_b, mask=m < M, other=0.0)
        rstd_b = tl.load(stat_b + S * N, mask=m < M, other=0.0)
        score_b = tl.load(stat_b + 2 * S * N, mask=m < M, other=0.0)
        stat_p = stats_ptr + M * N + row
        pi_p = tl.load(stat_p)
        rstd_p = tl.load(stat_p + S * N)
        score_p = tl.load(stat_p + 2 * S * N)
        mean_a = tl.sum(pi_b * ab, 0) + pi_p * ap
        b_b = pi_b * (ab - mean_a) * rstd_b  # d s_j r_j: the coefficient of w in d v_j and of v_j in d w
        b_p = pi_p * (ap - mean_a) * rstd_p
        q_b = (b_b * score_b * rstd_b / D)[:, None]  # coefficient of -v_j in d v_j
        q_p = b_p * score_p * rstd_p / D
        pi_b = pi_b[:, None]
        b_b = b_b[:, None]
        for d0 in range(0, D, BLOCK_D):
            c = d0 + cols
            cmask = c < D
            g = tl.load(g_ptr + row * D + c, mask=cmask, other=0.0, eviction_policy=EVICT).to(tl.float32)
            w = _load_w(nw_ptr, pw_ptr, c, cmask)
            vb, vp = _load_sources(blocks_ptr, partial_ptr, row, N, D, c, cmask, M, M_PAD, EVICT)
            dv_b = pi_b * g + b_b * w - q_b * vb
            gptrs, mask = _blocks_at(gblocks_ptr, row, N, D, c, cmask, M, M_PAD)
            tl.store(gptrs, dv_b.to(gblocks_ptr.dtype.element_ty), mask=mask, eviction_policy=EVICT)
            dv_p = pi_p * g + b_p * w - q_p * vp
            tl.store(gpartial_ptr + row * D + c, dv_p.to(gpartial_ptr.dtype.element_ty), mask=cmask,
                     eviction_policy=EVICT)
            dw = tl.sum(b_b * vb, 0)[None, :] + b_p * vp
            if ONE_CHUNK:
                dw_own += dw
            else:
                tl.debug_barrier()  # the previous row's store of this chunk, by whichever thread, lands first
                tl.store(dw_row + c, tl.load(dw_row + c, mask=cmask, other=0.0) + dw, mask=cmask)
    if ONE_CHUNK:
        tl.store(dw_row + cols, dw_own, mask=cols < D)


def _evict(cfg: Config) -> str:
    return "evict_first" if cfg.evict_first else ""


def _launch_shape(blocks: Tensor, partial: Tensor, cfg: Config) -> tuple[int, int, int, int]:
    """(grid, M_PAD, BLOCK_D, VEC): VEC elements of 16 bytes, the vector one thread loads."""
    M, N, D = blocks.shape
    block_d = min(cfg.block_d, triton.next_power_of_2(D))
    vec = min(block_d, max(1, 16 // (blocks if M else partial).element_size()))
    sms = torch.cuda.get_device_properties(partial.device).multi_processor_count if partial.is_cuda else 3
    return max(1, min(N, sms * cfg.programs_per_sm)), max(1, triton.next_power_of_2(M)), block_d, vec


def mix_forward(blocks: Tensor, partial: Tensor, norm_weight: Tensor, proj_weight: Tensor, eps: float,
                cfg: Config | None = None, out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The forward kernel on flat contiguous inputs; no autograd.

    Args:
        blocks: [M, N, D] contiguous; partial: [N, D] contiguous (dtypes may differ; loads upcast to fp32).
        norm_weight: [D] contiguous; proj_weight: [D] contiguous (already flattened).
        cfg: launch shape; `default_config(M, backward=False)` when None.
        out: optional [N, D] buffer to write (tests pass a NaN-filled one); allocated in partial.dtype if None.

    Returns:
        (out [N, D] in out's dtype, stats [3, S, N] fp32: pi, r, s).
    """
    M, N, D = blocks.shape
    cfg = cfg or default_config(M, backward=False)
    out = torch.empty_like(partial) if out is None else out
    stats = torch.empty(3, M + 1, N, device=partial.device, dtype=torch.float32)
    grid, m_pad, block_d, vec = _launch_shape(blocks, partial, cfg)
    # with M = 0 the (empty, maybe null) blocks pointer is never read; pass a valid one
    _fwd_kernel[(grid,)](blocks if M else partial, partial, norm_weight, proj_weight, out, stats, N, D, eps,
                         M=M, M_PAD=m_pad, BLOCK_D=block_d, VEC=vec, EVICT=_evict(cfg), num_warps=cfg.num_warps)
    return out, stats


def mix_backward(grad_out: Tensor, blocks: Tensor, partial: Tensor, norm_weight: Tensor, proj_weight: Tensor,
                 stats: Tensor, cfg: Config | None = None, grad_blocks: Tensor | None = None,
                 grad_partial: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The backward kernel on flat contiguous inputs (as `mix_forward`, plus grad_out [N, D] contiguous).

    cfg: launch shape; `default_config(M, backward=True)` when None.

    Returns:
        (grad_blocks [M, N, D] in blocks.dtype, grad_partial [N, D] in partial.dtype, d w [D] fp32); the grad
        buffers may be passed in (tests poison them).
    """
    M, N, D = blocks.shape
    cfg = cfg or default_config(M, backward=True)
    grad_blocks = torch.empty_like(blocks) if grad_blocks is None else grad_blocks
    grad_partial = torch.empty_like(partial) if grad_partial is None else grad_partial
    grid, m_pad, block_d, vec = _launch_shape(blocks, partial, cfg)
    one_chunk = block_d >= D
    dw = (torch.empty if one_chunk else torch.zeros)(grid, D, device=partial.device, dtype=torch.float32)
    _bwd_kernel[(grid,)](grad_out, blocks if M else partial, partial, norm_weight, proj_weight, stats,
                         grad_blocks if M else grad_partial, grad_partial, dw, N, D,
                         M=M, M_PAD=m_pad, BLOCK_D=block_d, VEC=vec, ONE_CHUNK=one_chunk, EVICT=_evict(cfg),
                         num_warps=cfg.num_warps)
    return grad_blocks, grad_partial, dw.sum(0)


class _AttnResMix(torch.autograd.Function):
    @staticmethod
    def forward(ctx, blocks: Tensor, partial: Tensor, norm_weight: Tensor, proj_weight: Tensor, eps: float):
        D = partial.shape[-1]
        v = blocks.reshape(blocks.shape[0], partial.numel() // D, D).contiguous()
        p = partial.reshape(-1, D).contiguous()
        nw, pw = norm_weight.contiguous(), proj_weight.reshape(-1).contiguous()
        out, stats = mix_forward(v, p, nw, pw, eps)
        ctx.save_for_backward(v, p, nw, pw, stats)
        ctx.shapes = (blocks.shape, partial.shape, norm_weight.dtype, proj_weight.shape, proj_weight.dtype)
        return out.view(partial.shape)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        v, p, nw, pw, stats = ctx.saved_tensors
        blocks_shape, partial_shape, nw_dtype, pw_shape, pw_dtype = ctx.shapes
        g = grad_out.reshape(-1, p.shape[-1]).contiguous()
        grad_blocks, grad_partial, dw = mix_backward(g, v, p, nw, pw, stats)
        need = ctx.needs_input_grad
        d_nw = (dw * pw.float()).to(nw_dtype) if need[2] else None
        d_pw = (dw * nw.float()).to(pw_dtype).view(pw_shape) if need[3] else None
        return grad_blocks.view(blocks_shape), grad_partial.view(partial_shape), d_nw, d_pw, None


def attn_res_mix(blocks: Tensor, partial: Tensor, norm_weight: Tensor, proj_weight: Tensor, eps: float) -> Tensor:
    """`reference.attn_res_mix` through the fused kernels (same arguments, result and gradients).

    Raises:
        ValueError naming the argument: blocks not [M, *partial.shape], or a weight not holding D values.
    """
    D = partial.shape[-1] if partial.dim() else 0
    if partial.dim() == 0 or blocks.dim() != partial.dim() + 1 or blocks.shape[1:] != partial.shape:
        raise ValueError(f"attn_res_mix: blocks must be [M, *partial.shape] = [M, {list(partial.shape)}], "
                         f"got {list(blocks.shape)}")
    if norm_weight.numel() != D or proj_weight.numel() != D:
        raise ValueError(f"attn_res_mix: norm_weight [D] and proj_weight [1, D] need D = {D} values, got "
                         f"{list(norm_weight.shape)} and {list(proj_weight.shape)}")
    if partial.numel() == 0:
        return reference.attn_res_mix(blocks, partial, norm_weight, proj_weight, eps)
    return _AttnResMix.apply(blocks, partial, norm_weight, proj_weight, eps)
