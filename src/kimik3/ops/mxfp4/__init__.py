"""MXFP4 weight codec of the K3 checkpoint ("mxfp4-pack-quantized"): the reference, and one Triton decode kernel on
CUDA (`.triton`, which also holds the tile decoders the W4A16 kernels share)."""

from __future__ import annotations

import torch
from torch import Tensor

from kimik3.ops.backend import has_triton, use_fast
from kimik3.ops.mxfp4 import reference

__all__ = ["GROUP_SIZE", "decode", "encode", "packed_shapes"]

GROUP_SIZE = reference.GROUP_SIZE  # input columns sharing one E8M0 scale byte


def packed_shapes(out: int, in_: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Shapes of (weight_packed, weight_scale) for a logical [out, in_] weight.

    Returns:
        ((out, in_ // 2), (out, in_ // 32)).

    Raises:
        ValueError: when in_ is not a positive multiple of 32 (or out is negative).
    """
    if out < 0 or in_ <= 0 or in_ % GROUP_SIZE:
        raise ValueError(f"mxfp4: in features must be a positive multiple of {GROUP_SIZE}, got out={out}, in={in_}")
    return (out, in_ // 2), (out, in_ // GROUP_SIZE)


def decode(packed: Tensor, scale: Tensor, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """Dequantize MXFP4 to a dense weight, bit-exactly.

    Args:
        packed: uint8 [..., out, in/2] (`weight_packed`); byte j holds element 2j in its low nibble and
            element 2j+1 in its high nibble. Code bit 3 is the sign; bits 0-2 index the E2M1 magnitudes
            {0, 0.5, 1, 1.5, 2, 3, 4, 6} (code 8 decodes to -0.0).
        scale: uint8 [..., out, in/32] (`weight_scale`): one E8M0 biased exponent per 32 input columns.
        dtype: output dtype (default bf16).

    Returns:
        [..., out, in] in `dtype`: W[r, c] = E2M1(code[r, c]) * 2^(scale[r, c // 32] - 127), computed
        exactly in fp32 then cast (exact for bf16/fp32). Scale byte 255 is not special-cased (OCP calls it
        NaN): 2^128 is inf, so its nonzero codes give +-inf and its zero codes NaN, like compressed-tensors.
        Bytes 253-254 with large codes also overflow to inf in bf16/fp32.

    Raises:
        ValueError: non-uint8 inputs, fewer than 2 dims, mismatched leading dims, or widths that are not
            in/2 and in/32 of an `in` that is a multiple of 32.

    On CUDA tensors (unless `use_backend("torch")`) one Triton kernel (`.triton`) computes the same values.
    """
    if use_fast(packed, "mxfp4") and has_triton() and dtype in (torch.bfloat16, torch.float16, torch.float32):
        reference._check_decode_args(packed, scale)
        from kimik3.ops.mxfp4 import triton as fast  # lazily: triton exists only on GPU machines

        return fast.decode(packed, scale, dtype)
    return reference.decode(packed, scale, dtype)


def encode(w: Tensor) -> tuple[Tensor, Tensor]:
    """Quantize a dense weight to MXFP4 (OCP MX rule, round-to-nearest-even).

    Args:
        w: float [..., out, in], `in` a multiple of 32, all values finite.

    Returns:
        (packed uint8 [..., out, in/2], scale uint8 [..., out, in/32]) in the layout `decode` reads.
        Per group of 32 the shared exponent is floor(log2(amax)) - 2, biased by 127 and clamped to
        [0, 254] (an all-zero group gets byte 0); elements round to the nearest E2M1 value, ties to the
        even code, saturating at +-6; signs (including -0.0) are kept. `decode(*encode(decode(p, s)))`
        equals `decode(p, s)` bit-exactly whenever that decode is finite and exact (bf16/fp32), and
        `encode(decode(p, s)) == (p, s)` when every group's largest magnitude code is 4.0 or 6.0.

    Raises:
        ValueError: non-float input, fewer than 2 dims, `in` not a multiple of 32, or non-finite values.
    """
    return reference.encode(w)
