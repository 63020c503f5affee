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


@dataclass
class TierPlan:
    """Where K3's bytes go on `gpus` devices of `gpu_bytes` with `host_bytes` of host memory, and what decode can
    reach: the dense trunk and the state split over the devices (tensor parallel), the routed experts split over
    them (expert parallel), each device caching what its budget holds (`kimik3.placement.plan_experts`)."""
    gpus: int
    batch: int
    context: int
    trunk: int  # per device: every weight but the routed experts
    state: int  # per device: KDA state and MLA cache of `batch` sequences of `context` tokens
    workspace: int
    plan: object  # kimik3.placement.ExpertPlan, per device
    host_needed: int  # all devices' host tiers
    host_bytes: int
    missed_bytes: float  # per decode step and device, expected under uniform routing
    hbm_seconds: float  # per decode step: what a device reads from its memory
    miss_seconds: float  # per decode step: the misses copied or computed on the host, the faster (per device)

    @property
    def tokens_per_s(self) -> float:
        return self.batch / (self.hbm_seconds + self.miss_seconds)


def tier_plan(cfg: K3Config, gpus: int, gpu_bytes: int, host_bytes: int, context: int, batch: int,
              link_bytes_per_s: float, host_read_bytes_per_s: float, host_kernel_bytes_per_s: float,
              hbm_bytes_per_s: float) -> TierPlan:
    """The placement `kimik3 memory --gpus ...` prints (see `TierPlan`). Rates: one device's host->device copy
    rate, the host memory's read rate (shared by the devices' copies and the host kernel), the host kernel's rate
    over all the host's cores, one device's memory read rate.

    Raises:
        ValueError: bad counts, or devices too small for the trunk and state (nothing left for experts).
    """
    from kimik3.placement import WORKSPACE, expert_bytes, plan_experts

    if gpus < 1 or gpu_bytes <= 0 or host_bytes < 0:
        raise ValueError(f"need gpus >= 1 and gpu memory > 0 (got {gpus} and {gpu_bytes / 2**30:g} GiB)")
    r = memory_report(cfg, context, batch)
    m, t = cfg.text.moe, cfg.text
    layers, eb = sum(t.moe_layers), expert_bytes(t)
    if m.num_experts % gpus:
        raise ValueError(f"{m.num_experts} experts do not split over {gpus} devices")
    local = m.num_experts // gpus
    trunk = (r.weights - layers * m.num_experts * eb) // gpus
    state = (r.kda_state + r.mla_cache) // gpus
    free = gpu_bytes - trunk - state - WORKSPACE
    if free <= 0:
        raise ValueError(f"{gpus} x {gpu_bytes / 2**30:g} GiB: the trunk ({trunk / 2**30:.1f} GiB a device) and the "
                         f"state ({state / 2**30:.1f} GiB) leave no room for experts")
    plan = plan_experts(t, "auto", num_experts=local, free_bytes=gpu_bytes, other_bytes=trunk + state,
                        host_bytes=host_bytes // gpus)
    touched = local * (1 - (1 - m.num_experts_per_token / m.num_experts) ** batch)  # distinct a layer and step
    missed = layers * touched * (1 - plan.slots / local) * eb
    copy = min(link_bytes_per_s, host_read_bytes_per_s / gpus)  # a copy reads host memory too
    compute = min(host_kernel_bytes_per_s, host_read_bytes_per_s) / gpus  # the host's cores, shared by the devices
    rate = max(copy, compute)
    resident_read = trunk + layers * touched * (plan.slots / local) * eb + state
    return TierPlan(gpus, batch, context, trunk, state, WORKSPACE, plan, gpus * plan.host_bytes, host_bytes,
                    missed, resident_read / hbm_bytes_per_s, missed / rate)
