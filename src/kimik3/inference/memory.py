"""Memory accounting for serving: weights, KDA state and MLA latent cache, from shapes alone (meta device)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kimik3.config import K3Config
from kimik3.model import K3ForConditionalGeneration
from kimik3.model.cache import state_bytes
from kimik3.quant import pack_experts


@dataclass
class MemoryReport:
    weights: int  # bytes of every state-dict tensor (routed experts MXFP4-packed when the config says so)
    kda_state_per_sequence: int  # fp32 recurrent state + short-conv tails, all KDA layers
    mla_bytes_per_token: int  # 576-wide latent rows, all MLA layers
    batch: int
    context: int

    @property
    def kda_state(self) -> int:
        return self.kda_state_per_sequence * self.batch

    @property
    def mla_cache(self) -> int:
        return self.mla_bytes_per_token * self.batch * self.context

    @property
    def total(self) -> int:
        return self.weights + self.kda_state + self.mla_cache


def memory_report(cfg: K3Config, context: int, batch: int, dtype: torch.dtype | None = None) -> MemoryReport:
    """Bytes needed to serve `batch` sequences of `context` tokens (weights in the checkpoint's format)."""
    if context < 1 or batch < 1:
        raise ValueError(f"context and batch must be >= 1, got {context} and {batch}")
    with torch.device("meta"):
        model = K3ForConditionalGeneration(cfg, dtype)
        if cfg.storage.experts == "mxfp4":
            pack_experts(model)
        one = state_bytes(cfg.text, model.language_model.lm_head.weight.dtype)
    weights = sum(t.nbytes for t in model.state_dict().values())
    return MemoryReport(weights, one["kda_state_per_sequence"] + one["kda_conv_per_sequence"],
                        one["mla_latent_per_token"], batch, context)
