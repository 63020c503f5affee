"""Exact per-component accounting of a built model (meta device): rows per instance, instances, stored dtypes.

The convention is `params.py`'s: every state-dict tensor at its stored length (A_log counts its stored 128),
buffers included (the router's correction bias), routed experts one instance per expert, counted as logical
values (an MXFP4 byte holds two; E8M0 scales are not parameters). Dtypes and bytes come from the checkpoint
layout (`checkpoint_specs`), so MXFP4 codes and scales and the fp32 islands show per tensor.
"""

from __future__ import annotations

import re
from collections import Counter
from itertools import islice

from torch import nn

from kimik3.atlas.catalog import Component, leaf_of
from kimik3.checkpoint.keys import TensorSpec, checkpoint_prefix, expert_specs, is_stacked_expert

_DTYPE = {"torch.bfloat16": "bf16", "torch.float32": "fp32", "torch.uint8": "uint8", "torch.float16": "fp16"}


def _dt(dtype) -> str:
    return _DTYPE.get(str(dtype), str(dtype).removeprefix("torch."))


def _relative(name: str, comp: Component) -> str:
    """The tensor's name inside its component (`...layers.5.self_attn.q_proj.weight` -> `q_proj.weight`); for
    a component made of several modules, from the owner's attribute on (`self_attention_res_norm.weight`)."""
    if len(comp.owner_attrs) > 1:
        for attr in comp.owner_attrs:
            if f".{attr}." in name:
                return name[name.index(f".{attr}.") + 1:]
    return name[re.match(comp.pattern, name).end():]


def stored_layout(model: nn.Module, experts: str) -> dict[str, tuple[list[TensorSpec], int]]:
    """Our state-dict name -> (the checkpoint tensors storing one instance, number of instances).

    The same layout as `checkpoint_specs` without listing every expert: a stacked expert tensor [E, ...] is
    stored as E copies of expert 0's tensors (codes + scales for MXFP4). A packed model's `_scale` buffers
    map to nothing (their tensors are listed with the `_packed` partner)."""
    prefix = checkpoint_prefix(model)
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():
        full = prefix + name
        if not is_stacked_expert(full):
            out[name] = ([TensorSpec(full, tuple(t.shape), t.dtype)], 1)
        elif not full.endswith("_scale"):
            first = list(islice(expert_specs(full, tuple(t.shape), t.dtype, experts), 2 if experts == "mxfp4" else 1))
            out[name] = (first, t.shape[0])
    return out


def account(model: nn.Module, comps: list[Component], experts: str = "mxfp4") -> dict[str, dict]:
    """leaf id -> {rows, per_instance, instances, total, stored tensors/bytes, dtypes} for a built model.

    `experts` is the checkpoint layout of the routed experts ("mxfp4" for the released one, "bf16")."""
    cfg = (model.language_model if hasattr(model, "language_model") else model).config
    prefix = checkpoint_prefix(model)
    layout = stored_layout(model, experts)
    leaves: dict[str, dict] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        full = prefix + name
        cid, inst = leaf_of(full, comps, cfg.layer_types)
        comp = next(c for c in comps if c.id == cid)
        stacked = is_stacked_expert(full)
        leaf = leaves.setdefault(cid, {"instances": {}, "rows": {}, "tensors": 0, "bytes": 0, "dtypes": Counter()})
        rel = _relative(full, comp)
        shape = tuple(t.shape[1:]) if stacked else tuple(t.shape)
        per_byte = 2 if name.endswith("_packed") else 0 if name.endswith("_scale") else 1
        count = (t.numel() // (t.shape[0] if stacked else 1)) * per_byte
        n = t.shape[0] if stacked else 1
        if name.endswith("_scale"):  # counted with its packed partner (same stored tensors, no parameters)
            continue
        stored, copies = layout[name]
        for s in stored:
            leaf["tensors"] += copies
            leaf["bytes"] += _numel(s.shape) * s.dtype.itemsize * copies
            leaf["dtypes"][_dt(s.dtype)] += copies
        leaf["instances"][inst] = n  # inst: the layer or block index; None for a one-off component
        if rel in leaf["rows"] and leaf["rows"][rel]["count"] != count:
            raise ValueError(f"{cid}: tensor {rel} differs in size between instances")
        first = stored  # expert 0's codes + scales, or the one tensor
        leaf["rows"].setdefault(rel, {
            "tensor": rel.removesuffix("_packed"), "count": count, "dtype": _dt(t.dtype), "per_expert": stacked,
            "shape": list(shape) if per_byte != 2 else [shape[0], shape[1] * 2],
            "stored_as": " + ".join(f"{_dt(s.dtype)} [{' x '.join(map(str, s.shape))}]" for s in first),
        })
    out = {}
    for cid, leaf in leaves.items():
        rows = list(leaf["rows"].values())
        per_instance = sum(r["count"] for r in rows)
        layers = sorted(k for k in leaf["instances"] if k is not None)
        stored = sum(leaf["instances"].values())
        out[cid] = {
            "rows": rows, "per_instance": per_instance, "instances_stored": stored,
            "instance_keys": layers,
            "experts_per_layer": next(iter(leaf["instances"].values())) if rows and rows[0]["per_expert"] else None,
            "total": per_instance * stored, "tensors_stored": leaf["tensors"], "bytes_stored": leaf["bytes"],
            "dtypes_stored": dict(sorted(leaf["dtypes"].items())),
        }
    return out


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def census(model: nn.Module, experts: str = "mxfp4") -> dict:
    """The checkpoint layout in numbers: tensors, tensors by dtype, bytes."""
    by_dtype: Counter = Counter()
    total_bytes = 0
    for stored, copies in stored_layout(model, experts).values():
        for s in stored:
            by_dtype[_dt(s.dtype)] += copies
            total_bytes += _numel(s.shape) * s.dtype.itemsize * copies
    return {"tensors": sum(by_dtype.values()), "by_dtype": dict(sorted(by_dtype.items())), "bytes": total_bytes}


def quantization_mismatches(model: nn.Module, hf_text: dict, experts: str = "mxfp4") -> list[dict]:
    """Linear weights that the config's quantization_config (targets Linear, minus its ignore regexes) says are
    MXFP4 but that the checkpoint layout stores otherwise, grouped by layer-free name. Empty without one."""
    q = (hf_text or {}).get("quantization_config") or {}
    if not q:
        return []
    targets = {t for g in q.get("config_groups", {}).values() for t in g.get("targets", [])}
    ignore = [re.compile(p[3:]) for p in q.get("ignore", []) if p.startswith("re:")]
    if "Linear" not in targets:
        return []
    prefix = checkpoint_prefix(model)
    specs = {stored[0].name: stored[0] for stored, _ in stored_layout(model, experts).values()}
    groups: dict[str, dict] = {}
    for mod_name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear):
            continue
        full = prefix + mod_name
        if any(p.match(full) for p in ignore) or full.startswith(("vision_tower", "mm_projector")):
            continue
        s = specs.get(full + ".weight")
        if s is None or s.dtype.itemsize == 1:  # stored packed: config and checkpoint agree
            continue
        key = re.sub(r"\.layers\.\d+\.", ".layers.{i}.", full) + ".weight"
        g = groups.setdefault(key, {"tensor": key, "config_says": "mxfp4 (Linear, not ignored)",
                                    "checkpoint_stores": _dt(s.dtype), "instances": 0})
        g["instances"] += 1
    return sorted(groups.values(), key=lambda g: g["tensor"])
