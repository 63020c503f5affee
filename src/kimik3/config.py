"""The K3 configuration tree: frozen dataclasses, built from the released `config.json` and validated once.

`K3Config.from_hf(dict)` is the only place where HF key names, nesting and the 1-based `kda_layers` /
`full_attn_layers` lists are translated; everything else reads `TextConfig.layer_types` and
`TextConfig.moe_layers`. Runtime knobs (device, dtype, backend, batch limits) are not model config.
"""

from __future__ import annotations

import difflib
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

LayerType = Literal["kda", "mla"]
# how routed experts are stored in a checkpoint folder: MXFP4 `weight_packed` + `weight_scale` (as released) or
# dense `weight` tensors; the one vocabulary of save, convert, inspect and the checkpoint specs
ExpertFormat = Literal["mxfp4", "bf16"]
EXPERT_FORMATS: tuple[ExpertFormat, ...] = ("mxfp4", "bf16")
STORED_DTYPES = ("bfloat16", "float32", "float16")
# `A_log` is stored padded to a multiple of 128 entries (the release: 128 for 96 heads; other implementations
# pad the same way); only the first num_heads are used
A_LOG_PAD = 128

_MISSING = object()
_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


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


def _check(cond: bool, field_name: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"config: '{field_name}' {msg}")


@dataclass(frozen=True, kw_only=True)
class KDAConfig:
    """Kimi Delta Attention layers.

    Attributes:
        num_heads: KDA heads H (96).
        head_dim: key = value head dim K = V (128); also the rank of the low-rank decay gate f_a -> f_b.
        short_conv_kernel_size: causal depthwise conv width on q, k, v (4).
        gate_lower_bound: the decay is `lower_bound * sigmoid(...)` (-5.0).
        a_log_size: length of the `A_log` parameter; the first `num_heads` entries are used. It is num_heads
            rounded up to a multiple of A_LOG_PAD (128), as released (128 for 96 heads) and as other
            implementations write it; the loader accepts any stored length >= num_heads.
    """

    num_heads: int
    head_dim: int
    short_conv_kernel_size: int
    gate_lower_bound: float
    a_log_size: int

    @property
    def proj_dim(self) -> int:
        return self.num_heads * self.head_dim


@dataclass(frozen=True, kw_only=True)
class MLAConfig:
    """Gated NoPE multi-head latent attention layers (no RoPE anywhere; the 'rope' slot is a shared key).

    Attributes:
        num_heads: attention heads (96, MHA).
        q_lora_rank: query latent width (1536).
        kv_lora_rank: key/value latent width C (512).
        qk_nope_head_dim: per-head key/query part from the latent (128).
        qk_rope_head_dim: per-head query part matched by one shared 64-wide key per token (64).
        v_head_dim: value head dim (128).
    """

    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    latent_norm_eps: float = 1e-6  # the reference builds q_a/kv_a norms without eps: class default 1e-6

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim**-0.5


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """Latent mixture of experts (layers with `moe_layers[i]`).

    Attributes:
        num_experts: routed experts E (896).
        num_experts_per_token: top-k A (16).
        expert_dim: routed expert width F (`moe_intermediate_size`, 3072).
        latent_dim: routed experts work in this width L (`routed_expert_hidden_size`, 3584).
        num_shared_experts: width multiplier of the one shared SiTU MLP (2 -> 2 * F wide).
        routed_scaling_factor: multiplies the renormalized routing weights (1.0).
        renormalize: divide the selected weights by their sum (top-k > 1).
        use_latent_norm: RMSNorm on the combined latent output before the up projection.
    """

    num_experts: int
    num_experts_per_token: int
    expert_dim: int
    latent_dim: int
    num_shared_experts: int
    routed_scaling_factor: float
    renormalize: bool
    use_latent_norm: bool

    @property
    def shared_dim(self) -> int:
        return self.num_shared_experts * self.expert_dim


