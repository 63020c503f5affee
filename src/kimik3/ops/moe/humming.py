"""Routed experts on MXFP4-packed weights (W4A16) through Humming's MoE GEMM (`humming-kernels`, Hopper).

Legend: N tokens, A active experts per token, M = N*A routed rows in flat (token, slot) order, E experts,
L latent width, F expert width, BM Humming's row block; packed weights [E, out, in/2] uint8, scales
[E, out, in/32] uint8 (E8M0). bf16 activations only.

Humming (the W4A16 MoE backend vLLM prefers on SM90) takes MXFP4 natively: E2M1 codes and one E8M0 scale per 32
inputs, decoded exactly in the GEMM's main loop, fp32 accumulation, bf16 out. Per call, nothing waits on the host:
    tables   vLLM's block alignment, in torch: each expert's flat rows in ascending row order, padded to a multiple
             of BM with the sentinel M; the expert of each BM-row block; the padded length (read on the device).
    gemm1    Humming INDEXED GEMM over [w1; w3] stacked as one [E, 2F, L] layer: row r of g13 [M, 2F] is
             z[r // A] @ [w1; w3][expert of r]^T, rounded to bf16 once (as the reference rounds both matmuls;
             its heuristic tiles with stream-K off, see `_tuning`).
    SiTU     one Triton pass, `kimik3.ops.situ`'s device function in fp32: h [M, F] = SiTU(g13[:, :F], g13[:, F:]).
    gemm2    Humming INDEXED GEMM, top_k 1: y [M, L] = h @ w2^T per row's expert, rounded to bf16.
    combine  the W4A16 kernels' slot-order fp32 combine (`combine.slot_sum`).
Humming has no activation epilogue, so h makes one round trip through memory (M*3F*2 bytes).

Humming wants its own weight layout (`relayout`: `humming.transform`, a copy as large as the packed experts).
Two ways to hold it:
    one copy   `relayout` once, drop the stored bytes, compute with the `RelaidWeights` it returns (what
               `kimik3.quant.relayout_experts` does to a model for inference: expert memory unchanged).
    two copies `routed_experts_mxfp4` on the stored bytes re-lays out on its first call and keeps the result on
               the w1 packed tensor, keyed by the six tensors' storage and version counters (`_prepared`): a
               module's buffers pay once, an in-place update (`copy_` by the loader) re-lays out on the next call.
The first call at each routed-row count also picks Humming's tiles (its heuristics) and JIT-compiles them
(seconds, cached on disk in HUMMING_CACHE_DIR); after that warm-up a call is CUDA-graph capturable.
"""

from __future__ import annotations

import functools
import json
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from kimik3.ops.backend import batch_invariant_mode
from kimik3.ops.moe import RelaidWeights
from kimik3.ops.moe.combine import slot_sum
from kimik3.ops.situ.triton import situ
from kimik3.ops.triton_utils import interpreting, round_to

BLOCK = 2048  # SiTU elements per program
# Humming's compute config, by batch-invariant mode: its invariant kernels sum every row in one K order (K steps of
# 32 products per warp, no stream-K) whatever tile the row count picks
COMPUTE = {invariant: json.dumps({"use_batch_invariant": invariant, "use_f16_accum": False, "gemm_type": "indexed"})
           for invariant in (False, True)}
_CACHE = "_kimik3_humming"  # attribute on the w1 packed tensor holding (key, layers)


class Layer(NamedTuple):
    config: object  # humming.config.LayerConfig
    tensors: dict[str, Tensor]  # Humming's weight, weight_scale (and weight_scale_2 where its transform adds one)


def unsupported(z: Tensor, packed: tuple[Tensor, Tensor, Tensor]) -> str | None:
    """Why Humming cannot run this call (None when it can): see `unsupported_for`."""
    return unsupported_for(z.device, z.dtype, z.shape[1], packed[0].shape[1])


