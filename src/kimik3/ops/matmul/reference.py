"""The reference of `kimik3.ops.matmul.matmul`: the product in fp32, rounded once to the output dtype, each row
summed alike at any row count (`kimik3.ops.rows.in_row_groups`: MKL's fp32 GEMM changes a row's sums with the row
count).

Legend: B batch, M rows, K the summed dim, N columns.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kimik3.ops.rows import in_row_groups


def matmul(a: Tensor, b: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
    """a [M, K] @ b [K, N] (or a [B, M, K] @ b [B, K, N]), summed in fp32, in `out_dtype` (default a's dtype)."""
    b32 = b.float()
    if a.dim() == 2:
        out = in_row_groups(lambda x: x.float() @ b32, a)
    else:  # the rows (dim 1) grouped: [M, B, K] through the groups, each group a batched product
        out = in_row_groups(lambda x: (x.float().transpose(0, 1) @ b32).transpose(0, 1), a.transpose(0, 1))
        out = out.transpose(0, 1)
    return out.to(out_dtype or a.dtype)
