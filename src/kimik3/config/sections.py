"""The parts of the K3 configuration tree (text with its KDA, MLA and MoE sections; vision; storage): frozen
dataclasses, each validating its own values once. `kimik3.config.tree.K3Config` holds them; `kimik3.config.hf`
builds them from the released config.json.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

LayerType = Literal["kda", "mla"]
# how routed experts are stored in a checkpoint folder: MXFP4 `weight_packed` + `weight_scale` (as released) or
# dense `weight` tensors; the one vocabulary of save, convert, inspect and the checkpoint specs
ExpertFormat = Literal["mxfp4", "bf16"]
EXPERT_FORMATS: tuple[ExpertFormat, ...] = ("mxfp4", "bf16")
STORED_DTYPES = ("bfloat16", "float32", "float16")
# `A_log` is stored padded to a multiple of 128 entries (the release: 128 for 96 heads; other implementations
# pad the same way); only the first num_heads are used
A_LOG_PAD = 128


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
