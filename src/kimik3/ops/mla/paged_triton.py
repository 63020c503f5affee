"""Absorbed MLA decode over the paged latent cache: split-K flash decoding in Triton; the contract of
`.reference.paged_latent_attention`.

Legend: T packed query rows, H heads, C latent rank, R shared-key width, X pool rows, N sequences, M blocks per
table, S splits, V value dim.

The absorption GEMMs run in torch (the query's q_nope @ W_kb and the output's o_lat @ W_vb^T, in q's dtype with
fp32 accumulation); the kernels work in the latent space, where every head shares one [C+R] key row per position:
  stage 1, program (t, head block, split): the query row t's live key blocks are split into S equal ranges of
    whole blocks; the program walks its range through the block table (loop bounds read from the device seq_lens,
    so the launch is the same whatever the lengths: CUDA-graph capturable; its work follows the cached tokens,
    never the table width M), online softmax in fp32, and writes its normalized partial o_lat and log-sum-exp;
  stage 2, program (t, h): combines the S partials, weighted by exp(lse - max lse).
Rows past a query's key count are never loaded (masked loads give 0, their scores -inf), so stale or NaN pool
rows cannot reach the output. A split with no keys writes lse = -inf and o = 0 (weight 0 in stage 2).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kimik3.ops.backend import batch_invariant_mode
from kimik3.ops.mla.reference import query_rows
from kimik3.ops.triton_utils import interpreting, round_to

__all__ = ["launch_shape", "paged_latent_attention", "split_rule"]

BLOCK_H = 16  # heads per program: tl.dot's minimum M on tensor cores; K3's 96 heads are 6 head blocks
TARGET_PROGRAMS = 2 * 132  # stage-1 programs to fill an H200's 132 SMs twice over at decode (T = 1)
MAX_SPLITS = 64  # stage 2 reduces over this many lanes, masked past the step's split count (a runtime argument)
INVARIANT_SPLIT_KEYS = 256  # batch-invariant mode: keys a split covers at least (`split_rule`)
NUM_WARPS, NUM_STAGES = 4, 2


# what changes from step to step is neither a constexpr nor specialized on (Triton compiles a variant per integer
# that is 1, a multiple of 16 or neither): the split count (1 to 64, from the step's longest sequence) and the block
# table's width (eager steps size it to their longest sequence) compiled new kernels mid-run on a new machine
# (1-1.5 s steps as a constexpr, then a 0.78 s step from the specializations; issue 38)
@triton.jit(do_not_specialize=["splits", "divisor", "min_blocks", "stride_tn"])
def _split_kernel(q_ptr, pool_ptr, table_ptr, seq_ptr, kv_len_ptr, o_ptr, lse_ptr, H, scale, splits, divisor,
                  min_blocks,
                  stride_qt, stride_qh, stride_x, stride_tn, stride_ot, stride_oh, stride_os,
                  C: tl.constexpr, R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_H: tl.constexpr, BS: tl.constexpr, INTERPRET: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    c = tl.arange(0, BLOCK_C)
    r = tl.arange(0, BLOCK_R)
    i = tl.arange(0, BS)
    h_ok, c_ok, r_ok = h < H, c < C, r < R
    n = tl.load(seq_ptr + t)
    kv_len = tl.load(kv_len_ptr + t)
    blocks = tl.cdiv(kv_len, BS)
    per_split = tl.maximum(tl.cdiv(blocks, divisor), min_blocks)
    b0 = split * per_split
    b1 = tl.minimum(b0 + per_split, blocks)
    q_rows = q_ptr + t * stride_qt + h[:, None] * stride_qh
    q_c = tl.load(q_rows + c[None, :], mask=h_ok[:, None] & c_ok[None, :], other=0.0)
    q_r = tl.load(q_rows + C + r[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    if INTERPRET:  # Triton's interpreter has no bf16 arithmetic: the same values, multiplied in fp32
        q_c = q_c.to(tl.float32)
        q_r = q_r.to(tl.float32)
    # finite start: a row whose every score is -inf keeps m = -1e30, p = exp(-inf) = 0 and never exp(-inf + inf)
    m_i = tl.full([BLOCK_H], -1e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    for b in range(b0, b1):
        block = tl.load(table_ptr + n * stride_tn + b).to(tl.int64)
        live = b * BS + i < kv_len
        rows = pool_ptr + (block * BS + i)[:, None] * stride_x
        k_c = tl.load(rows + c[None, :], mask=live[:, None] & c_ok[None, :], other=0.0)  # [BS, BLOCK_C]
        k_r = tl.load(rows + C + r[None, :], mask=live[:, None] & r_ok[None, :], other=0.0)
        if INTERPRET:
            k_c = k_c.to(tl.float32)
            k_r = k_r.to(tl.float32)
        s = tl.dot(q_c, tl.trans(k_c)) + tl.dot(q_r, tl.trans(k_r))  # [BLOCK_H, BS], fp32 accumulation
        s = tl.where(live[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(k_c.dtype), k_c)
        m_i = m_new
    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    out = o_ptr + t * stride_ot + h[:, None] * stride_oh + split * stride_os + c[None, :]
    tl.store(out, o, mask=h_ok[:, None] & c_ok[None, :])
    tl.store(lse_ptr + (t * H + h) * splits + split, lse, mask=h_ok)


@triton.jit(do_not_specialize=["splits"])
def _combine_kernel(o_ptr, lse_ptr, out_ptr, H, splits, stride_ot, stride_oh, stride_os, stride_out,
                    C: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr, INTERPRET: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    c = tl.arange(0, BLOCK_C)
    s_ok, c_ok = s < splits, c < C
    lse = tl.load(lse_ptr + (t * H + h) * splits + s, mask=s_ok, other=float("-inf"))
    w = tl.exp(lse - tl.max(lse, 0))  # every query sees >= 1 key, so some split has a finite lse
    o = tl.load(o_ptr + t * stride_ot + h * stride_oh + s[:, None] * stride_os + c[None, :],
                mask=s_ok[:, None] & c_ok[None, :], other=0.0)
    o_lat = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    tl.store(out_ptr + (t * H + h) * stride_out + c, round_to(o_lat, out_ptr.dtype.element_ty, INTERPRET), mask=c_ok)


def launch_shape(T: int, H: int, max_seq_len: int, block_size: int) -> tuple[int, int, int]:
    """Stage 1's grid (T, head blocks, splits): from host sizes only (T, H, the host bound on lengths), never the
    table width, so a padded table launches the same grid. Splits: enough programs to fill the GPU at small T,
    no more than the bound's blocks (an empty split costs a launch slot and a zero partial)."""
    head_blocks = triton.cdiv(H, BLOCK_H)
    want = triton.cdiv(TARGET_PROGRAMS, T * head_blocks)
    return T, head_blocks, max(1, min(want, MAX_SPLITS, triton.cdiv(max_seq_len, block_size)))


