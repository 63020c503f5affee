"""Routed experts between compressed-tensors MXFP4 (`weight_packed` + `weight_scale`) and ggml's MXFP4 blocks.

Both hold the same E2M1 codes and E8M0 scale bytes (value = E2M1(code) * 2^(scale - 127); ggml doubles the code
table and halves the scale, the same numbers), so the move is a byte permutation, never a decode:

    compressed-tensors  packed [..., out, in/2]: byte j = code 2j (low nibble) | code 2j+1 (high nibble)
                        scale  [..., out, in/32]: one byte per 32 input columns
    ggml (type 39)      [..., out, in/32 * 17]: per 32 columns one block = scale byte, then 16 bytes where byte j
                        = code j (low nibble) | code j+16 (high nibble)

Legend: E experts, O out features, G groups of 32 input columns.
"""

from __future__ import annotations

import torch
from torch import Tensor

BLOCK_BYTES = 17  # one scale byte + 16 bytes of 32 four-bit codes


def to_ggml(packed: Tensor, scale: Tensor) -> Tensor:
    """uint8 packed [..., O, 16G] + scale [..., O, G] -> ggml MXFP4 blocks uint8 [..., O, 17G]."""
    *lead, G = scale.shape
    pairs = packed.reshape(*lead, G, 16)
    codes = torch.stack([pairs & 0x0F, pairs >> 4], dim=-1).reshape(*lead, G, 32)  # code c at position c
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    return torch.cat([scale.unsqueeze(-1), qs], dim=-1).reshape(*lead, G * BLOCK_BYTES)


def from_ggml(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """ggml MXFP4 blocks uint8 [..., O, 17G] -> (packed [..., O, 16G], scale [..., O, G]), the inverse of to_ggml."""
    *lead, nbytes = blocks.shape
    b = blocks.reshape(*lead, nbytes // BLOCK_BYTES, BLOCK_BYTES)
    scale, qs = b[..., 0], b[..., 1:]
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # code c at position c
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.reshape(*lead, -1).contiguous(), scale.contiguous()
