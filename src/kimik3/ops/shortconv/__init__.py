"""KDA's short convolution at decode: one new token per sequence against its cached tail. One public function;
a fused Triton kernel on CUDA, the reference elsewhere."""

from __future__ import annotations

from torch import Tensor

from kimik3.ops.backend import has_triton, use_fast
from kimik3.ops.shortconv import reference

__all__ = ["decode_short_conv"]


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
    if use_fast(x_NP) and has_triton():
        from kimik3.ops.shortconv import triton as fast  # lazily: triton exists only on GPU machines

        return fast.decode_short_conv(x_NP, tails_SWP, slots_N, weight_PW)
    return reference.decode_short_conv(x_NP, tails_SWP, slots_N, weight_PW)
