"""Where the routed experts live: all on the device, or in two tiers (host memory plus a device cache of slots).

    plan = plan_experts(cfg, cpu_offload_gb=...)   how many experts of each MoE layer the device keeps (bytes only)
    tier = tier_experts(model, plan.slots)          every MXFP4Experts -> TieredExperts, in place (see below)
    fill_slots(model)                               after the weights are in: the slots take the hottest experts

`cpu_offload_gb` is vLLM's name: GiB of routed experts per device kept in host memory only. Here every routed expert
of a tiered layer lies in (pinned) host memory, still MXFP4-packed, and the device keeps (total - offload) GiB of
them as a cache, the same number of slots in every MoE layer, filled and refilled by counted routing
(`kimik3.ops.moe.cache`). "auto" offloads what does not fit beside the other weights, the engine's state pools and a
workspace. The dense trunk, routers, latent projections, shared experts and attention stay on the device. A plan
whose slots hold every expert is no plan: the model runs as it does without tiering.

A routing trace (`save_trace` / `load_trace`: each layer's counted use, JSON) lets a restart fill its slots with
the experts the last run used most.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from kimik3.config import TextConfig
from kimik3.model.moe import LatentMoE, MXFP4Experts, TieredExperts
from kimik3.ops.moe.cache import ExpertCache
from kimik3.ops.moe.tiered import HostTier, empty_experts
from kimik3.ops.mxfp4 import packed_shapes

GIB = 2 ** 30
STAGING = 32  # experts per staging buffer (two buffers): a prefill wave
WORKSPACE = 4 * GIB  # what "auto" leaves free on the device for activations and kernels' scratch


@dataclass(frozen=True)
class ExpertPlan:
    """How a model's routed experts are placed (per device)."""
    moe_layers: int
    num_experts: int  # per layer, on this device (E / expert-parallel ranks)
    expert_bytes: int  # one MXFP4 expert: w1, w3, w2 codes and scales
    slots: int  # per layer on the device (num_experts: all resident)
    staging: int  # experts per staging buffer (0 when not tiered)

    @property
    def tiered(self) -> bool:
        return self.slots < self.num_experts

    @property
    def expert_total(self) -> int:
        return self.moe_layers * self.num_experts * self.expert_bytes

    @property
    def device_bytes(self) -> int:
        """Routed-expert bytes on the device: the slots and the two staging buffers."""
        return (self.moe_layers * self.slots + 2 * self.staging) * self.expert_bytes

    @property
    def host_bytes(self) -> int:
        return self.expert_total if self.tiered else 0

    @property
    def uniform_hit_rate(self) -> float:
        """The chance a routed row finds its expert in a slot when routing is uniform and the slots static."""
        return self.slots / self.num_experts


def expert_bytes(cfg: TextConfig) -> int:
    """Bytes of one MXFP4 routed expert of `cfg`."""
    m = cfg.moe
    total = 0
    for out, inp in ((m.expert_dim, m.latent_dim), (m.expert_dim, m.latent_dim), (m.latent_dim, m.expert_dim)):
        (po, pi), (so, si) = packed_shapes(out, inp)
        total += po * pi + so * si
    return total