def split_rule(T: int, H: int, max_seq_len: int, block_size: int) -> tuple[tuple[int, int, int], int, int]:
    """(stage 1's grid, divisor, min_blocks): a query row with b live key blocks splits them into ranges of
    max(ceil(b / divisor), min_blocks) blocks, one per program of its row; programs past its ranges write empty
    partials. By default the grid's split count is the divisor (`launch_shape`: fill the GPU at small T). In
    `batch_invariant_mode` a row's ranges follow its own length only (a divisor of MAX_SPLITS, at least
    INVARIANT_SPLIT_KEYS keys a range), and the grid has enough splits for the step's longest row: the combine then
    meets the same partials in the same lanes whatever else the step holds (empty lanes add exact zeros)."""
    grid = launch_shape(T, H, max_seq_len, block_size)
    if not batch_invariant_mode():
        return grid, grid[2], 1
    min_blocks = max(1, INVARIANT_SPLIT_KEYS // block_size)
    splits = max(1, min(MAX_SPLITS, triton.cdiv(triton.cdiv(max_seq_len, block_size), min_blocks)))
    return (grid[0], grid[1], splits), MAX_SPLITS, min_blocks


def paged_latent_attention(q_THK: Tensor, latent_pool_XC: Tensor, kv_b_weight: Tensor, *, block_tables_NM: Tensor,
                           cu_seqlens_q: Tensor, seq_lens_N: Tensor, block_size: int, qk_nope_head_dim: int,
                           scale: float, max_seq_len: int | None = None) -> Tensor:
    """`reference.paged_latent_attention` as two Triton launches between the absorption GEMMs. With
    `max_seq_len` given, no host sync (CUDA-graph capturable); None reads max(seq_lens) on the host."""
    T, H, K = q_THK.shape
    N, C = qk_nope_head_dim, kv_b_weight.shape[1]
    R = K - N
    if latent_pool_XC.shape[-1] != C + R or kv_b_weight.shape[0] % H:
        raise ValueError(f"paged_latent_attention: expected latent_pool [X, C+R] = [X, {C + R}] and kv_b_weight "
                         f"[H*(N+V), C]; got {list(latent_pool_XC.shape)} and {list(kv_b_weight.shape)}")
    if latent_pool_XC.stride(-1) != 1 or block_tables_NM.stride(-1) != 1:
        raise ValueError("paged_latent_attention: latent_pool and block_tables must be contiguous in their last dim")
    if max_seq_len is None:
        max_seq_len = int(seq_lens_N.max())
    w_HXC = kv_b_weight.to(q_THK.dtype).view(H, -1, C)
    q_lat_THC = torch.einsum("thn,hnc->thc", q_THK[..., :N], w_HXC[:, :N])
    q_cat_THX = torch.cat([q_lat_THC, q_THK[..., N:]], dim=-1).to(latent_pool_XC.dtype)
    seq_T, kv_len_T = query_rows(cu_seqlens_q, seq_lens_N, T)
    grid, divisor, min_blocks = split_rule(T, H, max_seq_len, block_size)
    splits = grid[2]
    o_THSC = torch.empty(T, H, splits, C, dtype=torch.float32, device=q_THK.device)
    lse_THS = torch.empty(T, H, splits, dtype=torch.float32, device=q_THK.device)
    o_lat_THC = torch.empty(T, H, C, dtype=q_THK.dtype, device=q_THK.device)
    if T == 0:
        return torch.empty(0, H, w_HXC.shape[1] - N, dtype=q_THK.dtype, device=q_THK.device)
    BLOCK_C = triton.next_power_of_2(C)
    interp = interpreting()
    _split_kernel[grid](
        q_cat_THX, latent_pool_XC, block_tables_NM, seq_T, kv_len_T, o_THSC, lse_THS, H, scale, splits, divisor,
        min_blocks,
        q_cat_THX.stride(0), q_cat_THX.stride(1), latent_pool_XC.stride(0), block_tables_NM.stride(0),
        o_THSC.stride(0), o_THSC.stride(1), o_THSC.stride(2),
        C=C, R=R, BLOCK_C=BLOCK_C, BLOCK_R=triton.next_power_of_2(R), BLOCK_H=BLOCK_H, BS=block_size,
        INTERPRET=interp, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    _combine_kernel[(T, H)](
        o_THSC, lse_THS, o_lat_THC, H, splits, o_THSC.stride(0), o_THSC.stride(1), o_THSC.stride(2),
        o_lat_THC.stride(1), C=C, BLOCK_C=BLOCK_C, BLOCK_S=MAX_SPLITS, INTERPRET=interp, num_warps=NUM_WARPS)
    return torch.einsum("thc,hvc->thv", o_lat_THC, w_HXC[:, N:])
