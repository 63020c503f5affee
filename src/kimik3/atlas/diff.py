"""The difference between two atlases: config facts, per-component parameters (deltas sum to the total delta),
layer variants and the tensor shapes that changed."""

from __future__ import annotations


def _fmt(v) -> str:
    if isinstance(v, (list, tuple)):
        return ", ".join(_fmt(x) for x in v) if v else "[]"
    return "—" if v is None else f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else str(v)


def _flat(config: dict, prefix: str = "") -> dict:
    """Nested config sections as dotted fields (`vision.hidden_size`): a row per value, never a printed dict."""
    out = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def diff_atlases(a: dict, b: dict) -> dict:
    ca, cb = _flat(a["config"]), _flat(b["config"])
    fields = sorted(set(ca) | set(cb))
    config = [{"field": f, "a": _fmt(ca.get(f)), "b": _fmt(cb.get(f))} for f in fields if ca.get(f) != cb.get(f)]
    comps, tensors = [], []
    for cid in list(dict.fromkeys(a["order"] + b["order"])):
        na, nb = a["nodes"].get(cid, {}), b["nodes"].get(cid, {})
        if not (na.get("leaf") or nb.get("leaf")):
            continue
        ta, tb = na.get("total", 0), nb.get("total", 0)
        comps.append({"id": cid, "title": (na or nb)["title"], "per_instance_a": na.get("per_instance", 0),
                      "per_instance_b": nb.get("per_instance", 0),
                      "instances_a": na.get("instances", {}).get("stored", 0),
                      "instances_b": nb.get("instances", {}).get("stored", 0),
                      "total_a": ta, "total_b": tb, "delta": tb - ta})
        ra = {r["tensor"]: r["shape"] for r in na.get("rows", [])}
        rb = {r["tensor"]: r["shape"] for r in nb.get("rows", [])}
        for name in sorted(set(ra) | set(rb)):
            if ra.get(name) != rb.get(name):
                tensors.append({"tensor": f"{cid}: {name}", "a": " × ".join(map(str, ra.get(name, []))) or "—",
                                "b": " × ".join(map(str, rb.get(name, []))) or "—"})

    def var_key(v):
        return f"{v['attention'].upper()} + {v['ffn']}" + (", block start" if v["starts_block"] else "")

    va = {var_key(v): v["label"] for v in a["variants"]}
    vb = {var_key(v): v["label"] for v in b["variants"]}
    variants = [{"variant": k, "a": va.get(k, "—"), "b": vb.get(k, "—")} for k in sorted(set(va) | set(vb))]
    return {"a": a["name"], "b": b["name"], "config": config, "components": comps, "variants": variants,
            "tensors": tensors, "totals": {"a": a["totals"]["total"], "b": b["totals"]["total"],
                                           "delta": b["totals"]["total"] - a["totals"]["total"]}}
