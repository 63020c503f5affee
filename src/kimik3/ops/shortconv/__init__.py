"""KDA's short convolution: over whole sequences (`short_conv`: prefill and training, differentiable) and at
decode (`decode_short_conv`: one new token per sequence against its cached tail). Fused Triton kernels on CUDA,
the references (`.reference`) elsewhere."""

from __future__ import annotations

import torch
from torch import Tensor

from kimik3.ops.backend import has_triton, use_fast
from kimik3.ops.shortconv import reference

__all__ = ["decode_short_conv", "gathered_short_conv", "short_conv"]


def short_conv(x_BTP: Tensor, weight_PW: Tensor, cu_seqlens: Tensor | None = None) -> Tensor:
    """silu(causal depthwise conv) over whole sequences, differentiable in x and weight.

    Legend: B batch, T tokens, P channels, W conv window.

    Args:
        x_BTP: [B, T, P] pre-conv inputs (model dtype).
        weight_PW: [P, W] fp32 conv weight (`ShortConvolution.weight.squeeze(1)`), tap W-1 the current token.
        cu_seqlens: [docs + 1] document starts of packed rows (B = 1): the window never reaches before its own
            document's start (zero padding there, as at t < 0).

    Returns:
        [B, T, P] in x's dtype: silu(y), y[t] = sum over taps j of weight[:, j] * x[t - (W-1) + j], each product
        in fp32, summed from the newest tap back.

    On CUDA tensors (unless `use_backend("torch")`) one Triton kernel reads x once and writes the output, and
    the backward one more that recomputes the pre-activation (the reference makes ~4 fp32 passes per tap and
    autograd saves them).
    """
    if use_fast(x_BTP, "shortconv") and has_triton():
        from kimik3.ops.shortconv import triton as fast  # lazily: triton exists only on GPU machines

        return fast.short_conv(x_BTP, weight_PW, cu_seqlens)
    return reference.short_conv(x_BTP, weight_PW, cu_seqlens)


def gathered_short_conv(ext_XP: Tensor, index_WT: Tensor, weight_PW: Tensor) -> Tensor:
    """`short_conv` of the engine's packed chunks, each continuing its sequence's cached tail.

    Legend: X = T new rows + the tails' rows, T outputs, W conv window, P channels.

    Args:
        ext_XP: [X, P] the new pre-conv inputs, then the chunks' cached tails (model dtype).
        index_WT: [W, T] int64: the row of ext feeding tap j of each output (tap W-1 the token itself).
        weight_PW: [P, W] fp32 conv weight.

    Returns:
        [T, P] in ext's dtype, summed in `short_conv`'s order. On CUDA tensors (unless `use_backend("torch")`)
        and without autograd one Triton kernel (the reference gathers W fp32 copies of [T, P]); else the reference.
    """
    grad = torch.is_grad_enabled() and (ext_XP.requires_grad or weight_PW.requires_grad)
    if use_fast(ext_XP, "shortconv") and has_triton() and not grad:
        from kimik3.ops.shortconv import triton as fast

        return fast.gathered_short_conv(ext_XP, index_WT, weight_PW)
    return reference.gathered_short_conv(ext_XP, index_WT, weight_PW)


def decode_short_conv(x_NP: Tensor, tails_SWP: Tensor, slots_N: Tensor, weight_PW: Tensor) -> Tensor:
    """silu(causal depthwise conv) at the newest token of N sequences, and their tails moved on by one.

    Legend: N sequences, S cached tails (slots), W conv window (W-1 rows cached), P channels.

    Args:
        x_NP: [N, P] the new pre-conv inputs (model dtype).
        tails_SWP: [S, W-1, P] the cached tails, oldest row first (x's dtype); updated IN PLACE: row
            `slots_N[i]` becomes its last W-2 rows followed by `x_NP[i]`.
        slots_N: [N] int64 on x's device, distinct slots (not checked: that would cost a host sync). Rows
            whose results are discarded may share one slot (the engine pads graphed decode steps onto its scratch
            slot): their outputs and that slot's tail are then unspecified but finite (each element one of the
            racing rows' values), as with `index_copy_`'s repeated indices.
        weight_PW: [P, W] fp32 conv weight (`ShortConvolution.weight.squeeze(1)`), tap W-1 the newest token.

    Returns:
        [N, P] in x's dtype: silu(y) with y = sum_j window[j] * weight[:, j] over the window of W rows (tail
        then x), each product in fp32 and summed in fp32 from j = 0 (oldest) to W-1, as
        `ShortConvolution.last`'s `.sum(1)` does on the CPU.

    On CUDA tensors (unless `use_backend("torch")`) one Triton kernel reads each tail and x once, writes the
    output and the shifted tail; the reference takes a gather, a cat, an index_copy and ~5 elementwise passes.
    """
    if use_fast(x_NP, "shortconv") and has_triton():
        from kimik3.ops.shortconv import triton as fast  # lazily: triton exists only on GPU machines

        return fast.decode_short_conv(x_NP, tails_SWP, slots_N, weight_PW)
    return reference.decode_short_conv(x_NP, tails_SWP, slots_N, weight_PW)
