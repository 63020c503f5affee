"""Put an adapter on a built model: replace each targeted Linear / routed-experts module, freeze everything else.

    model = kimik3.load(path, dtype=torch.float32, keep_experts_packed=True)
    lora.apply(model, LoraConfig(rank=8, targets=["*.self_attn.q_proj", "*.block_sparse_moe.experts"]))

Targets are matched against released module names (`language_model.model.layers.3.self_attn.q_proj`), also
when the model is the text-only `K3ForCausalLM`. Routed experts must be MXFP4-packed (`MXFP4Experts`): they stay
packed and frozen. Every base parameter is frozen (routers included; their correction bias is a buffer that only
balancing moves, and a LoRA run does not balance).
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase

from torch import nn

from kimik3.lora.config import SHARING, LoraConfig
from kimik3.lora.layers import LoraExperts, LoraLinear
from kimik3.model import K3ForCausalLM
from kimik3.model.moe import Experts, LatentMoE, MXFP4Experts

# modules whose weight is read directly, past any module forward, so an update there would train nothing
UNSUPPORTED = {"lm_head": "the chunked training loss reads lm_head.weight directly",
               **dict.fromkeys(("self_attention_res_proj", "mlp_res_proj", "output_attn_res_proj"),
                               "AttnRes reads its [1, hidden] pseudo-query weight directly (train it in full)")}


def released_prefix(model: nn.Module) -> str:
    """What to put before `model`'s module names to get the released ones ("" for K3ForConditionalGeneration)."""
    return "language_model." if isinstance(model, K3ForCausalLM) else ""


def lora_modules(model: nn.Module) -> dict[str, LoraLinear | LoraExperts]:
    """{released module name: LoRA module} in module order."""
    prefix = released_prefix(model)
    return {prefix + n: m for n, m in model.named_modules() if isinstance(m, (LoraLinear, LoraExperts))}


def _top_k(model: nn.Module) -> int:
    moe = next((m for m in model.modules() if isinstance(m, LatentMoE)), None)
    return moe.gate.top_k if moe is not None else 1


def apply(model: nn.Module, cfg: LoraConfig) -> nn.Module:
    """Freeze `model` and replace every module a `cfg.targets` pattern names by its LoRA version (in place).

    Returns `model`, with `model.lora_config = cfg`.

    Raises:
        ValueError: a pattern that names no Linear or routed experts, names `lm_head`, or names dense (unpacked)
            experts; a model that already has an adapter.
    """
    if lora_modules(model):
        raise ValueError("lora.apply: the model already has an adapter (merge or reload it first)")
    prefix = released_prefix(model)
    for p in model.parameters():
        p.requires_grad_(False)
    expert_rank = cfg.expert_rank(_top_k(model))
    hits = {t: 0 for t in cfg.targets}
    for name, module in list(model.named_modules()):
        if not isinstance(module, (nn.Linear, Experts, MXFP4Experts)):
            continue
        released = prefix + name
        matched = [t for t in cfg.targets if fnmatchcase(released, t)]
        if not matched:
            continue
        for t in matched:
            hits[t] += 1
        if name.split(".")[-1] in UNSUPPORTED:
            raise ValueError(f"lora.targets: {matched[0]!r} names {released}, which LoRA does not support here "
                             f"({UNSUPPORTED[name.split('.')[-1]]})")
        if isinstance(module, Experts):
            raise ValueError(f"lora.targets: {matched[0]!r} names the routed experts {released}, which are dense; "
                             "LoRA keeps them MXFP4-packed: load the base with keep_experts_packed=True")
        if isinstance(module, MXFP4Experts):
            new = LoraExperts(module, expert_rank, cfg.alpha / expert_rank, SHARING[cfg.experts])
        else:
            new = LoraLinear(module, cfg.rank, cfg.alpha / cfg.rank, cfg.dropout)
        new.lora_target = matched[0]
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    missing = [t for t, n in hits.items() if n == 0]
    if missing:
        raise ValueError(f"lora.targets: {missing[0]!r} matches no Linear or routed experts of the model (names "
                         f"look like {prefix}model.layers.1.self_attn.q_proj or ...block_sparse_moe.experts)")
    model.lora_config = cfg
    return model


@dataclass
class TargetSize:
    target: str
    modules: int
    params: int
    bytes: int


def adapter_size(model: nn.Module) -> list[TargetSize]:
    """Parameters and bytes of the adapter, per target pattern (in `lora_config.targets` order)."""
    rows: dict[str, TargetSize] = {}
    for m in lora_modules(model).values():
        row = rows.setdefault(m.lora_target, TargetSize(m.lora_target, 0, 0, 0))
        row.modules += 1
        for p in m.parameters():
            if p.requires_grad:
                row.params += p.numel()
                row.bytes += p.numel() * p.element_size()
    order = getattr(model, "lora_config", None)
    order = order.targets if order is not None else list(rows)
    return [rows[t] for t in order if t in rows]


def format_adapter_size(model: nn.Module) -> str:
    """The adapter's size as a few lines: total parameters and bytes, then each target's share."""
    rows = adapter_size(model)
    total = sum(r.params for r in rows)
    nbytes = sum(r.bytes for r in rows)
    base = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    base += sum(2 * b.numel() for n, b in model.named_buffers() if n.endswith("_packed"))  # two weights a byte
    lines = [f"LoRA adapter: {total:,} parameters, {nbytes / 2**20:.2f} MiB "
             f"({100 * total / max(base, 1):.2f}% of the frozen base's {base:,} weights)"]
    for r in rows:
        lines.append(f"  {r.target:<40} {r.modules:>5} modules {r.params:>12,} params {r.bytes / 2**20:>9.2f} MiB "
                     f"{100 * r.params / max(total, 1):>6.1f}%")
    return "\n".join(lines)
