"""Routed experts with LoRA over frozen MXFP4 experts as grouped GEMMs (CUDA): `lora.routed_experts_mxfp4_lora`'s
function, its per-expert loop replaced by one grouped GEMM per projection.

Legend: N tokens, A active experts per token, M = N*A routed rows sorted by expert, E experts, L latent width,
F expert width, R rank, I / O a projection's input / output width, E' = E or 1 (a shared factor).

Per projection k: base = x W_k^T with W_k decoded from the codes into a transient bf16 buffer (one Triton pass,
`kimik3.ops.mxfp4.decode`) that is freed as soon as the GEMM has read it and decoded again in backward for dx;
the LoRA term (x A_k^T) B_k^T is two more grouped GEMMs (plain ones for a shared factor), under autograd. Routed
rows move with `.combine`'s gather kernels, as in `grouped.routed_experts`. The sums are those of the reference
loop with the GEMMs' own summation order (bf16-level differences); with every B zero the LoRA terms add +0.

The transient buffer is one projection's experts (E x O x I bf16: 2.8 GB at 128 experts of K3's widths); above
`CHUNK_BYTES` the experts are decoded and multiplied a chunk at a time (one host sync per projection for the chunks'
row bounds), so that K3's 896 experts need no 20 GB buffer.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kimik3.ops.moe import combine
from kimik3.ops.moe.grouped import expert_offsets
from kimik3.ops.mxfp4 import decode
from kimik3.ops.situ import situ_glu

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
    out = x_MI.new_empty(x_MI.shape[0], out_w if transpose else 2 * P)
    for e0, e1, r0, r1 in _chunks(offs_E, E, out_w * 2 * P * x_MI.element_size()):
        rows = slice(r0, None if r1 < 0 else r1)
        w_EOI = decode(packed[e0:e1], scale[e0:e1], x_MI.dtype)
        w = w_EOI.transpose(-2, -1) if transpose else w_EOI
        out[rows] = torch._grouped_mm(x_MI[rows], w, offs=offs_E[e0:e1] - r0)
        del w_EOI, w
    return out


class _PackedGroupedLinear(torch.autograd.Function):
    """y = x W_e^T over each expert's rows; a gradient for x only (the codes are frozen and saved, not W)."""

    @staticmethod
    def forward(ctx, x_MI: Tensor, packed: Tensor, scale: Tensor, offs_E: Tensor) -> Tensor:
        ctx.save_for_backward(packed, scale, offs_E)
        return _grouped_packed(x_MI, packed, scale, offs_E, transpose=True)

    @staticmethod
    def backward(ctx, dy_MO: Tensor):
        packed, scale, offs_E = ctx.saved_tensors
        return _grouped_packed(dy_MO.contiguous(), packed, scale, offs_E, transpose=False), None, None, None


def _factor(x_MI: Tensor, f: Tensor, offs_E: Tensor) -> Tensor:
    """x @ f_e^T for the factor f [E', out, in] in x.dtype: grouped per expert, or one GEMM when shared."""
    f = f.to(x_MI.dtype)
    if f.shape[0] == 1:
        return x_MI @ f[0].T
    return torch._grouped_mm(x_MI, f.transpose(-2, -1), offs=offs_E)


def supports(z: Tensor, lora_a: tuple[Tensor, ...]) -> bool:
    """Whether this path runs the call: bf16 on CUDA with ranks that meet the grouped GEMM's 16-byte strides."""
    return z.is_cuda and z.dtype == torch.bfloat16 and all(a.shape[1] % 8 == 0 for a in lora_a)


def routed_experts_mxfp4_lora(z: Tensor, topk_idx: Tensor, topk_weight: Tensor, packed, scales, lora_a, lora_b,
                              scale: float, beta: float, linear_beta: float) -> Tensor:
    """`kimik3.ops.moe.routed_experts_mxfp4_lora` (same contract) as grouped GEMMs; see the module docstring."""
    N, A = topk_idx.shape
    sorted_e, order = torch.sort(topk_idx.reshape(-1), stable=True)
    offs_E = expert_offsets(sorted_e, packed[0].shape[0])
    inv_NA = combine.inverse(order, N, A)
    x_ML = combine.dispatch(z, order // A, inv_NA)

    def proj(x: Tensor, k: int) -> Tensor:
        base = _PackedGroupedLinear.apply(x, packed[k], scales[k], offs_E)
        return base + _factor(_factor(x, lora_a[k], offs_E), lora_b[k], offs_E) * scale

    h_MF = situ_glu(proj(x_ML, 0), proj(x_ML, 1), beta, linear_beta)
    return combine.combine(proj(h_MF, 2), inv_NA, topk_weight)
