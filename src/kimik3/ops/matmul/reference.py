"""The reference of `kimik3.ops.matmul.matmul`: the product in fp32, rounded once to the output dtype.

Legend: B batch, M rows, K the summed dim, N columns.
"""

from __future__ import annotations

import torch
from torch import Tensor


def matmul(a: Tensor, b: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
    """a [M, K] @ b [K, N] (or a [B, M, K] @ b [B, K, N]), summed in fp32, in `out_dtype` (default a's dtype)."""
    return (a.float() @ b.float()).to(out_dtype or a.dtype)
