"""MXFP4 decode as one Triton kernel (GPU; Triton's interpreter in CPU tests): the same values as
`reference.decode` bit for bit, in one read of the codes and one write of the weight.

Legend: R rows (all leading dims and O flattened), P = I/2 packed bytes per row, G = I/32 scale bytes per row.
The reference makes several full-size passes (unpack, two table lookups, a multiply, a cast), which matters where
a whole layer's experts are decoded per step (LoRA training over the packed experts: `kimik3.ops.lora.experts_grouped`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kimik3.ops.triton_utils import interpreting


@triton.jit
def decode_tile(packed, scale, BR: tl.constexpr, BKH: tl.constexpr, DTYPE: tl.constexpr):
    """MXFP4 tile -> (even, odd) columns in DTYPE, through fp32 (fp16 activations; Triton's interpreter).

    packed: uint8 [BR, BKH] (byte j = columns 2j (low nibble) and 2j+1 (high nibble));
    scale:  uint8 [BR, BKH // 16] E8M0 exponents, one per 16 bytes.
    Returns two [BR, BKH] tensors: W[:, 0::2] and W[:, 1::2] of this tile, exactly as mxfp4.decode.
    """
    b = packed.to(tl.uint32)
    s = scale.to(tl.uint32)
    lo = (((b & 0x08) << 28) | ((b & 0x07) << 22)).to(tl.float32, bitcast=True)
    hi = (((b & 0x80) << 24) | ((b & 0x70) << 18)).to(tl.float32, bitcast=True)
    sc = tl.maximum(s << 23, 0x00400000).to(tl.float32, bitcast=True)  # 2^(s-127); s = 0 is subnormal
    sc = tl.reshape(tl.broadcast_to(sc[:, :, None], (BR, BKH // 16, 16)), (BR, BKH))
    two126 = tl.full((1, 1), 0x7E800000, tl.uint32).to(tl.float32, bitcast=True)
    # (subnormal E2M1 * 2^-126) * 2^126 is E2M1 exactly; times 2^(s-127) it is exact or overflows, as decode
    lo = ((lo * two126) * sc).to(DTYPE)
    hi = ((hi * two126) * sc).to(DTYPE)
    return lo, hi


@triton.jit
def decode_tile_bf16(packed, scale, BR: tl.constexpr, BKH: tl.constexpr):
    """`decode_tile` to bf16 in 3 instructions per value (GPU only: inline PTX over 4 packed bytes at a time).

    Per 32-bit word of 4 bytes b0..b3, one byte permute puts (b0, b1) in the low bytes of two 16-bit lanes and
    (b2, b3) in their high bytes; shifts and masks then move each nibble's magnitude to bits 6-8 and its sign
    to bit 15 of a lane: the bf16 subnormal E2M1 * 2^-126. Two paired bf16 multiplies, by 2^126 and by the
    group's 2^(s-127), are exact (or overflow, as the reference does).
    """
    s = scale.to(tl.uint32)
    sc = tl.maximum(s << 7, 0x0040).to(tl.uint16).to(tl.bfloat16, bitcast=True)  # 2^(s-127); s = 0: subnormal
    sc = tl.reshape(tl.broadcast_to(sc[:, :, None], (BR, BKH // 16, 16)), (BR, BKH))
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 q, m, sg, c;
        prmt.b32 q, $4, 0, 0x3120;
        mov.b32 c, 0x7E807E80;
        shl.b32 m, q, 6;
        and.b32 m, m, 0x01C001C0;
        shl.b32 sg, q, 12;
        and.b32 sg, sg, 0x80008000;
        or.b32 $0, m, sg;
        shr.b32 m, q, 2;
        and.b32 m, m, 0x01C001C0;
        shl.b32 sg, q, 4;
        and.b32 sg, sg, 0x80008000;
        or.b32 $1, m, sg;
        shl.b32 m, q, 2;
        and.b32 m, m, 0x01C001C0;
        shl.b32 sg, q, 8;
        and.b32 sg, sg, 0x80008000;
        or.b32 $2, m, sg;
        shr.b32 m, q, 6;
        and.b32 m, m, 0x01C001C0;
        and.b32 sg, q, 0x80008000;
        or.b32 $3, m, sg;
        mul.rn.bf16x2 $0, $0, c;
        mul.rn.bf16x2 $1, $1, c;
        mul.rn.bf16x2 $2, $2, c;
        mul.rn.bf16x2 $3, $3, c;
        mul.rn.bf16x2 $0, $0, $5;
        mul.rn.bf16x2 $1, $1, $6;
        mul.rn.bf16x2 $2, $2, $5;
        mul.rn.bf16x2 $3, $3, $6;
        }
        """,
        constraints="=r,=r,=r,=r,r,r,r",
        args=[packed, sc],
        dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=4,
    )



# rows x packed bytes per program (P is a multiple of 16: whole scale groups): the faster of the two measured
# (BENCHMARKS.md, "Measurements behind code choices")
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
        lo, hi = decode_tile_bf16(packed, scale, BR, BKH)
    else:
        lo, hi = decode_tile(packed, scale, BR, BKH, DTYPE)
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
