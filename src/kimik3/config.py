"""The K3 configuration tree: frozen dataclasses, built from the released `config.json` and validated once.

`K3Config.from_hf(dict)` is the only place where HF key names, nesting and the 1-based `kda_layers` /
`full_attn_layers` lists are translated; everything else reads `TextConfig.layer_types` and
`TextConfig.moe_layers`. Runtime knobs (device, dtype, backend, batch limits) are not model config.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

LayerType = Literal["kda", "mla"]

_MISSING = object()


def _get(d: dict, key: str, where: str, default: Any = _MISSING) -> Any:
    if key in d:
        return d[key]
    if default is _MISSING:
        raise ValueError(f"config: missing required field '{where}{key}'")
    return default


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
        a_log_size: stored length of `A_log`; the first `num_heads` entries are used. The released checkpoint
            stores 128 for 96 heads. Uncertain which rule produced 128: we read it as "padded up to head_dim"
            (max(num_heads, head_dim)), which reproduces the released inventory.
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
        experts_quantization: "mxfp4" when routed experts are stored MXFP4-packed, else None (bf16).
        dtype: the checkpoint's compute dtype name ("bfloat16").
        max_position_embeddings: the most tokens (prompt + generated) a sequence may hold, as trained
            (K3 has no positional encoding, so nothing breaks past it; generation still stops there).
            None when the config does not say.
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
    experts_quantization: str | None = None
    dtype: str = "bfloat16"
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
        if self.experts_quantization == "mxfp4":
            for name, dim in (("routed_expert_hidden_size", self.moe.latent_dim),
                              ("moe_intermediate_size", self.moe.expert_dim)):
                _check(dim % 32 == 0, name, f"({dim}) must be a multiple of the MXFP4 group size 32")
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
class K3Config:
    """The whole model: text (always) and vision (None for a text-only config).

    Attributes:
        text, vision: the sub-configs.
        bos_token_id, eos_token_id, pad_token_id, media_placeholder_token_id: special ids.
        hf: the dict this was built from, kept so a writer can emit the same config.json.
    """

    text: TextConfig
    vision: VisionConfig | None
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    media_placeholder_token_id: int | None
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
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        return cls.from_hf(d)

    @classmethod
    def from_hf(cls, d: dict) -> "K3Config":
        """Build from the released config.json layout (top level + `text_config` + optional `vision_config`).

        A bare text config (a dict with `linear_attn_config` at top level) is accepted too.
        """
        if not isinstance(d, dict):
            raise ValueError("config: expected a JSON object")
        t = d["text_config"] if "text_config" in d else d
        text = _text_from_hf(t)
        v = d.get("vision_config")
        vision = _vision_from_hf(v) if v else None
        if vision is not None:
            _check(vision.text_hidden_size == text.hidden_size, "vision_config.text_hidden_size",
                   f"({vision.text_hidden_size}) != text hidden_size ({text.hidden_size})")
        return cls(
            text=text,
            vision=vision,
            bos_token_id=d.get("bos_token_id", t.get("bos_token_id")),
            eos_token_id=d.get("eos_token_id", t.get("eos_token_id")),
            pad_token_id=d.get("pad_token_id", t.get("pad_token_id")),
            media_placeholder_token_id=d.get("media_placeholder_token_id"),
            hf=json.loads(json.dumps(d)),
        )


def _layer_types(lac: dict, num_layers: int) -> tuple[LayerType, ...]:
    kda = _get(lac, "kda_layers", "linear_attn_config.")
    full = _get(lac, "full_attn_layers", "linear_attn_config.")
    for name, lst in (("kda_layers", kda), ("full_attn_layers", full)):
        bad = [n for n in lst if not isinstance(n, int) or not 1 <= n <= num_layers]
        _check(not bad, f"linear_attn_config.{name}", f"has entries outside 1..{num_layers}: {bad[:5]}")
    both = sorted(set(kda) & set(full))
    _check(not both, "linear_attn_config.kda_layers", f"and full_attn_layers both list layers {both[:5]}")
    neither = [n for n in range(1, num_layers + 1) if n not in set(kda) | set(full)]
    _check(not neither, "linear_attn_config.kda_layers", f"and full_attn_layers both miss layers {neither[:5]}")
    # the lists are 1-based: config layer n is checkpoint `layers.{n-1}`
    return tuple("kda" if (i + 1) in set(kda) else "mla" for i in range(num_layers))


def _text_from_hf(t: dict) -> TextConfig:
    w = "text_config."
    num_layers = _get(t, "num_hidden_layers", w)
    act = _get(t, "hidden_act", w)
    _check(act == "situ", w + "hidden_act", f"is '{act}'; only 'situ' is K3")
    lac = _get(t, "linear_attn_config", w)
    _check(isinstance(lac, dict), w + "linear_attn_config", "must be an object")
    _check(_get(t, "mla_use_nope", w, True) is True, w + "mla_use_nope", "must be true (K3's MLA has no RoPE)")
    _check(_get(t, "mla_use_output_gate", w, True) is True, w + "mla_use_output_gate", "must be true for K3")
    _check(_get(lac, "use_full_rank_gate", w + "linear_attn_config.", True) is True,
           w + "linear_attn_config.use_full_rank_gate", "must be true (K3's KDA output gate is full rank)")
    router = _get(t, "moe_router_activation_func", w, "sigmoid")
    _check(router == "sigmoid", w + "moe_router_activation_func", f"is '{router}'; K3 routes with sigmoid")
    for key in ("num_expert_group", "topk_group"):
        _check(_get(t, key, w, 1) == 1, w + key, "must be 1 (grouped routing is not part of K3)")
    heads = _get(t, "num_attention_heads", w)
    _check(_get(t, "num_key_value_heads", w, heads) == heads, w + "num_key_value_heads",
           "must equal num_attention_heads (K3's MLA is MHA)")

    where = w + "linear_attn_config."
    kda_heads, kda_dim = _get(lac, "num_heads", where), _get(lac, "head_dim", where)
    kda = KDAConfig(
        num_heads=kda_heads,
        head_dim=kda_dim,
        short_conv_kernel_size=_get(lac, "short_conv_kernel_size", w + "linear_attn_config."),
        gate_lower_bound=float(_get(lac, "gate_lower_bound", w + "linear_attn_config.")),
        a_log_size=max(kda_heads, kda_dim),
    )
    mla = MLAConfig(
        num_heads=heads,
        q_lora_rank=_get(t, "q_lora_rank", w),
        kv_lora_rank=_get(t, "kv_lora_rank", w),
        qk_nope_head_dim=_get(t, "qk_nope_head_dim", w),
        qk_rope_head_dim=_get(t, "qk_rope_head_dim", w),
        v_head_dim=_get(t, "v_head_dim", w),
    )
    _check(isinstance(mla.q_lora_rank, int), w + "q_lora_rank", "must be an integer (K3 uses a query latent)")
    moe = MoEConfig(
        num_experts=_get(t, "num_experts", w),
        num_experts_per_token=_get(t, "num_experts_per_token", w),
        expert_dim=_get(t, "moe_intermediate_size", w),
        latent_dim=_get(t, "routed_expert_hidden_size", w),
        num_shared_experts=_get(t, "num_shared_experts", w),
        routed_scaling_factor=float(_get(t, "routed_scaling_factor", w)),
        renormalize=bool(_get(t, "moe_renormalize", w)),
        use_latent_norm=bool(_get(t, "latent_moe_use_norm", w)),
    )
    first_dense = _get(t, "first_k_dense_replace", w)
    freq = _get(t, "moe_layer_freq", w)
    _check(isinstance(freq, int) and freq >= 1, w + "moe_layer_freq", f"must be a positive integer (got {freq})")
    q = t.get("quantization_config") or {}
    fmt = q.get("format")
    _check(fmt in (None, "mxfp4-pack-quantized"), w + "quantization_config.format",
           f"is '{fmt}'; only 'mxfp4-pack-quantized' is supported")
    return TextConfig(
        vocab_size=_get(t, "vocab_size", w),
        hidden_size=_get(t, "hidden_size", w),
        intermediate_size=_get(t, "intermediate_size", w),
        num_layers=num_layers,
        layer_types=_layer_types(lac, num_layers),
        moe_layers=tuple(i >= first_dense and i % freq == 0 for i in range(num_layers)),
        rms_norm_eps=float(_get(t, "rms_norm_eps", w)),
        situ_beta=float(_get(t, "activation_situ_beta", w)),
        situ_linear_beta=float(_get(t, "activation_situ_linear_beta", w)),
        attn_res_block_size=_get(t, "attn_res_block_size", w),
        pad_token_id=t.get("pad_token_id"),
        tie_word_embeddings=bool(t.get("tie_word_embeddings", False)),
        kda=kda,
        mla=mla,
        moe=moe,
        experts_quantization="mxfp4" if fmt else None,
        dtype=t.get("dtype", t.get("torch_dtype", "bfloat16")),
        initializer_range=float(t.get("initializer_range", 0.02)),
        max_position_embeddings=t.get("max_position_embeddings"),
    )


def _vision_from_hf(v: dict) -> VisionConfig:
    w = "vision_config."
    for key, expected in (("pos_emb_type", "divided_fixed"), ("merge_type", "sd2_tpool"),
                          ("mm_projector_type", "patchmergerv2"), ("norm_type", "rmsnorm"),
                          ("activation_func", "gelu_pytorch_tanh"), ("pos_emb_interpolation_mode", "bilinear")):
        got = _get(v, key, w, expected)
        _check(got == expected, w + key, f"is '{got}'; K3's tower uses '{expected}'")
    mk = tuple(_get(v, "merge_kernel_size", w))
    _check(mk == (2, 2), w + "merge_kernel_size", f"is {list(mk)}; K3 merges 2x2")
    return VisionConfig(
        patch_size=_get(v, "patch_size", w),
        hidden_size=_get(v, "vt_hidden_size", w),
        intermediate_size=_get(v, "vt_intermediate_size", w),
        num_heads=_get(v, "vt_num_attention_heads", w),
        num_layers=_get(v, "vt_num_hidden_layers", w),
        qkv_hidden_size=_get(v, "qkv_hidden_size", w),
        pos_emb_height=_get(v, "init_pos_emb_height", w),
        pos_emb_width=_get(v, "init_pos_emb_width", w),
        pos_emb_time=_get(v, "init_pos_emb_time", w),
        merge_kernel_size=mk,
        mm_hidden_size=_get(v, "mm_hidden_size", w),
        text_hidden_size=_get(v, "text_hidden_size", w),
        projector_ln_eps=float(_get(v, "projector_ln_eps", w)),
    )
