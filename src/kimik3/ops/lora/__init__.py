"""Batched LoRA for serving many adapters in one batch: one public function, `lora_delta`.

CUDA bf16 tensors (unless `kimik3.ops.backend.use_backend("torch")`) take `.grouped` (two `torch._grouped_mm`,
no host sync); everything else runs `.reference` (a loop over adapters).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kimik3.ops.backend import use_fast
from kimik3.ops.lora import reference

__all__ = ["lora_delta"]


def lora_delta(x: Tensor, adapter: Tensor, lora_a: Tensor, lora_b: Tensor, scale: Tensor) -> Tensor:
    """The LoRA update of each row under its own adapter; the base GEMM (shared by every row) is the caller's.

    Args:
        x: [N, I] rows (compute dtype).
        adapter: [N] int64 adapter of each row, -1 for none.
        lora_a: [K, R, I], lora_b: [K, O, R] the K adapters' factors (cast to x.dtype; a smaller rank is
            zero-padded to R).
        scale: [K] fp32 each adapter's alpha / rank.

    Returns:
        [N, O] in x.dtype: scale[k] * (x A_k^T) B_k^T for a row of adapter k, exactly 0 for a row of none.
    """
    if use_fast(x) and x.dtype == torch.bfloat16:
        from kimik3.ops.lora import grouped

        return grouped.lora_delta(x, adapter, lora_a, lora_b, scale)
    return reference.lora_delta(x, adapter, lora_a, lora_b, scale)
