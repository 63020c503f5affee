"""Vision attention through `F.scaled_dot_product_attention`, one call per image (no mask).

Without a mask SDPA can take its flash kernel on GPU; a block-diagonal mask over all packed tokens would cost
T^2 memory (T reaches 65,536 patches for one large image) and force the slower masked kernels.
Legend: T packed tokens (all images), H heads, K head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kimik3.ops.vision_attn.reference import check_inputs


def vision_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, *, scale: float) -> Tensor:
    bounds = check_inputs(q, k, v, cu_seqlens)
    out = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        # [1, H, T, K]: SDPA's fused (flash / cuDNN / efficient) kernels take only 4-D inputs; with 3-D ones it
        # silently runs the math kernel, many times slower (BENCHMARKS.md, "Measurements behind code choices")
        q_1HTK, k_1HTK, v_1HTK = (x[None, start:end].transpose(1, 2) for x in (q, k, v))
        o_1HTK = F.scaled_dot_product_attention(q_1HTK, k_1HTK, v_1HTK, scale=scale)
        out.append(o_1HTK[0].transpose(0, 1))
    return torch.cat(out) if out else q.new_empty(q.shape)
