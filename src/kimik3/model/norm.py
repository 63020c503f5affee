"""RMSNorms of the text model.

Legend: D normalized width (any leading dims).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kimik3.ops.rmsnorm import gated_rms_norm, rms_norm


class RMSNorm(nn.Module):
    """`KimiRMSNorm`: normalize in fp32, cast back to the input dtype, THEN multiply by the weight.

    The gain multiplies after the downcast (in bf16 for a bf16 model), as the reference does.
    """

    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


class GatedRMSNorm(nn.Module):
    """KDA's output norm (`FusedRMSNormGated`, sigmoid): rms(o) * weight * sigmoid(gate), all in fp32.

    The weight is an fp32 island; the result is cast to `o.dtype`.
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, o: Tensor, gate: Tensor) -> Tensor:
        return gated_rms_norm(o, gate, self.weight, self.eps)
