"""`build_atlas(cfg)`: everything the atlas pages show, as one JSON-able dict (`atlas.json`).

Built from a meta-device model of the config (no weights are allocated): accounting from its state dict and
the checkpoint layout, instances used from a real forward of a small copy (`measure.used_instances`), code
evidence from the live classes, shapes and formulas in config terms. Tests read this dict; the site renders it.
"""

from __future__ import annotations

import datetime
import hashlib
import platform
from pathlib import Path

import torch

from kimik3.atlas import evidence, measure
from kimik3.atlas.accounting import account, census, quantization_mismatches
from kimik3.atlas.catalog import KINDS, breadcrumb, components
from kimik3.atlas.facts import facts
from kimik3.atlas.formulas import edge_label, formulas, shapes, tensors
from kimik3.atlas.params import count_parameters
from kimik3.config import K3Config
from kimik3.model import K3ForConditionalGeneration

SCHEMA = 1
CONTEXTS = (4096, 131072, 1048576)


def expert_format(cfg: K3Config) -> str:
    """How the checkpoint stores the routed experts: "mxfp4" or "bf16"."""
    return cfg.storage.experts


def stored_dtype(cfg: K3Config) -> torch.dtype:
    """The checkpoint's dtype outside the fp32 islands (the meta model is built in it)."""
    return getattr(torch, cfg.storage.dtype)


