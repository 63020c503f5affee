"""Packed ("varlen") sequences: several documents in one row, delimited by `cu_seqlens`.

`cu_seqlens` is a 1-D integer tensor [N+1] of cumulative lengths (0 first, total tokens last), as in
flash-attention and fla. No token of one document may see a token of another.
"""

from __future__ import annotations

import torch
from torch import Tensor


def check_cu_seqlens(cu_seqlens: Tensor, total: int, batch: int) -> None:
    """Raise ValueError unless `cu_seqlens` describes `total` packed tokens in a batch of one row."""
    if batch != 1:
        raise ValueError(f"cu_seqlens needs a batch of one packed row, got batch size {batch}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
        raise ValueError(f"cu_seqlens must be a 1-D integer tensor [N+1], got shape {tuple(cu_seqlens.shape)}")
    if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != total or bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
        raise ValueError(f"cu_seqlens must rise from 0 to the packed length {total}, got {cu_seqlens.tolist()}")


def sequence_ids(cu_seqlens: Tensor, total: int) -> Tensor:
    """[total] int64: the index of the document each packed token belongs to."""
    t = torch.arange(total, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens.to(t.dtype), t, right=True) - 1


def positions(cu_seqlens: Tensor | None, total: int, device: torch.device) -> Tensor:
    """[total] int64: each token's position inside its own document (0 at every document start)."""
    t = torch.arange(total, device=device)
    if cu_seqlens is None:
        return t
    starts = cu_seqlens.to(device=device, dtype=t.dtype)
    return t - starts[sequence_ids(starts, total)]
