"""KDA's gated output norm through fla-core's fused kernel (`rms_norm_gated`, sigmoid gate): one kernel each way,
fp32 inside, the output in o's dtype; the contract of `.reference.gated_rms_norm`. It is the kernel the released
model's own code (fla's `FusedRMSNormGated`) runs."""

from __future__ import annotations

from torch import Tensor

from kimik3.ops.fla_modules import fla_module


def gated_rms_norm(o: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    rms_norm_gated = fla_module("fla.modules.norm.fused_norm_gate").rms_norm_gated

    return rms_norm_gated(o, gate, weight, None, activation="sigmoid", eps=eps)
