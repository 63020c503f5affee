"""The atlas's components: ids, kinds, where their tensors live, what they compute (TeX) and on which shapes.

Every state-dict tensor belongs to exactly one *leaf* (matched by `pattern`, first match wins; the named group
`i` is the instance: a decoder layer or a vision block). Structure nodes group leaves for the breadcrumb and
the diagram; op nodes are boxes without parameters. Texts and formulas take their numbers from the config,
so a site built for another config never shows a K3 constant. Symbols that are diagram nodes are wrapped in
`\\htmlData{node=<id>}` (the page links them to the box).

Axis letters are the project's shape legend: B batch, T tokens, D hidden, H heads, K/V head dims, C latent
rank, E experts, A active experts, F expert width, L MoE latent, M stored blocks, S depth sources.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from kimik3.config import K3Config

KINDS = {  # kind -> legend label (CSS colors live in atlas.css under the same names)
    "attention": "attention", "ffn": "FFN / MoE", "norm": "norm / residual", "embed": "embedding / head",
    "aux": "auxiliary", "structure": "structure",
}

_L = r"^language_model\.model\.layers\.(?P<i>\d+)\."
_MOE = _L + r"block_sparse_moe\."


@dataclass(frozen=True)
class Component:
    id: str
    title: str
    kind: str
    parent: str | None
    summary: str  # one line: the hover text
    pattern: str | None = None  # leaves only: regex over state-dict names
    layer_kind: str | None = None  # "kda" / "mla": the leaf matches only layers of that attention kind
    owner_attrs: tuple[str, ...] = ()  # attributes of the parent module that hold this leaf (code evidence)
    ops: tuple[str, ...] = ()  # "module:function" computing it (code evidence: computes)
    extra_names: tuple[str, ...] = field(default=())  # class/function names that find the tests covering it

    @property
    def is_leaf(self) -> bool:
        return self.pattern is not None


def components(cfg: K3Config) -> list[Component]:
    """All components of a K3-architecture model, in flow order (top of the diagram first)."""
    t = cfg.text
    D, N = t.hidden_size, t.num_layers
    kd, ml, mo = t.kda, t.mla, t.moe
    out = [
        Component("model", "K3 model", "structure", None, "the whole model: text decoder, vision tower, projector"),
        Component("embed", "Token embedding", "embed", "model",
                  f"token ids -> [B, T, D={D}] vectors; no positional encoding is added (order comes from KDA "
                  "and its short convolutions)", r"^language_model\.model\.embed_tokens\.",
                  owner_attrs=("embed_tokens",)),
        Component("layers", f"{N} decoder layers", "structure", "model",
                  f"one layer drawn once for all {N}: an AttnRes input mix, attention (KDA or MLA), an AttnRes "
                  "FFN mix, then the FFN (dense MLP or latent MoE)"),
        Component("attn_mix", "Attention input mix (AttnRes)", "norm", "layers",
                  "this layer's attention input: a softmax over depth of the stored block sums and the running "
                  "sum, scored by one pseudo-query", _L + r"self_attention_res_(norm|proj)\.",
                  owner_attrs=("self_attention_res_norm", "self_attention_res_proj"),
                  ops=("kimik3.ops.attnres.reference:attn_res_mix", "kimik3.model.decoder:depth_mix")),
        Component("input_norm", "Input RMSNorm", "norm", "layers",
                  f"RMSNorm over D={D} before attention (fp32 normalize, gain in the compute dtype)",
                  _L + r"input_layernorm\.", owner_attrs=("input_layernorm",)),
        Component("attention", "Attention", "structure", "layers",
                  f"KDA in {t.layer_types.count('kda')} layers, gated NoPE MLA in {t.layer_types.count('mla')}"),
        Component("kda", "Kimi Delta Attention", "attention", "attention",
                  f"linear attention with a per-channel decayed delta rule over a [H={kd.num_heads}, "
                  f"K={kd.head_dim}, V={kd.head_dim}] state; short convs, low-rank decay gate, gated output norm",
                  _L + r"self_attn\.", layer_kind="kda", owner_attrs=("self_attn",),
                  ops=("kimik3.ops.kda.reference:chunk_kda", "kimik3.ops.kda.reference:gate_inputs"),
                  extra_names=("chunk_kda", "recurrent_kda", "chunk_kda_with_gate")),
        Component("mla", "Gated NoPE MLA", "attention", "attention",
                  f"softmax attention over a {ml.kv_lora_rank}-wide latent plus one shared {ml.qk_rope_head_dim}"
                  "-wide key per token (never rotated), with a sigmoid output gate",
                  _L + r"self_attn\.", layer_kind="mla", owner_attrs=("self_attn",),
                  ops=("kimik3.ops.mla.reference:mla_attention", "kimik3.ops.mla.reference:mla_latent_attention"),
                  extra_names=("mla_attention", "mla_latent_attention")),
        Component("residual", "Running sum / block store", "norm", "layers",
                  f"the attention output is added to the running sum; at a block start (every "
                  f"{t.attn_res_block_size} layers) the sum is stored as a depth source and restarted"),
        Component("ffn_mix", "FFN input mix (AttnRes)", "norm", "layers",
                  "the FFN's input: a second depth mix (own pseudo-query) over the stored sums and the running sum",
                  _L + r"mlp_res_(norm|proj)\.", owner_attrs=("mlp_res_norm", "mlp_res_proj"),
                  ops=("kimik3.ops.attnres.reference:attn_res_mix",)),
        Component("post_norm", "Post-attention RMSNorm", "norm", "layers",
                  f"RMSNorm over D={D} before the FFN", _L + r"post_attention_layernorm\.",
                  owner_attrs=("post_attention_layernorm",)),
        Component("ffn", "FFN", "structure", "layers",
                  f"dense SiTU MLP in {t.moe_layers.count(False)} layer(s), latent MoE in {t.moe_layers.count(True)}"),
        Component("dense_mlp", "Dense SiTU-GLU MLP", "ffn", "ffn",
                  f"D={D} -> {t.intermediate_size} -> D with the SiTU gate (fp32 activation)", _L + r"mlp\.",
                  owner_attrs=("mlp",), ops=("kimik3.ops.situ.reference:situ_glu",), extra_names=("MLP",)),
        Component("moe", "Latent MoE", "structure", "ffn",
                  f"{mo.num_experts} routed experts (top-{mo.num_experts_per_token}) in the {mo.latent_dim}-wide "
                  f"latent, plus one shared SiTU MLP {mo.shared_dim} wide"),
        Component("router", "Router", "ffn", "moe",
                  f"sigmoid scores of {mo.num_experts} experts on the full D={D} input; a correction bias "
                  "(fp32 buffer) only selects the top-k", _MOE + r"gate\.", owner_attrs=("gate",),
                  extra_names=("Router",)),
        Component("latent_down", "Latent down projection", "ffn", "moe",
                  f"D={D} -> L={mo.latent_dim}: the routed experts work in this latent",
                  _MOE + r"routed_expert_down_proj\.", owner_attrs=("routed_expert_down_proj",)),
        Component("experts", "Routed experts", "ffn", "moe",
                  f"{mo.num_experts} SiTU-GLU experts L={mo.latent_dim} -> F={mo.expert_dim} -> L, "
                  f"{mo.num_experts_per_token} per token", _MOE + r"experts\.", owner_attrs=("experts",),
                  ops=("kimik3.ops.moe.reference:routed_experts",), extra_names=("routed_experts", "Experts")),
        Component("combine", "Expert combine", "ffn", "moe",
                  "sum of the selected experts' outputs weighted by the renormalized scores, in fp32, in the latent"),
        Component("latent_norm", "Latent RMSNorm", "norm", "moe", f"RMSNorm over L={mo.latent_dim} of the combine",
                  _MOE + r"routed_expert_norm\.", owner_attrs=("routed_expert_norm",)),
        Component("latent_up", "Latent up projection", "ffn", "moe", f"L={mo.latent_dim} -> D={D}",
                  _MOE + r"routed_expert_up_proj\.", owner_attrs=("routed_expert_up_proj",)),
        Component("shared_expert", "Shared expert", "ffn", "moe",
                  f"one SiTU MLP D={D} -> {mo.shared_dim} -> D on every token ({mo.num_shared_experts} x "
                  f"{mo.expert_dim}: the count is a width multiplier)", _MOE + r"shared_experts\.",
                  owner_attrs=("shared_experts",), ops=("kimik3.ops.situ.reference:situ_glu",)),
        Component("out_mix", "Output mix (AttnRes)", "norm", "model",
                  "after the last layer: a depth mix over every stored block sum and the final running sum",
                  r"^language_model\.model\.output_attn_res_(norm|proj)\.",
                  owner_attrs=("output_attn_res_norm", "output_attn_res_proj"),
                  ops=("kimik3.ops.attnres.reference:attn_res_mix",)),
        Component("final_norm", "Final RMSNorm", "norm", "model", f"RMSNorm over D={D} of the output mix",
                  r"^language_model\.model\.norm\.", owner_attrs=("norm",)),
        Component("lm_head", "LM head", "embed", "model",
                  f"D={D} -> {t.vocab_size} logits, untied from the embedding, no fp32 upcast",
                  r"^language_model\.lm_head\.", owner_attrs=("lm_head",)),
    ]
    if cfg.vision is not None:
        v = cfg.vision
        out += [
            Component("vision", "Vision tower (MoonViT)", "aux", "model",
                      f"{v.patch_size}x{v.patch_size} patches -> {v.num_layers} ViT blocks of width "
                      f"{v.hidden_size} -> merged 2x2 -> projected to D={D}; images replace media-pad tokens"),
            Component("vision_patch", "Patch + position embedding", "aux", "vision",
                      f"a {v.patch_size}x{v.patch_size} conv to {v.hidden_size}, plus a bilinearly resized "
                      "learned position table and a fixed time embedding",
                      r"^vision_tower\.patch_embed\.", owner_attrs=("patch_embed",)),
            Component("vision_block", "Vision block", "aux", "vision",
                      f"pre-norm ViT block: 2D-RoPE attention ({v.num_heads} heads) + GELU MLP "
                      f"{v.hidden_size} -> {v.intermediate_size}",
                      r"^vision_tower\.encoder\.blocks\.(?P<i>\d+)\.", owner_attrs=("blocks",)),
            Component("vision_norm", "Vision final norm", "aux", "vision", f"RMSNorm over {v.hidden_size}",
                      r"^vision_tower\.encoder\.final_layernorm\.", owner_attrs=("final_layernorm",)),
            Component("projector", "MM projector", "aux", "vision",
                      f"2x2 merge -> {v.mm_hidden_size * 4} -> GELU -> D={D}, post-RMSNorm",
                      r"^mm_projector\.", owner_attrs=("mm_projector",)),
        ]
    return out


def leaf_of(name: str, comps: list[Component], layer_types: tuple[str, ...]) -> tuple[str, int | None]:
    """(leaf id, instance index or None) of one state-dict tensor name; ValueError if no leaf claims it."""
    for c in comps:
        if not c.is_leaf:
            continue
        m = re.match(c.pattern, name)
        if m is None:
            continue
        i = int(m["i"]) if "i" in m.groupdict() else None
        if c.layer_kind is not None and layer_types[i] != c.layer_kind:
            continue
        return c.id, i
    raise ValueError(f"tensor {name} belongs to no atlas component: add a pattern to atlas/catalog.py")


def breadcrumb(cid: str, by_id: dict[str, Component]) -> list[str]:
    chain = []
    while cid is not None:
        chain.append(cid)
        cid = by_id[cid].parent
    return chain[::-1]