def unsupported_for(device: torch.device, dtype: torch.dtype, L: int, F: int) -> str | None:
    """Why Humming cannot run experts of latent width L and expert width F on `device` in `dtype` (None when it
    can): bf16 on a CUDA device of compute capability 9.x, and widths that need no padding (L a multiple of 256,
    F of 128: its N blocks and K blocks)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
        return "needs a CUDA device of compute capability 9.x (Hopper)"
    if dtype != torch.bfloat16:
        return f"needs bf16 activations, got {dtype}"
    if L % 256 or F % 128:
        return f"needs L % 256 == 0 and F % 128 == 0, got L={L}, F={F}"
    return None


def _version(t: Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # an inference tensor has no version counter (and cannot change outside inference mode)
        return -1


def _relayout(packed: Tensor, scale: Tensor, shape_n: int, shape_k: int) -> Layer:
    """MXFP4 bytes [E, n, k/2] and E8M0 bytes [E, n, k/32] -> Humming's layout, the values unchanged."""
    from humming import dtypes
    from humming.schema import HummingWeightSchema
    from humming.transform import prepare_layer_config, transform_humming_tensors

    schema = HummingWeightSchema(b_dtype=dtypes.float4e2m1, bs_dtype=dtypes.float8e8m0, weight_scale_group_size=32)
    # the bytes go in as stored: 8 codes per int32 in Humming's order, the scale bytes as float8_e8m0fnu
    tensors = {"weight": packed.contiguous().view(torch.int32),
               "weight_scale": scale.contiguous().view(torch.float8_e8m0fnu)}
    config = prepare_layer_config(shape_n=shape_n, shape_k=shape_k, weight_schema=schema,
                                  num_experts=packed.shape[0], pad_n_to_multiple=256, pad_k_to_multiple=128,
                                  torch_dtype=torch.bfloat16, device=packed.device, tensors=tensors)
    return Layer(config, transform_humming_tensors(config, tensors))


def relayout(packed: tuple[Tensor, Tensor, Tensor], scales: tuple[Tensor, Tensor, Tensor]) -> RelaidWeights:
    """The experts' MXFP4 codes and scales (as `routed_experts_mxfp4` takes them) in Humming's layout, a new copy
    on their device (the inputs are not changed)."""
    (w1p, w3p, w2p), (w1s, w3s, w2s) = packed, scales
    E, F, L = w1p.shape[0], w1p.shape[1], w1p.shape[2] * 2
    w13 = _relayout(torch.cat([w1p, w3p], dim=1), torch.cat([w1s, w3s], dim=1), 2 * F, L)
    return RelaidWeights(w13, _relayout(w2p, w2s, L, F), E, F)


def _prepared(packed: tuple[Tensor, Tensor, Tensor], scales: tuple[Tensor, Tensor, Tensor]) -> RelaidWeights:
    """`relayout` of these tensors, made on the first call for them and kept on packed[0] (a second copy)."""
    key = tuple((t.data_ptr(), _version(t), tuple(t.shape)) for t in (*packed, *scales))
    cached = getattr(packed[0], _CACHE, None)
    if cached is not None and cached[0] == key:
        return cached[1]
    setattr(packed[0], _CACHE, None)  # a stale copy goes before the new one is made
    relaid = relayout(packed, scales)
    setattr(packed[0], _CACHE, (key, relaid))
    return relaid


