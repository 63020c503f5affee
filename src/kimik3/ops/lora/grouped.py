"""Batched LoRA as two grouped GEMMs (`torch._grouped_mm`), nothing read back on the host.

Legend: as `reference`. The N rows are sorted by adapter with the base rows (adapter -1) last, so each adapter's
rows are one contiguous run; `offs` [K] int32 holds the run ends (computed on the device). Rows past the last run
(the base rows) are outside every group: their outputs are masked to zero. Then each row is scaled by its
adapter's scale and the rows are put back in their order.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kimik3.ops.moe.grouped import expert_offsets


def lora_delta(x: Tensor, adapter: Tensor, lora_a: Tensor, lora_b: Tensor, scale: Tensor) -> Tensor:
    K = lora_a.shape[0]
    key = torch.where(adapter < 0, K, adapter)
    sorted_k, order = torch.sort(key, stable=True)
    offs = expert_offsets(sorted_k, K)
    x_NI = x[order]
    t_NR = torch._grouped_mm(x_NI, lora_a.to(x.dtype).transpose(-2, -1), offs=offs)
    y_NO = torch._grouped_mm(t_NR, lora_b.to(x.dtype).transpose(-2, -1), offs=offs)
    s_N1 = torch.cat([scale.to(x.device, torch.float32), scale.new_zeros(1).to(x.device)])[sorted_k, None]
    # the base rows' outputs were never written (possibly NaN): where, not a multiply, drops them
    y_NO = torch.where(sorted_k[:, None] < K, (y_NO.float() * s_N1).to(x.dtype), 0)
    return torch.empty_like(y_NO).index_copy_(0, order, y_NO)
