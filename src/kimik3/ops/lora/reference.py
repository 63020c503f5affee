"""Batched LoRA: each row of a batch through its own adapter's factors (the reference: a loop over adapters).

Legend: N rows, I in features, O out features, K adapters, R rank (the largest of the K; smaller ranks are
zero-padded, which adds exact zeros).

    y[n] = scale[k] * (x[n] A_k^T) B_k^T     k = adapter[n]
    y[n] = 0                                 adapter[n] == -1 (the base alone)

Each adapter's rows are gathered, go through two matmuls in x.dtype (as `kimik3.lora.LoraLinear` computes its
update) and are written back; the loop reads each adapter's row count on the host.
"""

from __future__ import annotations

import torch
from torch import Tensor


def lora_delta(x: Tensor, adapter: Tensor, lora_a: Tensor, lora_b: Tensor, scale: Tensor) -> Tensor:
    out = torch.zeros(x.shape[0], lora_b.shape[1], dtype=x.dtype, device=x.device)
    for k, s in enumerate(scale.tolist()):
        rows = (adapter == k).nonzero()[:, 0]
        if rows.numel() == 0:
            continue
        a, b = lora_a[k].to(x.dtype), lora_b[k].to(x.dtype)
        out[rows] = ((x[rows] @ a.T) @ b.T) * s
    return out
