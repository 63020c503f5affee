"""Facts that hand-drawn K3 pages tend to get wrong, each stated from this build's own numbers.

Every value is read from the atlas being built (or the live modules), so the list holds for whatever config
the atlas is built from; each fact links to the component page that shows it.
"""

from __future__ import annotations

from collections import Counter

from torch import nn

from kimik3.config import K3Config


def _fact(topic: str, shows: str, link: str) -> dict:
    return {"topic": topic, "shows": shows, "link": link}


def norm_eps(model: nn.Module) -> dict[str, int]:
    """eps -> number of text RMSNorm modules with it (read from the live modules)."""
    eps = Counter()
    for name, mod in model.named_modules():
        if name.startswith("language_model.") and hasattr(mod, "eps") and hasattr(mod, "weight"):
            eps[f"{mod.eps:g}"] += 1
    return dict(sorted(eps.items()))


def facts(atlas: dict, cfg: K3Config, model: nn.Module) -> list[dict]:
    n, c, t = atlas["nodes"], atlas["config"], cfg.text
    out = []
    kda_moe = sum(1 for p in atlas["pattern"] if p["attention"] == "kda" and p["ffn"] == "moe")
    if "kda" in n:
        out.append(_fact("How many KDA layers", f"{c['kda_layers']} KDA layers, of which {kda_moe} have a latent MoE "
                         f"(the others a dense MLP); {c['mla_layers']} MLA layers", "kda"))
    am = n["attn_mix"]["instances"]
    out.append(_fact("Attention input mix: instances", f"stored in all {am['stored']} layers "
                     f"({n['attn_mix']['total']:,} parameters), read in {am['used']} (measured); it is per decoder "
                     "layer, not specific to the attention kind", "attn_mix"))
    sizes = Counter(len(range(s, min(s + t.attn_res_block_size, t.num_layers)))
                    for s in range(0, t.num_layers, t.attn_res_block_size))
    blocks = " + ".join(f"{k} x {v}" if k > 1 else str(v) for v, k in sorted(sizes.items(), reverse=True))
    out.append(_fact("AttnRes blocks", f"{sum(sizes.values())} blocks ({blocks} layers); the output mix sees "
                     f"{sum(sizes.values()) + 1} sources; the mixes replace the sublayer input and feed only its "
                     f"norm; {atlas['depth_mixes_per_forward']} mixes per forward", "out_mix"))
    if "experts" in n:
        mo = t.moe
        out.append(_fact("Routed experts' input width", f"L = {mo.latent_dim} (after the latent down projection), "
                         f"not D = {t.hidden_size}: w1, w3 are {mo.expert_dim} x {mo.latent_dim}", "experts"))
        out.append(_fact("Shared expert width", f"one SiTU MLP {mo.shared_dim} wide = {mo.num_shared_experts} x "
                         f"{mo.expert_dim}; {n['shared_expert']['per_instance']:,} parameters per layer",
                         "shared_expert"))
    if "mla" in n:
        ml = t.mla
        mha = ml.num_heads * (ml.qk_head_dim + ml.v_head_dim)
        latent = ml.kv_lora_rank + ml.qk_rope_head_dim
        out.append(_fact("MLA cache and positions", f"{latent} values per token and layer ({ml.kv_lora_rank} latent "
                         f"+ one shared {ml.qk_rope_head_dim}-wide key, never rotated: no RoPE anywhere); MHA at "
                         f"these dims would cache {mha:,}, {mha / latent:.0f}x more", "mla"))
    eps = norm_eps(model)
    smaller = " (the MLA latent norms use the smaller one)" if "mla" in n and len(eps) > 1 else ""
    out.append(_fact("RMSNorm eps", ", ".join(f"{k} in {v} norms" for k, v in eps.items()) + smaller,
                     "input_norm"))
    tot = atlas["totals"]
    out.append(_fact("Parameters and active parameters", f"{tot['total']:,} in all ({tot['text']:,} text); active "
                     f"per token {tot['active']:,} (head, no embedding), {tot['active_with_embedding']:,} with the "
                     f"embedding, {tot['active_without_head']:,} with neither", "model"))
    if atlas["quantization_mismatches"]:
        names = ", ".join(m["tensor"].rsplit(".", 2)[-2] for m in atlas["quantization_mismatches"])
        out.append(_fact("The config's quantization ignore list", f"does not describe the checkpoint: {names} "
                         "(nn.Linear in kimik3's modules) match no ignore pattern, yet are stored unquantized",
                         "latent_down" if "latent_down" in n else "model"))
    return out