def host_available() -> int | None:
    """Bytes of host memory available now (Linux: MemAvailable), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def plan_experts(cfg: TextConfig, cpu_offload_gb: float | str | None, *, num_experts: int | None = None,
                 free_bytes: int | None = None, other_bytes: int = 0, reserve_bytes: int = WORKSPACE,
                 host_bytes: int | None = None) -> ExpertPlan:
    """The placement `cpu_offload_gb` asks for.

    Args:
        cfg: the text config.
        cpu_offload_gb: GiB of routed experts per device kept in host memory only (the coldest: the cache decides);
            None or 0: none (every expert on the device); "auto": what does not fit in `free_bytes` after
            `other_bytes` (the rest of the weights) and `reserve_bytes` (state pools and workspace).
        num_experts: routed experts per layer on this device (default: all of them).
        host_bytes: host memory available (default: read now; None where it cannot be read: not checked).

    Raises:
        ValueError: a negative offload, more than the experts, "auto" without `free_bytes`, or a host without the
            memory for the host tier.
    """
    E = num_experts or cfg.moe.num_experts
    layers, eb = sum(cfg.moe_layers), expert_bytes(cfg)
    total = layers * E * eb
    if cpu_offload_gb is None or cpu_offload_gb == 0 or layers == 0:
        return ExpertPlan(layers, E, eb, E, 0)
    if cpu_offload_gb == "auto":
        if free_bytes is None:
            raise ValueError("cpu_offload_gb='auto' needs the device's free memory (a CUDA device)")
        offload = total - (free_bytes - other_bytes - reserve_bytes)
        if offload <= 0:
            return ExpertPlan(layers, E, eb, E, 0)
    else:
        if isinstance(cpu_offload_gb, bool) or not isinstance(cpu_offload_gb, (int, float)) \
                or not math.isfinite(cpu_offload_gb) or cpu_offload_gb < 0:
            raise ValueError(f"cpu_offload_gb must be a number of GiB >= 0 or 'auto', got {cpu_offload_gb!r}")
        offload = cpu_offload_gb * GIB
        if offload > total:
            raise ValueError(f"cpu_offload_gb {cpu_offload_gb:g} is more than the routed experts "
                             f"({total / GIB:.2f} GiB in {layers} MoE layers on this device)")
    staging = min(STAGING, E)
    slots = max(0, min(E - 1, int((total - offload - 2 * staging * eb) // (layers * eb))))
    plan = ExpertPlan(layers, E, eb, slots, staging)
    host_bytes = host_available() if host_bytes is None else host_bytes
    if host_bytes is not None and plan.host_bytes > host_bytes:
        raise ValueError(f"cpu_offload_gb: the host tier needs {plan.host_bytes / GIB:.1f} GiB of host memory "
                         f"(every routed expert, pinned), {host_bytes / GIB:.1f} GiB is available")
    return plan


def tier_experts(model: nn.Module, slots: int, device: torch.device | str, *, staging: int = STAGING,
                 misses: str = "auto") -> HostTier | None:
    """Put every MXFP4-packed routed-expert layer of `model` into two tiers, in place: its experts into host memory
    (pinned when `device` is CUDA; a layer on the meta device gets empty host tensors that a loader fills), `slots`
    cache slots per layer on `device`, and `staging` experts twice over for streamed misses. Returns the tiers'
    shared `HostTier` (None: nothing to tier). `misses`: "auto", or "host" / "copy" to force one way."""
    device = torch.device(device)
    pin = device.type == "cuda"
    tier = None
    for moe in [m for m in model.modules() if isinstance(m, LatentMoE)]:
        old = moe.experts
        if not isinstance(old, MXFP4Experts):
            continue
        packed = old.weights()
        E = packed.num_experts
        if not 0 <= slots < E:
            raise ValueError(f"tier_experts: {slots} slots per layer for {E} experts (0 <= slots < experts)")
        host = empty_experts(packed, E, torch.device("cpu"), pin)
        if packed.packed[0].device.type != "meta":
            for a, b in zip((*packed.packed, *packed.scales), (*host.packed, *host.scales)):
                b.copy_(a)
        if tier is None:
            tier = HostTier(device, [empty_experts(packed, min(staging, E), device) for _ in range(2)], misses)
        moe.experts = TieredExperts(host, empty_experts(packed, slots, device), ExpertCache(E, slots), tier)
        if getattr(old, "expert_shard", None) is not None:  # this rank's experts of an expert-parallel model
            moe.experts.expert_shard = old.expert_shard
        del old, packed
    return tier


def tier_by_budget(model: nn.Module, cfg: TextConfig, device: torch.device, cpu_offload_gb: float | str,
                   misses: str = "auto", reserve_bytes: int | None = None, num_experts: int | None = None) -> bool:
    """Put a model's routed experts (on the meta device, MXFP4-packed, as a loader builds it) into two tiers as
    `cpu_offload_gb` asks (`plan_experts`; the rest of the model's bytes and `reserve_bytes` count against "auto");
    returns whether it did (a budget that holds every expert leaves them all on the device)."""
    experts = {id(t) for m in model.modules() if isinstance(m, MXFP4Experts) for t in m.buffers()}
    other = sum(t.nbytes for t in model.state_dict().values() if id(t) not in experts)
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    plan = plan_experts(cfg, cpu_offload_gb, num_experts=num_experts, free_bytes=free, other_bytes=other,
                        reserve_bytes=WORKSPACE if reserve_bytes is None else reserve_bytes)
    if not plan.tiered:
        return False
    tier_experts(model, plan.slots, device, staging=plan.staging, misses=misses)
    return True


def tiered_layers(model: nn.Module) -> list[tuple[str, TieredExperts]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, TieredExperts)]


@torch.no_grad()
def fill_slots(model: nn.Module, trace: str | Path | None = None) -> None:
    """Copy each tiered layer's hottest experts (by its cache's counts: `trace`'s when that file exists
    (`load_trace`), else the lowest ids) into its slots."""
    if trace is not None and Path(trace).exists():
        load_trace(model, trace)
    for _, m in tiered_layers(model):
        w = m.weights()
        for s, e in enumerate(m.cache.hottest()):
            w.tier.copy(w.host, int(e), w.slots, s)
            w.cache.place(int(e), s)
        w.tier.counters["bytes_copied"] = 0  # the initial fill is loading, not traffic


def tier_stats(model: nn.Module) -> dict:
    """The tiers' counters (hits, misses, bytes_copied, host_rows), or {} for a model without tiers."""
    layers = tiered_layers(model)
    return dict(layers[0][1].tier.counters) if layers else {}


def save_trace(model: nn.Module, path: str | Path) -> None:
    """Each tiered layer's counted routing, as JSON (written atomically)."""
    data = {"kimik3": "expert-trace", "layers": {n: m.cache.state() for n, m in tiered_layers(model)}}
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def load_trace(model: nn.Module, path: str | Path) -> None:
    """Counts from `save_trace` into the tiered layers (then `fill_slots` puts the hottest in). Raises ValueError
    for a file that is not a trace of this model's layers."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable expert trace ({e})") from None
    layers = dict(tiered_layers(model))
    if not isinstance(data, dict) or data.get("kimik3") != "expert-trace" or set(data.get("layers", {})) != set(layers):
        raise ValueError(f"{path}: not an expert trace of this model's {len(layers)} tiered layers")
    for name, state in data["layers"].items():
        try:
            layers[name].cache.load_state(state)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: layer {name}: {e}") from None
