"""RMSNorm as K3 computes it (`KimiRMSNorm`). Reference.

Legend: D normalized width (any leading dims).

    n = x * rsqrt(mean_D(x^2) + eps)     in fp32
    y = weight * n.to(x.dtype)           the gain multiplies AFTER the downcast (in bf16 for a bf16 model)
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    # torch's rms_norm: the same arithmetic as the written-out form on the CPU (equal there bit for bit)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def gated_rms_norm(o: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """KDA's output norm: rms(o) * weight * sigmoid(gate), all in fp32, cast to o's dtype."""
    y = F.rms_norm(o.float(), (o.shape[-1],), weight.float(), eps) * gate.float().sigmoid()
    return y.to(o.dtype)