def _tuning(layer: Layer, rows: int, device: torch.device) -> tuple[str, int]:
    """(Humming's heuristic tile config for `rows` routed rows, as JSON; its row block BM), without stream-K; in
    `batch_invariant_mode` its batch-invariant heuristics (a row's sums then follow no tile choice).

    Stream-K splits a tile's K loop over CTAs, and each CTA adds its partial sum into the bf16 output (its
    epilogue: a bf16 reduce-add, atomic beyond 3 slices): roundings the reference does not make, in an order
    that can vary run to run: ten times the reference error with it, for 5% less time (BENCHMARKS.md,
    "Measurements behind code choices").
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _tuning_of(layer.config, _row_sample(layer.config, rows, index), index, batch_invariant_mode())


@functools.cache
def _heuristics(device_index: int):
    from humming.tune import get_heuristics_class

    return get_heuristics_class(device=device_index)


def _row_sample(config, rows: int, device_index: int) -> int:
    """The row count Humming's heuristics decide by for `rows`: on sm_90 (H100, H200, H20) they round it up to a
    sample first (`get_shape_m_sample`: steps of 8 rows up to 1,024, then 16, 32, 64, 128), and decide on that
    alone, so one decision serves every count of a sample (an engine's warm-up asks for 4,096 token counts x 16
    routed rows: 16 s of a start enumerating them, ~2 ms a decision, bench_startup; ~770 samples). Read in
    humming-kernels 0.1.20's source (the pinned version) and checked over every count a serve warm-up asks
    (BENCHMARKS.md). Elsewhere the count itself (other GPUs' heuristics read it unrounded)."""
    cls = _heuristics(device_index)
    return cls.get_shape_m_sample(config, rows) if cls.sm_version == 90 else rows


# kept for the process: Humming's own cache holds 1,024 entries, and an engine's warm-up asks for every row count
# of up to max_num_batched_tokens tokens (2 x 2,048 at serve's defaults) three times (`tiling_token_counts` for
# the compiles and the warm calls, then the calls), so with its cache alone each pass recomputed every one
@functools.cache
def _tuning_of(config, rows: int, device_index: int, invariant: bool) -> tuple[str, int]:
    from humming.tune import get_heuristics_config

    t = get_heuristics_config(layer_config=config, shape_m=rows, gemm_type="indexed", device=device_index,
                              use_batch_invariant=invariant)
    t = dict(t, use_stream_k=False)  # a copy: Humming caches the dict it returns
    return json.dumps(t), int(t["block_shape"][0])


FUSED_TABLES_MAX_ROWS = 1024  # routed rows up to which `_tables` is one Triton program (decode: 64 tokens x 16)


def _tables(topk_idx: Tensor, num_experts: int, bm: int) -> tuple[Tensor, Tensor, Tensor]:
    """`_tables_reference` (same tensors), as one Triton program up to FUSED_TABLES_MAX_ROWS routed rows: about
    20 fewer kernels per call, which is what a decode step pays for them (a CUDA graph still launches each)."""
    M = topk_idx.numel()
    runnable = topk_idx.is_cuda or interpreting()
    if not (runnable and 0 < M <= FUSED_TABLES_MAX_ROWS):
        return _tables_reference(topk_idx, num_experts, bm)
    dev = topk_idx.device
    cap = _cap(M, num_experts, bm)
    sorted_ids = torch.empty(cap, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(cap // bm, dtype=torch.int32, device=dev)
    padded = torch.empty(1, dtype=torch.int32, device=dev)
    m_pow2 = max(16, triton.next_power_of_2(M))
    scratch = torch.empty(m_pow2, dtype=torch.int32, device=dev)
    _tables_kernel[(1,)](topk_idx.reshape(-1), sorted_ids, expert_ids, padded, scratch, M, num_experts, cap,
                         cap // bm, BM=bm, M_POW2=m_pow2, BLOCK=1024, num_warps=4)
    return sorted_ids, expert_ids, padded


def _cap(M: int, num_experts: int, bm: int) -> int:
    """A bound on the padded length for any routing of M rows: M + min(E, M) * (bm - 1), rounded up to bm."""
    return -(-(M + min(num_experts, M) * (bm - 1)) // bm) * bm


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


# the row counts are not specialized on (Triton compiles a variant per integer that is 1, a multiple of 16 or
# neither, and each variant of this sort took ~2.7 s to compile on a new machine): a variant per (BM, M_POW2) only,
# which `compile_tiles` compiles ahead, beside Humming's kernels
@triton.jit(do_not_specialize=["M", "cap", "num_blocks"])
def _tables_kernel(idx_ptr, sorted_ids_ptr, expert_ids_ptr, padded_ptr, scratch_ptr, M, E, cap, num_blocks,
                   BM: tl.constexpr, M_POW2: tl.constexpr, BLOCK: tl.constexpr):
    """One program: `_tables_reference` for M <= M_POW2 routed rows.

    The rows sorted by key = expert * M_POW2 + row (distinct keys, so ascending rows within an expert, as the
    stable sort); rank = place within its expert's run; the padding an expert's run adds, (BM - count % BM) % BM,
    sits on its last row, and a row's padded place is its sorted place plus the padding of the runs before it.
    """
    for start in range(0, cap, BLOCK):  # sentinels and the clamp value first; the scatter below overwrites
        offs = start + tl.arange(0, BLOCK)
        tl.store(sorted_ids_ptr + offs, tl.zeros([BLOCK], tl.int32) + M, mask=offs < cap)
    for start in range(0, num_blocks, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(expert_ids_ptr + offs, tl.zeros([BLOCK], tl.int32) + E - 1, mask=offs < num_blocks)
    r = tl.arange(0, M_POW2)
    valid = r < M
    e = tl.load(idx_ptr + r, mask=valid, other=E).to(tl.int32)  # padding rows sort last, past the M valid ones
    key = tl.sort(e * M_POW2 + r)
    se, row = key // M_POW2, key % M_POW2
    tl.store(scratch_ptr + r, se)
    tl.debug_barrier()  # the neighbours' experts, read back across threads of this program
    prev = tl.load(scratch_ptr + r - 1, mask=r > 0, other=-1)
    nxt = tl.load(scratch_ptr + r + 1, mask=r + 1 < M, other=-1)
    run_start = tl.associative_scan(tl.where(se != prev, r, 0), 0, _max)
    rank = r - run_start
    pad = tl.where(valid & (se != nxt), (BM - (rank + 1) % BM) % BM, 0)
    pos = r + tl.cumsum(pad, 0) - pad
    tl.debug_barrier()  # the fills above land before the scatter
    tl.store(sorted_ids_ptr + pos, row, mask=valid)
    tl.store(expert_ids_ptr + pos // BM, se, mask=valid)
    tl.store(padded_ptr, M + tl.sum(pad, 0))


def _tables_reference(topk_idx: Tensor, num_experts: int, bm: int) -> tuple[Tensor, Tensor, Tensor]:
    """Humming's INDEXED routing tables, without a host sync.

    Returns sorted_ids int32 [cap]: the flat rows of expert 0, then expert 1 ..., each expert's run padded to a
    multiple of bm with the sentinel M; expert_ids int32 [cap / bm]: the expert of each bm-row block (blocks past
    the padded length are skipped by the kernel; they hold E - 1); num_tokens_padded int32 [1].
    cap = M + min(E, M) * (bm - 1) rounded up to bm bounds the padded length for any routing.
    """
    flat = topk_idx.reshape(-1)
    M, dev = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).index_add_(0, flat, torch.ones_like(flat))
    padded = (counts + bm - 1) // bm * bm
    pad_end = padded.cumsum(0)
    sorted_e, order = torch.sort(flat, stable=True)
    # a row's place: its expert's padded start plus its rank among that expert's rows
    pos = (pad_end - padded - counts.cumsum(0) + counts)[sorted_e] + torch.arange(M, device=dev)
    cap = _cap(M, num_experts, bm)
    sorted_ids = torch.full((cap,), M, dtype=torch.int32, device=dev)
    sorted_ids[pos] = order.to(torch.int32)
    block_start = torch.arange(0, cap, bm, device=dev)
    expert_ids = torch.searchsorted(pad_end, block_start, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, expert_ids, pad_end[-1:].to(torch.int32)


def _gemm(layer: Layer, x: Tensor, out: Tensor, tables: tuple[Tensor, Tensor, Tensor], top_k: int,
          tuning: str) -> None:
    """out[r] = x[r // top_k] @ W[expert of r]^T for every routed row r (Humming INDEXED, into `out`)."""
    from humming.forward import humming_forward

    w = layer.tensors
    humming_forward(layer.config, inputs=x, weight=w["weight"], weight_scale=w["weight_scale"],
                    weight_scale_2=w.get("weight_scale_2"), outputs=out, sorted_ids=tables[0], expert_ids=tables[1],
                    num_tokens_padded=tables[2], top_k=top_k, compute_config=COMPUTE[batch_invariant_mode()],
                    tuning_config=tuning)


@triton.jit
def _situ_kernel(g13_ptr, h_ptr, n, F: tl.constexpr, beta, linear_beta, BLOCK: tl.constexpr,
                 INTERPRET: tl.constexpr):
    """h[r, c] = SiTU(g13[r, c], g13[r, F + c]) over the n = M * F elements of h."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    src = (offs // F) * (2 * F) + offs % F
    g = tl.load(g13_ptr + src, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(g13_ptr + src + F, mask=mask, other=0.0).to(tl.float32)
    h = situ(g, u, beta, linear_beta)
    tl.store(h_ptr + offs, round_to(h, h_ptr.dtype.element_ty, INTERPRET), mask=mask)


def routed_experts_mxfp4(z: Tensor, topk_idx: Tensor, topk_weight: Tensor, packed: tuple[Tensor, Tensor, Tensor],
                         scales: tuple[Tensor, Tensor, Tensor], beta: float, linear_beta: float) -> Tensor:
    """Humming path of `kimik3.ops.moe.routed_experts_mxfp4` (same contract; bf16 z on Hopper, see `unsupported`),
    on a re-laid-out copy of the weights kept beside them (`_prepared`).

    topk_idx must hold experts in [0, E) (not checked: that would need the host).
    """
    return routed_experts_relaid(z, topk_idx, topk_weight, _prepared(packed, scales), beta, linear_beta)


def routed_experts_relaid(z: Tensor, topk_idx: Tensor, topk_weight: Tensor, relaid: RelaidWeights, beta: float,
                          linear_beta: float) -> Tensor:
    """`routed_experts_mxfp4` on weights already in Humming's layout (`relayout`): the same function."""
    (N, L), A = z.shape, topk_idx.shape[1]
    E, F = relaid.num_experts, relaid.width
    M = N * A
    if M == 0:
        return torch.zeros_like(z)
    w13, w2 = relaid.w13, relaid.w2
    t13, bm13 = _tuning(w13, M, z.device)
    t2, bm2 = _tuning(w2, M, z.device)
    tables13 = _tables(topk_idx, E, bm13)
    tables2 = tables13 if bm2 == bm13 else _tables(topk_idx, E, bm2)
    interpret = interpreting()
    g13 = torch.empty(M, 2 * F, dtype=z.dtype, device=z.device)
    _gemm(w13, z.contiguous(), g13, tables13, A, t13)
    h = torch.empty(M, F, dtype=z.dtype, device=z.device)
    _situ_kernel[(triton.cdiv(M * F, BLOCK),)](g13, h, M * F, F=F, beta=float(beta), linear_beta=float(linear_beta),
                                               BLOCK=BLOCK, INTERPRET=interpret, num_warps=8)
    y = torch.empty(M, L, dtype=z.dtype, device=z.device)
    _gemm(w2, h, y, tables2, 1, t2)
    return slot_sum(y, topk_weight)


def compile_tiles(relaid: RelaidWeights, counts: list[int], top_k: int, device: torch.device) -> int:
    """Compile, side by side in threads, the kernels calls of `counts` tokens run: each distinct (layer, tile
    config) of Humming's once, and each variant of the routing-table kernel (`_tables_kernel`); returns how many
    were asked for. Humming compiles a kernel in a child process (NVRTC) and caches it on disk: serially the
    slice's 27 configs took 40 s of a new machine's warm-up (bench_startup), and the table kernel's 9 variants
    another 24 s; an engine compiles them here (`compile_relaid`, `warm_relaid`) before any call, which then only
    loads them."""
    from concurrent.futures import ThreadPoolExecutor

    import humming.forward  # noqa: F401 (registers torch.ops.humming)

    guard = torch.empty(0, device=device)  # the op reads the device from a tensor
    tiles, tables = set(), set()
    for n in counts:
        M = n * top_k
        for layer in (relaid.w13, relaid.w2):
            tuning, bm = _tuning(layer, M, device)
            tiles.add((layer.config.to_str(), tuning))
            if 0 < M <= FUSED_TABLES_MAX_ROWS:
                tables.add((bm, max(16, triton.next_power_of_2(M))))

    compute = COMPUTE[batch_invariant_mode()]  # read here: the pool's threads do not inherit the context

    def tile(job: tuple[str, str]) -> None:
        torch.ops.humming.prepare_kernels(guard, job[0], compute, job[1])

    def table(job: tuple[int, int]) -> None:  # compiled for the launch `_tables` makes (Triton's `warmup`: no launch)
        bm, m_pow2 = job
        i32 = torch.empty(m_pow2, dtype=torch.int32, device=device)
        _tables_kernel.warmup(torch.empty(m_pow2, dtype=torch.int64, device=device), i32, i32, i32, i32, m_pow2,
                              relaid.num_experts, m_pow2, 1, BM=bm, M_POW2=m_pow2, BLOCK=1024, num_warps=4,
                              grid=(1,))

    jobs = [(tile, j) for j in sorted(tiles)] + [(table, j) for j in sorted(tables)]
    if not jobs:
        return 0
    jobs[0][0](jobs[0][1])  # alone first: whatever Humming sets up once per process is set up by one thread
    with ThreadPoolExecutor(max_workers=max(1, min(len(jobs) - 1, os.cpu_count() or 1))) as pool:
        list(pool.map(lambda job: job[0](job[1]), jobs[1:]))
    return len(jobs)


def tiling_token_counts(relaid: RelaidWeights, max_tokens: int, top_k: int, device: torch.device) -> list[int]:
    """Token counts in 1..max_tokens that between them meet every kernel a call of up to `max_tokens` tokens
    compiles: the smallest count at which the routed rows (tokens x top_k) pick each distinct pair of Humming
    tile configs (its heuristics change tiles at many row counts, each a JIT compile of seconds on first use),
    and each power of two up to FUSED_TABLES_MAX_ROWS rows (the routing-table kernel's sizes)."""
    seen, counts = set(), []
    for n in range(1, max_tokens + 1):
        M = n * top_k
        key = (_tuning(relaid.w13, M, device)[0], _tuning(relaid.w2, M, device)[0],
               max(16, triton.next_power_of_2(M)) if M <= FUSED_TABLES_MAX_ROWS else 0)
        if key not in seen:
            seen.add(key)
            counts.append(n)
    return counts

