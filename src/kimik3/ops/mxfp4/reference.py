"""MXFP4 ("mxfp4-pack-quantized" of compressed-tensors): pure PyTorch reference codec, exact.

Legend: ... any leading dims (stacked experts), O out features, I in features (Linear convention, W is
[..., O, I]), P = I/2 packed bytes, G = I/32 groups, K = 32 elements per group.

    weight_packed  uint8 [..., O, P]: byte j holds element 2j in its LOW nibble, element 2j+1 in its HIGH.
    weight_scale   uint8 [..., O, G]: one E8M0 biased exponent s per 32 consecutive input columns.
    W[r, c] = E2M1(code[r, c]) * 2^(scale[r, c // 32] - 127)      (symmetric, no zero point)

E2M1 code: bit 3 is the sign, bits 0-2 index {0, .5, 1, 1.5, 2, 3, 4, 6}; code 8 is -0.0.
Scale byte 255 (NaN in the OCP spec) is not special-cased: the formula gives 2^128, i.e. +inf in fp32,
so its group decodes to +-inf (nonzero codes) and NaN (zero codes), as compressed-tensors does.

Decode is exact: every E2M1 value times a power of two in [2^-127, 2^127] is exact in fp32 (at worst a
subnormal, 2^-128) or overflows to inf, and has at most 2 significant bits, so the final cast only rounds
when the output dtype is narrower in range (fp16).
"""

from __future__ import annotations

import torch
from torch import Tensor

GROUP_SIZE = 32

# Built from Python floats (float64), so every entry is exact; 2^128 (s = 255) becomes inf in fp32.
_E2M1_16 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                         -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float32)
_SCALE_256 = torch.tensor([2.0 ** (s - 127) for s in range(256)], dtype=torch.float64).float()
# 1 / scale for the encoder, in float64 so that w / scale is exact for every biased exponent 0..254.
_INV_SCALE_255 = torch.tensor([2.0 ** (127 - s) for s in range(255)], dtype=torch.float64)
# Midpoints between neighbouring E2M1 magnitudes; a tie goes to the even code (round-to-nearest-even).
_MIDPOINTS_7 = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float64)


def _check_decode_args(packed: Tensor, scale: Tensor) -> None:
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(f"mxfp4: packed and scale must be uint8, got {packed.dtype} and {scale.dtype}")
    if packed.ndim < 2 or packed.shape[:-1] != scale.shape[:-1]:
        raise ValueError(f"mxfp4: packed {tuple(packed.shape)} and scale {tuple(scale.shape)} must be "
                         "[..., out, in/2] and [..., out, in/32]")
    if packed.shape[-1] % (GROUP_SIZE // 2) or packed.shape[-1] * 2 != scale.shape[-1] * GROUP_SIZE:
        raise ValueError(f"mxfp4: packed width {packed.shape[-1]} must be 16 * scale width "
                         f"{scale.shape[-1]} (in a multiple of {GROUP_SIZE})")


def decode(packed: Tensor, scale: Tensor, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    _check_decode_args(packed, scale)
    *lead, O, P = packed.shape
    # Unpack: low nibble first, so stacking (low, high) on a new last dim and flattening restores order.
    code_OP2 = torch.stack((packed & 0x0F, packed >> 4), dim=-1)
    val_OGK = _E2M1_16.to(packed.device)[code_OP2.long()].reshape(*lead, O, P * 2 // GROUP_SIZE, GROUP_SIZE)
    mult_OG1 = _SCALE_256.to(packed.device)[scale.long()].unsqueeze(-1)
    # Exact in fp32 (see the module docstring); the cast is the only rounding step.
    return (val_OGK * mult_OG1).reshape(*lead, O, P * 2).to(dtype)


def encode(w: Tensor) -> tuple[Tensor, Tensor]:
    """Quantize W [..., O, I] to (packed [..., O, I/2], scale [..., O, I/32]) following the OCP MX spec.

    Per group of 32: shared exponent e = floor(log2(amax)) - 2 (2 = E2M1's largest exponent), so amax / 2^e
    lands in [4, 8); biased byte = e + 127 clamped to [0, 254]. Elements are w / 2^e rounded to nearest
    E2M1 magnitude, ties to the even code, and saturated at 6 (values in (6, 8) clip, as the spec allows;
    compressed-tensors' observer instead bumps the exponent when amax would round past 6, so for such
    groups the two encoders differ). An all-zero group gets byte 0. The sign bit is copied from w, so -0.0
    and small negatives that round to zero become code 8. Exact inverse of ``decode`` whenever each group's
    largest magnitude code is 4.0 or 6.0 (the canonical encoding). Non-finite inputs raise ValueError.
    """
    if not w.is_floating_point() or w.ndim < 2 or w.shape[-1] % GROUP_SIZE:
        raise ValueError(f"mxfp4: encode needs a float tensor [..., out, in] with in a multiple of "
                         f"{GROUP_SIZE}, got {w.dtype} {tuple(w.shape)}")
    if not torch.isfinite(w).all():
        raise ValueError("mxfp4: encode got a non-finite value")
    *lead, O, I = w.shape
    # float64 holds every input dtype exactly and w / 2^e never under/overflows for e in [-127, 127].
    w_OGK = w.double().reshape(*lead, O, I // GROUP_SIZE, GROUP_SIZE)
    amax_OG = w_OGK.abs().amax(-1)
    # frexp is exact (log2 can round up just below a power of two): amax = m * 2^E, m in [0.5, 1),
    # so floor(log2(amax)) = E - 1 and the biased byte is (E - 1) - 2 + 127.
    biased_OG = (torch.frexp(amax_OG).exponent.long() + 124).clamp(0, 254)
    biased_OG = torch.where(amax_OG == 0, 0, biased_OG)
    mag_OGK = w_OGK.abs() * _INV_SCALE_255.to(w.device)[biased_OG].unsqueeze(-1)
    # Count midpoints below |x| (ties down) and at-or-below |x| (ties up); they differ only on a tie,
    # where the even one of the two neighbouring codes is the round-to-nearest-even answer.
    mids = _MIDPOINTS_7.to(w.device)
    below = torch.bucketize(mag_OGK, mids, right=False)
    at_or_below = torch.bucketize(mag_OGK, mids, right=True)
    code_OGK = torch.where(below % 2 == 0, below, at_or_below)  # 7 midpoints: saturates at code 7 (6.0)
    code_OGK = code_OGK | (torch.signbit(w_OGK).long() << 3)
    code_OP2 = code_OGK.reshape(*lead, O, I // 2, 2).to(torch.uint8)
    packed = code_OP2[..., 0] | (code_OP2[..., 1] << 4)
    return packed, biased_OG.to(torch.uint8)
