"""The Hugging Face `config.json` layout, translated into the config tree and checked on the way.

This is the only place where HF key names, nesting and the 1-based `kda_layers` / `full_attn_layers` lists are
read: a value of the wrong type is a ValueError naming the field, a setting K3 does not have (RoPE, grouped
routing, another activation) is a ValueError saying what K3 uses, and an unknown key is a warning naming the
closest known one. `K3Config.from_hf` and `K3Config.from_file` are built from `k3_fields` and `k3_file_fields`.
"""

from __future__ import annotations

import difflib
import json
import warnings
from pathlib import Path
from typing import Any

from kimik3.config.sections import (
    A_LOG_PAD,
    STORED_DTYPES,
    KDAConfig,
    LayerType,
    MLAConfig,
    MoEConfig,
    Storage,
    TextConfig,
    VisionConfig,
    _check,
)

_MISSING = object()
_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}

# keys of config.json that K3 reads or that HF configs carry without meaning anything to the model; anything
# else is reported (a misspelt key would otherwise be silently ignored)
HF_COMMON_KEYS = frozenset("""
    _name_or_path _attn_implementation add_cross_attention architectures auto_map bad_words_ids
    begin_suppress_tokens chunk_size_feed_forward cross_attention_hidden_size decoder_start_token_id
    diversity_penalty do_sample dtype early_stopping encoder_no_repeat_ngram_size exponential_decay_length_penalty
    finetuning_task forced_bos_token_id forced_eos_token_id id2label is_decoder is_encoder_decoder label2id
    length_penalty max_length min_length model_type no_repeat_ngram_size num_beam_groups num_beams
    num_return_sequences output_attentions output_hidden_states output_scores prefix problem_type pruned_heads
    remove_invalid_values repetition_penalty return_dict return_dict_in_generate sep_token_id suppress_tokens
    task_specific_params temperature tf_legacy_loss tie_encoder_decoder tokenizer_class top_k top_p torchscript
    torch_dtype transformers_version typical_p use_bfloat16 use_cache
""".split())
TOP_KEYS = HF_COMMON_KEYS | frozenset("""
    bos_token_id eos_token_id pad_token_id media_placeholder_token_id ignore_index image_placeholder
    text_config vision_config tie_word_embeddings quantization_config
""".split())
TEXT_KEYS = HF_COMMON_KEYS | frozenset("""
    activation_situ_beta activation_situ_linear_beta attn_res_block_size bos_token_id eos_token_id pad_token_id
    first_k_dense_replace hidden_act hidden_size initializer_range intermediate_size kv_lora_rank
    latent_moe_use_norm linear_attn_config max_position_embeddings mla_use_nope mla_use_output_gate
    moe_intermediate_size moe_layer_freq moe_renormalize moe_router_activation_func num_attention_heads
    num_expert_group num_experts num_experts_per_token num_hidden_layers num_key_value_heads
    num_nextn_predict_layers num_shared_experts q_lora_rank qk_nope_head_dim qk_rope_head_dim quantization_config
    rms_norm_eps routed_expert_hidden_size routed_scaling_factor tie_word_embeddings topk_group topk_method
    use_grouped_topk v_head_dim vocab_size
""".split())
KDA_KEYS = frozenset("""
    full_attn_layers gate_lower_bound head_dim kda_layers num_heads short_conv_kernel_size use_full_rank_gate
""".split())
VISION_KEYS = HF_COMMON_KEYS | frozenset("""
    activation_func attn_bias init_pos_emb_height init_pos_emb_time init_pos_emb_width linear_bias
    merge_kernel_size merge_type mlp_type mm_hidden_size mm_projector_type norm_type patch_embed_proj_bias
    patch_size pos_emb_interpolation_mode pos_emb_type projector_hidden_act projector_ln_eps qkv_hidden_size
    text_hidden_size vt_hidden_size vt_intermediate_size vt_num_attention_heads vt_num_hidden_layers
""".split())