def ranges(idx: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'."""
    out, start = [], None
    for k, i in enumerate(idx):
        if start is None:
            start = i
        if k + 1 == len(idx) or idx[k + 1] != i + 1:
            out.append(f"{start}" if start == i else f"{start}-{i}")
            start = None
    return ", ".join(out)


def variants(cfg: K3Config) -> list[dict]:
    """Layers grouped by what differs: attention kind, FFN kind, whether the layer starts an AttnRes block."""
    t = cfg.text
    groups: dict[tuple, list[int]] = {}
    for i in range(t.num_layers):
        key = (t.layer_types[i], "moe" if t.moe_layers[i] else "dense", i % t.attn_res_block_size == 0)
        groups.setdefault(key, []).append(i)
    return [{"attention": a, "ffn": f, "starts_block": s, "layers": v, "label": ranges(v),
             "count": len(v)} for (a, f, s), v in groups.items()]


def _source_label(source: str | Path | None, path: Path | None) -> dict:
    if path is None or not path.is_file():
        return {"name": str(source or "config"), "sha256": None}
    return {"name": str(source) if source else path.name, "file": path.name,
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def build_atlas(cfg: K3Config, *, name: str = "config", config_path: Path | None = None,
                context: int = 131072, built_at: str | None = None) -> dict:
    """The atlas of `cfg` (see module doc). `built_at` fixes the date field (two builds are then identical)."""
    comps = components(cfg)
    with torch.device("meta"):
        model = K3ForConditionalGeneration(cfg, stored_dtype(cfg))
    experts = expert_format(cfg)
    acc = account(model, comps, experts)
    comps = _present(comps, acc)
    by_id = {c.id: c for c in comps}
    report = count_parameters(model)
    used, called = measure.used_instances(cfg, comps)
    flops = measure.flops_per_token(model, comps, cfg, context, called)
    cache = measure.cache_bytes(cfg, model.language_model.lm_head.weight.dtype)
    tex, shp = formulas(cfg), shapes(cfg)
    t = cfg.text

    nodes = {}
    for c in comps:
        node = {"id": c.id, "title": c.title, "kind": c.kind, "parent": c.parent, "summary": c.summary,
                "leaf": c.is_leaf, "breadcrumb": breadcrumb(c.id, by_id), "formula": tex.get(c.id, []),
                "shapes": [{**s, "label": edge_label(s)} for s in shp.get(c.id, [])],
                "children": [d.id for d in comps if d.parent == c.id]}
        if c.is_leaf:
            a = acc[c.id]
            stored = a["instance_keys"] or [0]  # [0]: a one-off component (measure keys it so too)
            used_keys = used.get(c.id, [])
            per_layer = a["experts_per_layer"] or 1
            node.update({k: a[k] for k in ("rows", "per_instance", "total", "tensors_stored", "bytes_stored",
                                           "dtypes_stored")})
            node["instances"] = {
                "stored": a["instances_stored"], "used": len(used_keys) * per_layer,
                "experts_per_layer": a["experts_per_layer"],
                "where": ranges(stored) if a["instance_keys"] else "",
                "unused": [k for k in stored if k not in used_keys],
                "layers_by_kind": _by_kind(cfg, stored) if "layers" in node["breadcrumb"] else {},
            }
            node["flops"] = flops.get(c.id)
            if node["flops"] and a["experts_per_layer"]:  # a token meets top-k experts of each MoE layer
                node["flops"]["per"] = (f"MoE layer (top-{cfg.text.moe.num_experts_per_token} of its "
                                        f"{a['experts_per_layer']:,} experts)")
            elif node["flops"]:
                node["flops"]["per"] = "instance"
            node["evidence"] = _evidence(model, c)
            node["tests"] = evidence.covering_tests(_names(model, c))
        nodes[c.id] = node
    _structure_totals(nodes, comps)
    _notes(nodes, cfg)

    text_total = report.total - sum(nodes[i]["total"] for i in ("vision_patch", "vision_block", "vision_norm",
                                                                  "projector") if i in nodes)
    vision_total = report.total - text_total
    atlas = {
        "schema": SCHEMA,
        "name": name,
        "source": _source_label(name, config_path),
        "build": {"built_at": built_at or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                  "revision": evidence.revision(), "torch": torch.__version__.split("+")[0],
                  "python": platform.python_version()},
        "kinds": KINDS,
        "config": _config_facts(cfg, experts),
        "totals": {"total": report.total, "text": text_total, "vision": vision_total,
                   "active": report.active, "active_with_embedding": report.active_with_embedding,
                   "active_without_head": report.active_without_head,
                   "leaf_sum": sum(n["total"] for n in nodes.values() if n["leaf"])},
        "census": census(model, experts),
        "quantization_mismatches": quantization_mismatches(model, cfg.hf.get("text_config", cfg.hf), experts),
        "variants": variants(cfg),
        "pattern": [{"layer": i, "attention": t.layer_types[i], "ffn": "moe" if t.moe_layers[i] else "dense",
                     "starts_block": i % t.attn_res_block_size == 0} for i in range(t.num_layers)],
        "attnres_blocks": [ranges(list(range(s, min(s + t.attn_res_block_size, t.num_layers))))
                           for s in range(0, t.num_layers, t.attn_res_block_size)],
        "depth_mixes_per_forward": sum(nodes[i]["instances"]["used"] for i in ("attn_mix", "ffn_mix", "out_mix")),
        "memory": _memory(nodes, cache, context),
        "flops_context": context,
        "nodes": nodes,
        "order": [c.id for c in comps],
        "tensors": [r for r in tensors(cfg) if r["producer"] in nodes],
    }
    atlas["facts"] = facts(atlas, cfg, model)
    return atlas


def _present(comps: list, acc: dict) -> list:
    """The components this config has: leaves that hold tensors (a config without MLA layers has no MLA
    leaf), structure nodes over at least one of them, op boxes whose parent stayed."""
    children: dict[str, list] = {}
    for c in comps:
        children.setdefault(c.parent, []).append(c)

    def has_leaf(c) -> bool:
        return c.id in acc if c.is_leaf else any(has_leaf(ch) for ch in children.get(c.id, []))

    kept: list = []
    ids: set[str] = set()
    for c in comps:  # parents come before their children
        if c.parent is not None and c.parent not in ids:
            continue
        if (c.is_leaf or c.kind == "structure" or c.id == "vision") and not has_leaf(c):
            continue
        kept.append(c)
        ids.add(c.id)
    return kept


def _by_kind(cfg: K3Config, layers: list[int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for i in layers:
        k = cfg.text.layer_types[i].upper()
        out[k] = out.get(k, 0) + 1
    return out


def _names(model, c) -> set[str]:
    names = set(c.extra_names)
    for mod in _leaf_modules(model, c):
        if type(mod).__module__.startswith("kimik3."):
            names.add(type(mod).__name__)
    names.update(op.split(":")[1] for op in c.ops)
    return names


def _leaf_modules(model, c):
    """The modules holding one instance of leaf `c` (the owner's attributes)."""
    owner = _owner(model, c)
    return [getattr(owner, a) for a in c.owner_attrs if getattr(owner, a, None) is not None]


def _owner(model, c):
    t = model.language_model.config
    if c.id in ("embed", "out_mix", "final_norm"):
        return model.language_model.model
    if c.id == "lm_head":
        return model.language_model
    if c.id in ("vision_patch",):
        return model.vision_tower
    if c.id in ("vision_block", "vision_norm"):
        return model.vision_tower.encoder
    if c.id == "projector":
        return model
    layers = model.language_model.model.layers
    want_moe = c.parent == "moe"
    for i, layer in enumerate(layers):
        if c.layer_kind and t.layer_types[i] != c.layer_kind:
            continue
        if want_moe:
            if hasattr(layer, "block_sparse_moe"):
                return layer.block_sparse_moe
            continue
        if c.id == "dense_mlp" and not hasattr(layer, "mlp"):
            continue
        return layer
    raise ValueError(f"no module holds {c.id}")


def _evidence(model, c) -> list[dict]:
    owner = _owner(model, c)
    what = c.title.lower()
    sites = evidence.owner_sites(type(owner), c.owner_attrs, what)
    seen = set()
    for mod in _leaf_modules(model, c):
        cls = type(mod)
        if isinstance(mod, torch.nn.ModuleList):
            cls = type(mod[0])
        if cls.__module__.startswith("kimik3.") and cls not in seen:
            seen.add(cls)
            sites += evidence.class_sites(cls)
    sites += [evidence.function_site(op) for op in c.ops]
    return sites


def _structure_totals(nodes: dict, comps) -> None:
    """Structure nodes: the sum of their leaves (stored)."""
    def total(cid):
        n = nodes[cid]
        return n["total"] if n["leaf"] else sum(total(ch) for ch in n["children"])
    for c in comps:
        if not c.is_leaf:
            nodes[c.id]["total"] = total(c.id)


def _notes(nodes: dict, cfg: K3Config) -> None:
    """Facts a reader would otherwise get wrong (the seeds did), attached to their components."""
    t = cfg.text
    for n in nodes.values():
        n["notes"] = []
    am = nodes["attn_mix"]["instances"]
    if am["unused"]:
        nodes["attn_mix"]["notes"].append(
            f"stored in {am['stored']} layers, read in {am['used']}: layer(s) {ranges(am['unused'])} have no stored "
            f"block sums yet, so the forward skips the mix and its {nodes['attn_mix']['per_instance']:,} parameters "
            "are loaded but never read (measured on a forward)")
    if t.kda.a_log_size > t.kda.num_heads and "kda" in nodes and nodes["kda"].get("rows"):
        nodes["kda"]["notes"].append(
            f"A_log is stored with {t.kda.a_log_size} entries and counted at that length; the forward uses the "
            f"first {t.kda.num_heads} (one per head)")
    if "mla" in nodes and nodes["mla"].get("rows"):
        ml = t.mla
        mha = ml.num_heads * (ml.qk_head_dim + ml.v_head_dim)
        nodes["mla"]["notes"].append(
            f"no positional encoding: the {ml.qk_rope_head_dim}-wide 'rope' slot is one shared key per token, "
            f"never rotated; the cache holds {ml.kv_lora_rank + ml.qk_rope_head_dim} values per token and layer, "
            f"{mha / (ml.kv_lora_rank + ml.qk_rope_head_dim):.0f}x fewer than MHA at these dims ({mha}); latent "
            f"norms use eps {ml.latent_norm_eps:g}")
    if "shared_expert" in nodes:
        mo = t.moe
        nodes["shared_expert"]["notes"].append(
            f"num_shared_experts = {mo.num_shared_experts} is a width multiplier: one MLP {mo.shared_dim} wide "
            f"(= {mo.num_shared_experts} x {mo.expert_dim}), not {mo.num_shared_experts} separate experts")
    if "experts" in nodes:
        mo = t.moe
        nodes["experts"]["notes"].append(
            f"instances count every expert of every MoE layer; a token runs {mo.num_experts_per_token} of the "
            f"{mo.num_experts} in each layer, so 'used' means the layer reads its experts: which ones run depends "
            "on the routing (the live numbers show the load per expert for a prompt)")
    if "router" in nodes:
        nodes["router"]["notes"].append(
            "e_score_correction_bias is an fp32 buffer (quantile balancing updates it); it only selects experts, "
            "the weights come from the unbiased scores")


def _config_facts(cfg: K3Config, experts: str) -> dict:
    t = cfg.text
    lac = cfg.hf.get("text_config", cfg.hf).get("linear_attn_config", {})
    lists = {k: ranges(sorted(lac[k])) for k in ("kda_layers", "full_attn_layers") if isinstance(lac.get(k), list)}
    return {"layer_lists_1_based": lists,"layers": t.num_layers, "hidden": t.hidden_size, "vocab": t.vocab_size,
            "kda_layers": t.layer_types.count("kda"), "mla_layers": t.layer_types.count("mla"),
            "moe_layers": t.moe_layers.count(True), "dense_layers": t.moe_layers.count(False),
            "experts": t.moe.num_experts, "top_k": t.moe.num_experts_per_token,
            "block_size": t.attn_res_block_size, "expert_format": experts,
            "context": getattr(t, "max_position_embeddings", None), "vision": cfg.vision is not None}


def _memory(nodes: dict, cache: dict, context: int) -> dict:
    weights = {cid: n["bytes_stored"] for cid, n in nodes.items() if n["leaf"]}
    per_seq = cache["kda_state_per_sequence"] + cache["kda_conv_per_sequence"]
    contexts = sorted(set(CONTEXTS) | {context})
    return {"weights_by_component": weights, "weights": sum(weights.values()), **cache,
            "contexts": [{"context": n, "kda": per_seq, "mla": cache["mla_latent_per_token"] * n,
                          "total_per_sequence": per_seq + cache["mla_latent_per_token"] * n} for n in contexts],
            "context": context}
