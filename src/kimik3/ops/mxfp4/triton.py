"""MXFP4 decode as one Triton kernel (GPU; Triton's interpreter in CPU tests): the same values as
`reference.decode` bit for bit, in one read of the codes and one write of the weight.

Legend: R rows (all leading dims and O flattened), P = I/2 packed bytes per row, G = I/32 scale bytes per row.
The reference makes several full-size passes (unpack, two table lookups, a multiply, a cast), which matters where
a whole layer's experts are decoded per step (LoRA training over the packed experts: `kimik3.ops.moe.lora_grouped`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kimik3.ops.moe.triton_mxfp4 import _decode, _decode_bf16
from kimik3.ops.situ.triton import interpreting

# rows x packed bytes per program (P is a multiple of 16: whole scale groups); on an H200 at K3's expert widths
# 16 x 256 decodes 2.8 GB of bf16 in 0.99 ms (3.6 TB/s moved), 16 x 128 in 1.11 ms
_BR, _BKH = 16, 256
_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _mxfp4_decode_kernel(p_ptr, s_ptr, out_ptr, R, P, BR: tl.constexpr, BKH: tl.constexpr,
                         DTYPE: tl.constexpr, PTX_BF16: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    j = tl.program_id(1) * BKH + tl.arange(0, BKH)
    g = tl.program_id(1) * (BKH // 16) + tl.arange(0, BKH // 16)
    r_mask = rows[:, None] < R
    packed = tl.load(p_ptr + rows[:, None].to(tl.int64) * P + j[None, :], mask=r_mask & (j[None, :] < P), other=0)
    scale = tl.load(s_ptr + rows[:, None].to(tl.int64) * (P // 16) + g[None, :],
                    mask=r_mask & (g[None, :] < P // 16), other=0)
    if PTX_BF16:  # exact bf16 subnormals too (a plain fp32 -> bf16 cast of them is not, under the interpreter)
        lo, hi = _decode_bf16(packed, scale, BR, BKH)
    else:
        lo, hi = _decode(packed, scale, BR, BKH, DTYPE)
    c = tl.program_id(1) * 2 * BKH + tl.arange(0, 2 * BKH)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * (2 * P) + c[None, :], tl.interleave(lo, hi),
             mask=r_mask & (c[None, :] < 2 * P))


def decode(packed: Tensor, scale: Tensor, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """`kimik3.ops.mxfp4.decode` (same contract; arguments checked there): [..., O, P] codes -> [..., O, 2P]."""
    *lead, P = packed.shape
    out = torch.empty(*lead, 2 * P, dtype=dtype, device=packed.device)
    R = packed.numel() // P if P else 0
    if R:
        grid = (triton.cdiv(R, _BR), triton.cdiv(P, _BKH))
        _mxfp4_decode_kernel[grid](packed.contiguous(), scale.contiguous(), out, R, P, BR=_BR, BKH=_BKH,
                                   DTYPE=_DTYPES[dtype], PTX_BF16=dtype == torch.bfloat16 and not interpreting())
    return out