def _get(d: dict, key: str, where: str, default: Any = _MISSING, kind: type | None = None) -> Any:
    """`d[key]`, checked to be of `kind` (bool is not an int; an int is a float), or `default` when absent."""
    if key not in d:
        if default is _MISSING:
            raise ValueError(f"config: missing required field '{where}{key}'")
        return default
    value = d[key]
    if kind is None or value is None and default is None:
        return value
    ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok:
        raise ValueError(f"config: '{where}{key}' must be {_TYPE_NAMES[kind]}, got {value!r} "
                         f"({type(value).__name__})")
    return float(value) if kind is float else value


def _int_list(d: dict, key: str, where: str) -> list[int]:
    value = _get(d, key, where)
    if not isinstance(value, list) or not all(isinstance(n, int) and not isinstance(n, bool) for n in value):
        raise ValueError(f"config: '{where}{key}' must be a list of integers, got {value!r}")
    return value


def k3_file_fields(path: str | Path) -> dict:
    """`k3_fields` of a config.json (or of a folder's); errors and unknown-key warnings name the file."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config at {path}")
    try:
        d = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            cfg = k3_fields(d)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    for w in caught:  # stacklevel 3: the caller of K3Config.from_file
        warnings.warn(f"{path}: {w.message}", w.category, stacklevel=3)
    return cfg


def k3_fields(d: dict) -> dict:
    """`K3Config`'s fields from the released config.json layout (top level + `text_config` + optional
    `vision_config`). A bare text config (a dict with `linear_attn_config` at top level) is accepted too.
    """
    if not isinstance(d, dict):
        raise ValueError("config: expected a JSON object")
    nested = "text_config" in d
    t = d["text_config"] if nested else d
    _check(isinstance(t, dict), "text_config", "must be an object")
    v = d.get("vision_config")
    _check(v is None or isinstance(v, dict), "vision_config", "must be an object (or null)")
    if nested:
        _warn_unknown(d, TOP_KEYS, "")
        _warn_unknown(t, TEXT_KEYS, "text_config.")
    else:
        _warn_unknown(t, TEXT_KEYS | TOP_KEYS, "")
    if isinstance(t.get("linear_attn_config"), dict):
        _warn_unknown(t["linear_attn_config"], KDA_KEYS, "text_config.linear_attn_config.")
    if v:
        _warn_unknown(v, VISION_KEYS, "vision_config.")
    text = _text_from_hf(t)
    vision = _vision_from_hf(v) if v else None
    if vision is not None:
        _check(vision.text_hidden_size == text.hidden_size, "vision_config.text_hidden_size",
               f"({vision.text_hidden_size}) != text hidden_size ({text.hidden_size})")
    tw = "text_config." if nested else ""
    # special ids: the top level's, else text_config's (a config may keep them in one place only)
    ids = {key: _get(d, key, "", None, int) if key in d else _get(t, key, tw, None, int)
           for key in ("bos_token_id", "eos_token_id", "pad_token_id", "media_placeholder_token_id")}
    return dict(text=text, vision=vision, storage=_storage_from_hf(d, t, tw), **ids, hf=json.loads(json.dumps(d)))


def _warn_unknown(d: dict, known: frozenset[str], where: str) -> None:
    for key in d:
        if key not in known:
            near = difflib.get_close_matches(str(key), sorted(known), n=1)
            hint = f"; did you mean '{where}{near[0]}'?" if near else ""
            warnings.warn(f"config: unknown key '{where}{key}' is ignored{hint}", UserWarning, stacklevel=5)


def _storage_from_hf(d: dict, t: dict, tw: str) -> Storage:
    """The stored dtype (`dtype`, or the older `torch_dtype`; text_config's, else the top level's) and the expert
    format (`quantization_config`); `tw` is text_config's prefix in messages."""
    dtype = "bfloat16"
    for src, where in ((t, tw), (d, "")):
        key = next((k for k in ("dtype", "torch_dtype") if k in src), None)
        if key is not None:
            dtype = _get(src, key, where, kind=str).removeprefix("torch.")
            _check(dtype in STORED_DTYPES, where + key, f"must be one of {', '.join(STORED_DTYPES)}, got {src[key]!r}")
            break
    # a transformers-parsed config copies quantization_config up to the top level
    q = t.get("quantization_config", d.get("quantization_config")) or {}
    _check(isinstance(q, dict), tw + "quantization_config", "must be an object")
    fmt = q.get("format")
    _check(fmt in (None, "mxfp4-pack-quantized"), tw + "quantization_config.format",
           f"is '{fmt}'; only 'mxfp4-pack-quantized' is supported")
    return Storage(dtype=dtype, experts="mxfp4" if fmt else "bf16")


