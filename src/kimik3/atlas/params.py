"""Exact parameter accounting of a built model (meta device is fine: only shapes are read).

Every state-dict tensor counts at its stored length (so `A_log` counts 128, not the 96 used), including the
router correction biases (buffers). Routed experts count logically (an MXFP4 byte holds two values; scales
are not parameters). Active-per-token counts the routed experts at top_k / num_experts.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from torch import nn

COMPONENTS = (
    "embedding", "lm_head", "KDA", "MLA", "dense MLP", "router", "routed experts", "shared expert",
    "latent projections", "norms and AttnRes vectors", "vision tower", "mm projector",
)

_LAYER = re.compile(r"\.layers\.(\d+)\.")
_RULES = (
    (re.compile(r"embed_tokens\."), "embedding"),
    (re.compile(r"(^|\.)lm_head\."), "lm_head"),
    (re.compile(r"^vision_tower\."), "vision tower"),
    (re.compile(r"^mm_projector\."), "mm projector"),
    (re.compile(r"\.block_sparse_moe\.experts\."), "routed experts"),
    (re.compile(r"\.block_sparse_moe\.gate\."), "router"),
    (re.compile(r"\.shared_experts\."), "shared expert"),
    (re.compile(r"\.routed_expert_(down|up)_proj\."), "latent projections"),
    (re.compile(r"\.mlp\."), "dense MLP"),
    (re.compile(r"\.self_attn\."), "attention"),
)


@dataclass
class ComponentCount:
    name: str
    instances: int = 0
    total: int = 0
    active: int = 0
    per_instance: int | None = None  # None when instances differ in size


@dataclass
class ParamReport:
    components: list[ComponentCount]
    total: int
    active: int  # per token, excluding the embedding, including the LM head (the model card's convention)
    active_with_embedding: int
    active_without_head: int
    text_total: int = 0  # all but the vision tower and mm projector (the table's "text model" row)

    def to_json(self) -> dict:
        return asdict(self)


def _component(name: str, layer_types: tuple[str, ...]) -> str:
    for pattern, comp in _RULES:
        if pattern.search(name):
            if comp == "attention":
                return layer_types[int(_LAYER.search(name).group(1))].upper()
            return comp
    return "norms and AttnRes vectors"


def _text_config(model: nn.Module):
    lm = model.language_model if hasattr(model, "language_model") else model
    return lm.config


def count_parameters(model: nn.Module) -> ParamReport:
    """Count every state-dict tensor of `model` (K3ForCausalLM or K3ForConditionalGeneration) by component."""
    cfg = _text_config(model)
    top_k, num_experts = cfg.moe.num_experts_per_token, cfg.moe.num_experts
    # component -> instance key -> [params per instance, number of instances]
    sizes: dict[str, dict[str, list[int]]] = {c: {} for c in COMPONENTS}
    for name, t in model.state_dict(keep_vars=True).items():
        comp = _component(name, cfg.layer_types)
        m = _LAYER.search(name)
        key = m.group(1) if m else name.split(".")[0]
        # stacked experts [E, out, in] are E instances (one per expert of the layer); a packed MXFP4 byte
        # holds two parameters and scale bytes hold none
        n = t.shape[0] if comp == "routed experts" else 1
        per_byte = 2 if name.endswith("_packed") else 0 if name.endswith("_scale") else 1
        entry = sizes[comp].setdefault(key, [0, n])
        entry[0] += t.numel() // n * per_byte
    comps = []
    for comp, per in sizes.items():
        if not per:
            continue
        total = sum(size * n for size, n in per.values())
        active = total * top_k // num_experts if comp == "routed experts" else total
        distinct = {size for size, _ in per.values()}
        count = sum(n for _, n in per.values())
        comps.append(ComponentCount(comp, count, total, active, distinct.pop() if len(distinct) == 1 else None))
    by = {c.name: c for c in comps}
    vision = sum(by[c].total for c in ("vision tower", "mm projector") if c in by)
    total = sum(c.total for c in comps)
    active_all = sum(c.active for c in comps) - vision
    emb = by["embedding"].total
    return ParamReport(comps, total, active_all - emb, active_all, active_all - emb - by["lm_head"].total,
                       text_total=total - vision)


def format_report(report: ParamReport, title: str = "parameters"):
    """A rich Table of the report (the CLI prints it)."""
    from rich.table import Table

    table = Table(title=title)
    for col, just in (("component", "left"), ("instances", "right"), ("per instance", "right"),
                      ("total", "right"), ("active / token", "right")):
        table.add_column(col, justify=just, no_wrap=True)
    vision = 0
    for c in report.components:
        per = f"{c.per_instance:,}" if c.per_instance is not None else "varies"
        is_vision = c.name in ("vision tower", "mm projector")  # runs per image, not per text token
        vision += c.total if is_vision else 0
        table.add_row(c.name, f"{c.instances:,}", per, f"{c.total:,}", "" if is_vision else f"{c.active:,}")
    table.add_section()
    if vision:
        table.add_row("text model", "", "", f"{report.total - vision:,}", "")
    table.add_row("total", "", "", f"{report.total:,}", "")
    table.add_row("active (card: no embedding)", "", "", "", f"{report.active:,}")
    table.add_row("active with embedding", "", "", "", f"{report.active_with_embedding:,}")
    table.add_row("active, no embedding/head", "", "", "", f"{report.active_without_head:,}")
    return table