@dataclass(frozen=True, kw_only=True)
class TextConfig:
    """The language model.

    Attributes:
        vocab_size, hidden_size (D), intermediate_size (layer-0 dense MLP), num_layers.
        layer_types: per 0-based layer, "kda" or "mla" (translated once from the 1-based HF lists).
        moe_layers: per layer, True where the FFN is the latent MoE (else the dense MLP).
        rms_norm_eps: eps of every text RMSNorm except the MLA latent norms (see MLAConfig).
        situ_beta, situ_linear_beta: SiTU-GLU constants (4.0, 25.0).
        attn_res_block_size: layers per attention-residual block (12).
        pad_token_id: padding row of the embedding.
        tie_word_embeddings: always False for K3 (the LM head is its own tensor).
        initializer_range: std of the random init (training from scratch).
        max_position_embeddings: the most tokens (prompt + generated) a sequence may hold, as trained
            (K3 has no positional encoding, so nothing breaks past it; generation still stops there).
            None when the config does not say.

    How a checkpoint stores the weights (dtype, expert format) is not model config: see `Storage`.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    layer_types: tuple[LayerType, ...]
    moe_layers: tuple[bool, ...]
    rms_norm_eps: float
    situ_beta: float
    situ_linear_beta: float
    attn_res_block_size: int
    pad_token_id: int | None
    tie_word_embeddings: bool
    kda: KDAConfig
    mla: MLAConfig
    moe: MoEConfig
    initializer_range: float = 0.02
    max_position_embeddings: int | None = None

    def __post_init__(self) -> None:
        _check(len(self.layer_types) == self.num_layers, "num_hidden_layers", "does not match the layer lists")
        _check(len(self.moe_layers) == self.num_layers, "num_hidden_layers", "does not match moe_layers")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "attn_res_block_size"):
            _check(getattr(self, name) > 0, name, "must be positive")
        m = self.max_position_embeddings
        _check(m is None or (isinstance(m, int) and not isinstance(m, bool) and m > 0), "max_position_embeddings",
               f"must be a positive integer (got {m!r})")
        for cfg in (self.kda, self.mla, self.moe):
            for k, v in vars(cfg).items():
                if isinstance(v, int) and not isinstance(v, bool):
                    _check(v > 0, k, f"must be positive (got {v})")
        _check(self.moe.num_experts_per_token <= self.moe.num_experts, "num_experts_per_token",
               f"({self.moe.num_experts_per_token}) exceeds num_experts ({self.moe.num_experts})")
        _check(self.kda.a_log_size >= self.kda.num_heads, "A_log", "is shorter than the KDA heads")
        _check(self.pad_token_id is None or 0 <= self.pad_token_id < self.vocab_size, "pad_token_id",
               f"({self.pad_token_id}) is outside the vocabulary ({self.vocab_size})")

    @property
    def snapshot_layers(self) -> tuple[int, ...]:
        """Layers at whose start the running block sum is stored as an AttnRes source."""
        return tuple(range(0, self.num_layers, self.attn_res_block_size))


@dataclass(frozen=True, kw_only=True)
class VisionConfig:
    """MoonViT-V2 tower and the patch-merger projector (see spec section 4)."""

    patch_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_layers: int
    qkv_hidden_size: int
    pos_emb_height: int
    pos_emb_width: int
    pos_emb_time: int
    merge_kernel_size: tuple[int, int]
    mm_hidden_size: int
    text_hidden_size: int
    projector_ln_eps: float

    def __post_init__(self) -> None:
        _check(self.qkv_hidden_size % self.num_heads == 0, "qkv_hidden_size",
               f"({self.qkv_hidden_size}) must divide by vt_num_attention_heads ({self.num_heads})")
        _check((self.qkv_hidden_size // self.num_heads) % 4 == 0, "qkv_hidden_size",
               "per-head dim must be a multiple of 4 for the 2-D RoPE")

    @property
    def head_dim(self) -> int:
        return self.qkv_hidden_size // self.num_heads


@dataclass(frozen=True, kw_only=True)
class Storage:
    """How a checkpoint folder stores the weights (read from and written to config.json by `kimik3.checkpoint`).

    These describe the files, not the model: the same model may be stored in bf16 or fp32, with MXFP4 or
    dense experts, and two configs that differ only here describe the same model.

    Attributes:
        dtype: stored dtype of every tensor outside the fp32 islands (config.json `dtype`), one of
            STORED_DTYPES.
        experts: routed expert format, "mxfp4" when text_config has the MXFP4 `quantization_config`.
    """

    dtype: str = "bfloat16"
    experts: ExpertFormat = "bf16"

    def __post_init__(self) -> None:
        _check(self.dtype in STORED_DTYPES, "dtype", f"must be one of {', '.join(STORED_DTYPES)}, got {self.dtype!r}")
        _check(self.experts in EXPERT_FORMATS, "quantization_config",
               f"gives experts {self.experts!r}; expected one of {EXPERT_FORMATS}")


@dataclass(frozen=True, kw_only=True)
class K3Config:
    """The whole model: text (always) and vision (None for a text-only config), and how it is stored.

    Attributes:
        text, vision: the sub-configs.
        bos_token_id, eos_token_id, pad_token_id, media_placeholder_token_id: special ids.
        storage: the checkpoint's stored dtype and expert format (not the model's math).
        hf: the dict this was built from, kept so a writer can emit the same config.json.
    """

    text: TextConfig
    vision: VisionConfig | None
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    media_placeholder_token_id: int | None
    storage: Storage = field(default_factory=Storage)
    hf: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_file(cls, path: str | Path) -> "K3Config":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config at {path}")
        try:
            d = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        # errors and unknown-key warnings name the file
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                cfg = cls.from_hf(d)
            except ValueError as e:
                raise ValueError(f"{path}: {e}") from None
        for w in caught:
            warnings.warn(f"{path}: {w.message}", w.category, stacklevel=2)
        return cfg

    @classmethod
    def from_hf(cls, d: dict) -> "K3Config":
        """Build from the released config.json layout (top level + `text_config` + optional `vision_config`).

        A bare text config (a dict with `linear_attn_config` at top level) is accepted too. A value of the
        wrong type is a ValueError naming the field; an unknown key is a warning naming the closest known one.
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
        return cls(text=text, vision=vision, storage=_storage_from_hf(d, t, tw), **ids, hf=json.loads(json.dumps(d)))


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


def _warn_unknown(d: dict, known: frozenset[str], where: str) -> None:
    for key in d:
        if key not in known:
            near = difflib.get_close_matches(str(key), sorted(known), n=1)
            hint = f"; did you mean '{where}{near[0]}'?" if near else ""
            warnings.warn(f"config: unknown key '{where}{key}' is ignored{hint}", UserWarning, stacklevel=4)


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
        tie_word_embeddings=_get(t, "tie_word_embeddings", w, False, bool),
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