def _layer_types(lac: dict, num_layers: int) -> tuple[LayerType, ...]:
    kda = _int_list(lac, "kda_layers", "text_config.linear_attn_config.")
    full = _int_list(lac, "full_attn_layers", "text_config.linear_attn_config.")
    for name, lst in (("kda_layers", kda), ("full_attn_layers", full)):
        bad = [n for n in lst if not 1 <= n <= num_layers]
        _check(not bad, f"linear_attn_config.{name}", f"has entries outside 1..{num_layers}: {bad[:5]}")
    both = sorted(set(kda) & set(full))
    _check(not both, "linear_attn_config.kda_layers", f"and full_attn_layers both list layers {both[:5]}")
    neither = [n for n in range(1, num_layers + 1) if n not in set(kda) | set(full)]
    _check(not neither, "linear_attn_config.kda_layers", f"and full_attn_layers both miss layers {neither[:5]}")
    # the lists are 1-based: config layer n is checkpoint `layers.{n-1}`
    return tuple("kda" if (i + 1) in set(kda) else "mla" for i in range(num_layers))


def _text_from_hf(t: dict) -> TextConfig:
    w = "text_config."
    num_layers = _get(t, "num_hidden_layers", w, kind=int)
    act = _get(t, "hidden_act", w, kind=str)
    _check(act == "situ", w + "hidden_act", f"is '{act}'; only 'situ' is K3")
    lac = _get(t, "linear_attn_config", w)
    _check(isinstance(lac, dict), w + "linear_attn_config", "must be an object")
    _check(_get(t, "mla_use_nope", w, True) is True, w + "mla_use_nope", "must be true (K3's MLA has no RoPE)")
    _check(_get(t, "mla_use_output_gate", w, True) is True, w + "mla_use_output_gate", "must be true for K3")
    _check(_get(lac, "use_full_rank_gate", w + "linear_attn_config.", True) is True,
           w + "linear_attn_config.use_full_rank_gate", "must be true (K3's KDA output gate is full rank)")
    router = _get(t, "moe_router_activation_func", w, "sigmoid", str)
    _check(router == "sigmoid", w + "moe_router_activation_func", f"is '{router}'; K3 routes with sigmoid")
    for key in ("num_expert_group", "topk_group"):
        _check(_get(t, key, w, 1, int) == 1, w + key, "must be 1 (grouped routing is not part of K3)")
    heads = _get(t, "num_attention_heads", w, kind=int)
    _check(_get(t, "num_key_value_heads", w, heads, int) == heads, w + "num_key_value_heads",
           "must equal num_attention_heads (K3's MLA is MHA)")

    where = w + "linear_attn_config."
    kda_heads = _get(lac, "num_heads", where, kind=int)
    kda = KDAConfig(
        num_heads=kda_heads,
        head_dim=_get(lac, "head_dim", where, kind=int),
        short_conv_kernel_size=_get(lac, "short_conv_kernel_size", where, kind=int),
        gate_lower_bound=_get(lac, "gate_lower_bound", where, kind=float),
        a_log_size=-(-kda_heads // A_LOG_PAD) * A_LOG_PAD,
    )
    mla = MLAConfig(
        num_heads=heads,
        q_lora_rank=_get(t, "q_lora_rank", w, kind=int),
        kv_lora_rank=_get(t, "kv_lora_rank", w, kind=int),
        qk_nope_head_dim=_get(t, "qk_nope_head_dim", w, kind=int),
        qk_rope_head_dim=_get(t, "qk_rope_head_dim", w, kind=int),
        v_head_dim=_get(t, "v_head_dim", w, kind=int),
    )
    moe = MoEConfig(
        num_experts=_get(t, "num_experts", w, kind=int),
        num_experts_per_token=_get(t, "num_experts_per_token", w, kind=int),
        expert_dim=_get(t, "moe_intermediate_size", w, kind=int),
        latent_dim=_get(t, "routed_expert_hidden_size", w, kind=int),
        num_shared_experts=_get(t, "num_shared_experts", w, kind=int),
        routed_scaling_factor=_get(t, "routed_scaling_factor", w, kind=float),
        renormalize=_get(t, "moe_renormalize", w, kind=bool),
        use_latent_norm=_get(t, "latent_moe_use_norm", w, kind=bool),
    )
    first_dense = _get(t, "first_k_dense_replace", w, kind=int)
    freq = _get(t, "moe_layer_freq", w, kind=int)
    _check(freq >= 1, w + "moe_layer_freq", f"must be a positive integer (got {freq})")
    _check(not _get(t, "tie_word_embeddings", w, False, bool), w + "tie_word_embeddings",
           "must be false: K3's LM head is its own tensor (lm_head.weight)")
    return TextConfig(
        vocab_size=_get(t, "vocab_size", w, kind=int),
        hidden_size=_get(t, "hidden_size", w, kind=int),
        intermediate_size=_get(t, "intermediate_size", w, kind=int),
        num_layers=num_layers,
        layer_types=_layer_types(lac, num_layers),
        moe_layers=tuple(i >= first_dense and i % freq == 0 for i in range(num_layers)),
        rms_norm_eps=_get(t, "rms_norm_eps", w, kind=float),
        situ_beta=_get(t, "activation_situ_beta", w, kind=float),
        situ_linear_beta=_get(t, "activation_situ_linear_beta", w, kind=float),
        attn_res_block_size=_get(t, "attn_res_block_size", w, kind=int),
        pad_token_id=_get(t, "pad_token_id", w, None, int),
        kda=kda,
        mla=mla,
        moe=moe,
        initializer_range=_get(t, "initializer_range", w, 0.02, float),
        max_position_embeddings=_get(t, "max_position_embeddings", w, None, int),
    )


def _vision_from_hf(v: dict) -> VisionConfig:
    w = "vision_config."
    for key, expected in (("pos_emb_type", "divided_fixed"), ("merge_type", "sd2_tpool"),
                          ("mm_projector_type", "patchmergerv2"), ("norm_type", "rmsnorm"),
                          ("activation_func", "gelu_pytorch_tanh"), ("pos_emb_interpolation_mode", "bilinear")):
        got = _get(v, key, w, expected)
        _check(got == expected, w + key, f"is '{got}'; K3's tower uses '{expected}'")
    mk = tuple(_int_list(v, "merge_kernel_size", w))
    _check(mk == (2, 2), w + "merge_kernel_size", f"is {list(mk)}; K3 merges 2x2")
    return VisionConfig(
        patch_size=_get(v, "patch_size", w, kind=int),
        hidden_size=_get(v, "vt_hidden_size", w, kind=int),
        intermediate_size=_get(v, "vt_intermediate_size", w, kind=int),
        num_heads=_get(v, "vt_num_attention_heads", w, kind=int),
        num_layers=_get(v, "vt_num_hidden_layers", w, kind=int),
        qkv_hidden_size=_get(v, "qkv_hidden_size", w, kind=int),
        pos_emb_height=_get(v, "init_pos_emb_height", w, kind=int),
        pos_emb_width=_get(v, "init_pos_emb_width", w, kind=int),
        pos_emb_time=_get(v, "init_pos_emb_time", w, kind=int),
        merge_kernel_size=mk,
        mm_hidden_size=_get(v, "mm_hidden_size", w, kind=int),
        text_hidden_size=_get(v, "text_hidden_size", w, kind=int),
        projector_ln_eps=_get(v, "projector_ln_eps", w, kind=float),
    )
