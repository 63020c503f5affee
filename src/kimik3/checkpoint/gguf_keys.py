"""The key map between kimik3's checkpoint names and llama.cpp's `kimi-k3` GGUF layout (tensors and metadata).

GGUF holds the text model only (llama.cpp's K3 has no vision tower). Each GGUF tensor comes from one or two of our
state-dict tensors (the released names; routed experts stacked, `keys.py`) by one `kind` of change:

    copy     the same values (norms, biases and the router in F32, as llama.cpp's converter stores them)
    conv     a KDA short-conv weight [D, 1, K] as ggml's [K, 1, D, 1] (numpy (1, D, 1, K)): a pure reshape
    a        KDA `A_log` [a_log_size] as `ssm_a` = -exp(A_log[:H]) (F32)
    res      an AttnRes norm weight times its projection [1, D]: `*_res_score` = norm * proj (F32)
    k_b/v_b  MLA `kv_b_proj` [H*(N+V), C] split per head: `attn_k_b` [H, C, N] (transposed), `attn_v_b` [H, V, C]
    experts  stacked routed experts [E, out, in]: MXFP4 blocks repacked (`gguf_mxfp4`) or dense

`a` and `res` lose what they fold (A_log's padding, the norm/projection split); kimik3's own files keep the
originals in `kimik3.unfolded.<name>` metadata so that export -> import is the identity.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from kimik3.checkpoint.keys import TEXT_PREFIX

try:  # the format's own library (llama.cpp's gguf-py), the `gguf` extra; gguf_read and gguf_write take it from here
    import gguf  # noqa: F401
except ImportError:  # a ValueError: the command line shows it as one line
    raise ValueError("GGUF files need the gguf package: pip install 'kimik3[gguf]'") from None
from kimik3.config import K3Config

ARCH = "kimi-k3"
UNFOLDED = "kimik3.unfolded."  # + our tensor name: the float32 values an `a` or `res` tensor folds
CONFIG_KEY = "kimik3.config_json"  # the exact config.json of a kimik3 export
GENERATION_KEY = "kimik3.generation_config_json"

_M = TEXT_PREFIX + "model."
# per-layer tensors: our suffix -> (GGUF suffix, kind); g_proj depends on the layer kind (below)
_LAYER = {
    "input_layernorm.weight": ("attn_norm.weight", "copy"),
    "post_attention_layernorm.weight": ("ffn_norm.weight", "copy"),
    "self_attention_res_norm.weight": ("attn_res_score.weight", "res"),
    "mlp_res_norm.weight": ("ffn_res_score.weight", "res"),
    "self_attn.q_proj.weight": ("attn_q.weight", "copy"),
    "self_attn.k_proj.weight": ("attn_k.weight", "copy"),
    "self_attn.v_proj.weight": ("attn_v.weight", "copy"),
    "self_attn.o_proj.weight": ("attn_output.weight", "copy"),
    "self_attn.q_conv1d.weight": ("ssm_conv1d_q.weight", "conv"),
    "self_attn.k_conv1d.weight": ("ssm_conv1d_k.weight", "conv"),
    "self_attn.v_conv1d.weight": ("ssm_conv1d_v.weight", "conv"),
    "self_attn.f_a_proj.weight": ("ssm_f_a.weight", "copy"),
    "self_attn.f_b_proj.weight": ("ssm_f_b.weight", "copy"),
    "self_attn.b_proj.weight": ("ssm_beta.weight", "copy"),
    "self_attn.A_log": ("ssm_a", "a"),
    "self_attn.dt_bias": ("ssm_dt.bias", "copy"),
    "self_attn.o_norm.weight": ("ssm_norm.weight", "copy"),
    "self_attn.q_a_proj.weight": ("attn_q_a.weight", "copy"),
    "self_attn.q_b_proj.weight": ("attn_q_b.weight", "copy"),
    "self_attn.q_a_layernorm.weight": ("attn_q_a_norm.weight", "copy"),
    "self_attn.kv_a_proj_with_mqa.weight": ("attn_kv_a_mqa.weight", "copy"),
    "self_attn.kv_a_layernorm.weight": ("attn_kv_a_norm.weight", "copy"),
    "mlp.gate_proj.weight": ("ffn_gate.weight", "copy"),
    "mlp.up_proj.weight": ("ffn_up.weight", "copy"),
    "mlp.down_proj.weight": ("ffn_down.weight", "copy"),
    "block_sparse_moe.gate.weight": ("ffn_gate_inp.weight", "copy"),
    "block_sparse_moe.gate.e_score_correction_bias": ("exp_probs_b.bias", "copy"),
    "block_sparse_moe.routed_expert_down_proj.weight": ("ffn_routed_down.weight", "copy"),
    "block_sparse_moe.routed_expert_up_proj.weight": ("ffn_routed_up.weight", "copy"),
    "block_sparse_moe.routed_expert_norm.weight": ("ffn_routed_norm.weight", "copy"),
    "block_sparse_moe.shared_experts.gate_proj.weight": ("ffn_gate_shexp.weight", "copy"),
    "block_sparse_moe.shared_experts.up_proj.weight": ("ffn_up_shexp.weight", "copy"),
    "block_sparse_moe.shared_experts.down_proj.weight": ("ffn_down_shexp.weight", "copy"),
}
_EXPERTS = {"w1": "ffn_gate_exps.weight", "w2": "ffn_down_exps.weight", "w3": "ffn_up_exps.weight"}
_TOP = {
    _M + "embed_tokens.weight": ("token_embd.weight", "copy"),
    TEXT_PREFIX + "lm_head.weight": ("output.weight", "copy"),
    _M + "norm.weight": ("output_norm.weight", "copy"),
    _M + "output_attn_res_norm.weight": ("output_res_score.weight", "res"),
}
# kept in F32 whatever the stored dtype (llama.cpp's converter does the same; its graph reads them as F32)
F32_NAMES = re.compile(r"(norm\.weight|\.bias|ffn_gate_inp\.weight|res_score\.weight|ssm_a|conv1d_[qkv]\.weight)$")
_IN_LAYER = re.compile(r"^" + re.escape(_M) + r"layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class Entry:
    """One GGUF tensor and the state-dict tensors it is made of (`sources[0]` names it; a `res` entry's
    second source is the projection, an MXFP4 `experts` entry's the scales)."""

    gguf: str
    sources: tuple[str, ...]
    kind: str


def plan(state_names: list[str], cfg: K3Config) -> list[Entry]:
    """The GGUF tensors of a text model whose state dict has `state_names` (names with `language_model.`), in
    state-dict order. A name the map does not know is a bug here, not a user error."""
    entries, unmapped = [], []
    for name in state_names:
        entry = _entry(name, cfg)
        if entry is None:
            unmapped.append(name)
        elif entry is not _PARTNER:
            entries.extend(entry if isinstance(entry, list) else [entry])
    assert not unmapped, f"gguf key map: no GGUF name for {unmapped[:3]}"
    return entries


_PARTNER = Entry("", (), "")  # a tensor that travels with another (a res projection, MXFP4 scales)


def _entry(name: str, cfg: K3Config) -> Entry | list[Entry] | None:
    if name in _TOP:
        gguf, kind = _TOP[name]
        return Entry(gguf, _with_partner(name, kind), kind)
    if name.endswith("_res_proj.weight"):
        return _PARTNER
    m = _IN_LAYER.match(name)
    if m is None:
        return None
    i, suffix = int(m[1]), m[2]
    blk = f"blk.{i}."
    e = re.fullmatch(r"block_sparse_moe\.experts\.(w[123])(|_packed|_scale)", suffix)
    if e is not None:
        if e[2] == "_scale":
            return _PARTNER
        sources = (name, name.removesuffix("_packed") + "_scale") if e[2] == "_packed" else (name,)
        return Entry(blk + _EXPERTS[e[1]], sources, "experts")
    if suffix == "self_attn.g_proj.weight":  # one HF name, two tensors: the KDA gate or the MLA output gate
        return Entry(blk + ("ssm_g.weight" if cfg.text.layer_types[i] == "kda" else "attn_gate.weight"),
                     (name,), "copy")
    if suffix == "self_attn.kv_b_proj.weight":
        return [Entry(blk + "attn_k_b.weight", (name,), "k_b"), Entry(blk + "attn_v_b.weight", (name,), "v_b")]
    if suffix not in _LAYER:
        return None
    gguf, kind = _LAYER[suffix]
    return Entry(blk + gguf, _with_partner(name, kind), kind)


def _with_partner(name: str, kind: str) -> tuple[str, ...]:
    return (name, name.replace("_res_norm.weight", "_res_proj.weight")) if kind == "res" else (name,)


def metadata(cfg: K3Config) -> dict[str, object]:
    """llama.cpp's `kimi-k3` hyperparameters (the keys its converter writes), as {key: value}; value types are
    picked by the writer (int -> UINT32, float -> FLOAT32, bool, list of int -> INT32 array)."""
    t, a = cfg.text, ARCH
    return {
        f"{a}.block_count": t.num_layers,
        f"{a}.context_length": t.max_position_embeddings or 0,
        f"{a}.embedding_length": t.hidden_size,
        f"{a}.feed_forward_length": t.intermediate_size,
        f"{a}.attention.head_count": t.mla.num_heads,
        # n_head_kv 0 marks a KDA layer; MLA is served as MQA over its latent (one KV head)
        f"{a}.attention.head_count_kv": [1 if k == "mla" else 0 for k in t.layer_types],
        f"{a}.attention.layer_norm_rms_epsilon": t.rms_norm_eps,
        f"{a}.expert_count": t.moe.num_experts,
        f"{a}.expert_used_count": t.moe.num_experts_per_token,
        f"{a}.expert_group_used_count": 1,
        f"{a}.expert_gating_func": 2,  # sigmoid
        f"{a}.vocab_size": t.vocab_size,
        f"{a}.ssm.conv_kernel": t.kda.short_conv_kernel_size,
        f"{a}.kda.head_dim": t.kda.head_dim,
        f"{a}.kda.gate_lower_bound": t.kda.gate_lower_bound,
        f"{a}.attention.q_lora_rank": t.mla.q_lora_rank,
        f"{a}.attention.kv_lora_rank": t.mla.kv_lora_rank,
        f"{a}.rope.dimension_count": t.mla.qk_rope_head_dim,
        f"{a}.attention.key_length": t.mla.kv_lora_rank + t.mla.qk_rope_head_dim,
        f"{a}.attention.value_length": t.mla.kv_lora_rank,
        f"{a}.attention.key_length_mla": t.mla.qk_nope_head_dim + t.mla.qk_rope_head_dim,
        f"{a}.attention.value_length_mla": t.mla.v_head_dim,
        f"{a}.expert_feed_forward_length": t.moe.expert_dim,
        f"{a}.expert_shared_count": t.moe.num_shared_experts,
        f"{a}.leading_dense_block_count": t.moe_layers.index(True) if any(t.moe_layers) else t.num_layers,
        f"{a}.expert_weights_scale": t.moe.routed_scaling_factor,
        f"{a}.expert_weights_norm": t.moe.renormalize,
        f"{a}.expert_latent_length": t.moe.latent_dim,
        f"{a}.activation.situ_beta": t.situ_beta,
        f"{a}.activation.situ_linear_beta": t.situ_linear_beta,
        f"{a}.attn_res.block_size": t.attn_res_block_size,
    }


def hf_config(kv: dict[str, object], bos: int | None, eos: int | None, pad: int | None, media: int) -> dict:
    """A text-only config.json rebuilt from a `kimi-k3` GGUF's hyperparameters (a file without kimik3's own
    `kimik3.config_json`, such as llama.cpp's converter writes). Raises KeyError naming a missing key."""
    a = ARCH

    def get(key: str):
        if f"{a}.{key}" not in kv:
            raise KeyError(f"{a}.{key}")
        value = kv[f"{a}.{key}"]
        # GGUF floats are float32: its shortest decimal gives back the config's number (1e-05, not 9.99999975e-06)
        return float(str(np.float32(value))) if isinstance(value, float) else value

    kinds = list(get("attention.head_count_kv"))
    layers = len(kinds)
    dense = int(get("leading_dense_block_count"))
    rope = int(get("rope.dimension_count"))
    heads = int(get("attention.head_count"))
    text = {
        "model_type": "kimi_linear", "hidden_act": "situ", "mla_use_nope": True, "mla_use_output_gate": True,
        "moe_router_activation_func": "sigmoid", "topk_method": "noaux_tc", "use_grouped_topk": True,
        "num_expert_group": 1, "topk_group": 1, "moe_layer_freq": 1, "num_nextn_predict_layers": 0,
        "tie_word_embeddings": False, "latent_moe_use_norm": True, "dtype": "bfloat16",
        "vocab_size": int(get("vocab_size")), "hidden_size": int(get("embedding_length")),
        "intermediate_size": int(get("feed_forward_length")), "num_hidden_layers": layers,
        "max_position_embeddings": int(get("context_length")) or None,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "num_attention_heads": heads, "num_key_value_heads": heads,
        "q_lora_rank": int(get("attention.q_lora_rank")), "kv_lora_rank": int(get("attention.kv_lora_rank")),
        "qk_rope_head_dim": rope, "qk_nope_head_dim": int(get("attention.key_length_mla")) - rope,
        "v_head_dim": int(get("attention.value_length_mla")),
        "num_experts": int(get("expert_count")), "num_experts_per_token": int(get("expert_used_count")),
        "moe_intermediate_size": int(get("expert_feed_forward_length")),
        "num_shared_experts": int(get("expert_shared_count")), "first_k_dense_replace": dense,
        "routed_scaling_factor": float(get("expert_weights_scale")),
        "moe_renormalize": bool(get("expert_weights_norm")),
        "routed_expert_hidden_size": int(get("expert_latent_length")),
        "activation_situ_beta": float(get("activation.situ_beta")),
        "activation_situ_linear_beta": float(get("activation.situ_linear_beta")),
        "attn_res_block_size": int(get("attn_res.block_size")),
        "linear_attn_config": {
            "kda_layers": [i + 1 for i, k in enumerate(kinds) if k == 0],
            "full_attn_layers": [i + 1 for i, k in enumerate(kinds) if k != 0],
            "num_heads": heads, "head_dim": int(get("kda.head_dim")),
            "short_conv_kernel_size": int(get("ssm.conv_kernel")),
            "gate_lower_bound": float(get("kda.gate_lower_bound")), "use_full_rank_gate": True,
        },
        "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad,
    }
    if text["max_position_embeddings"] is None:
        del text["max_position_embeddings"]
    return {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "bos_token_id": bos,
            "eos_token_id": eos, "pad_token_id": pad, "media_placeholder_token_id": media,
            "tie_word_embeddings": False, "dtype": "bfloat16", "text_config": text}
