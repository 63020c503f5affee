"""Triton helpers shared by the kernel files of `kimik3.ops`: `interpreting`, which each launcher passes on as its
kernels' INTERPRET flag, and `round_to`, the fp32 -> compute-dtype rounding those kernels store with."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["interpreting", "round_to"]


def interpreting() -> bool:
    """Whether the kernels run under Triton's interpreter (CPU tests): `round_to` and the fp32 casts before
    `tl.dot` take their interpreter forms then."""
    return bool(triton.knobs.runtime.interpret)


@triton.jit
def round_to(x, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 -> DTYPE, round to nearest even. Triton's interpreter truncates fp32 -> bf16, so there the
    rounding is done on the bits (finite values)."""
    if INTERPRET and DTYPE == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        return b.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(DTYPE)
