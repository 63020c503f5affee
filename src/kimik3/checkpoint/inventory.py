"""What a checkpoint folder should hold, given its config, and how what it does hold differs.

The expected tensors are `checkpoint_specs` of the model built on the meta device in the checkpoint's
dtype (`cfg.storage.dtype`; the fp32 islands stay fp32), with the routed experts in the stored format
(`cfg.storage.experts`: MXFP4 `weight_packed`/`weight_scale`, or dense `weight`).

One tolerated difference: KDA `A_log` may be stored at any length >= num_heads (implementations pad it
differently; only the first num_heads are used). Such a tensor is `padded`, a note, not a mismatch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from kimik3.checkpoint.keys import TensorSpec, checkpoint_specs, is_vision_key
from kimik3.checkpoint.safetensors_header import TensorEntry
from kimik3.config import ExpertFormat, K3Config
from kimik3.model import K3ForCausalLM, K3ForConditionalGeneration

FLOAT_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32,
                "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(dtype: torch.dtype | str | None, what: str = "dtype") -> torch.dtype | None:
    """None, a torch float dtype, or a name ('bfloat16', 'bf16', 'float32', ...) -> torch dtype or None."""
    if dtype is None:
        return None
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in FLOAT_DTYPES:
        return FLOAT_DTYPES[dtype.removeprefix("torch.")]
    if isinstance(dtype, torch.dtype) and dtype in FLOAT_DTYPES.values():
        return dtype
    raise ValueError(f"{what} must be bfloat16, float32 or float16 (a torch dtype or its name), got {dtype!r}")


def stored_dtype(cfg: K3Config) -> torch.dtype:
    """The dtype config.json declares for the checkpoint's non-fp32-island tensors."""
    return parse_dtype(cfg.storage.dtype, "config.json 'dtype'")


def without_vision(cfg: K3Config) -> K3Config:
    """The same config without its vision part (the model built from it has no vision modules)."""
    return replace(cfg, vision=None)


def has_vision_tensors(cfg: K3Config, tensor_names) -> bool:
    """What `text_only=None` means: load the vision tower and projector when the config has a vision part AND
    the shards hold any of its tensors (a partial set is then reported as missing tensors)."""
    return cfg.vision is not None and any(is_vision_key(n) for n in tensor_names)


def model_specs(model: torch.nn.Module, experts: ExpertFormat, dtype: torch.dtype) -> list[TensorSpec]:
    """`checkpoint_specs` of a meta twin of `model` built from its config in `dtype` (islands stay fp32).

    The twin has a vision tower exactly when `model` has one (a text-only build of a vision config has none).
    """
    with torch.device("meta"):
        if isinstance(model, K3ForConditionalGeneration):
            has_vision = any(is_vision_key(name) for name in model.state_dict(keep_vars=True))
            twin = K3ForConditionalGeneration(model.config if has_vision else without_vision(model.config), dtype)
        else:
            twin = K3ForCausalLM(model.config, dtype)
    return checkpoint_specs(twin, experts)


def expected_specs(cfg: K3Config, *, vision: bool) -> list[TensorSpec]:
    """Every tensor a checkpoint with this config.json holds (text; + vision and projector if `vision`)."""
    with torch.device("meta"):
        model = K3ForConditionalGeneration(cfg if vision else without_vision(cfg), stored_dtype(cfg))
    return checkpoint_specs(model, cfg.storage.experts)


def a_log_heads(cfg: K3Config) -> dict[str, int]:
    """Checkpoint name of every KDA layer's `A_log` -> the heads it must cover (any longer length loads)."""
    return {f"language_model.model.layers.{i}.self_attn.A_log": cfg.text.kda.num_heads
            for i, kind in enumerate(cfg.text.layer_types) if kind == "kda"}


@dataclass
class Mismatch:
    """Differences between the expected tensors and those found in the shard headers."""

    missing: list[TensorSpec] = field(default_factory=list)
    unexpected: list[TensorEntry] = field(default_factory=list)
    wrong: list[tuple[TensorSpec, TensorEntry]] = field(default_factory=list)  # shape or dtype differs
    padded: list[tuple[TensorSpec, TensorEntry]] = field(default_factory=list)  # A_log of another length: fine

    def __bool__(self) -> bool:
        return bool(self.missing or self.unexpected or self.wrong)

    @property
    def wrong_shape(self) -> list[tuple[TensorSpec, TensorEntry]]:
        return [(s, e) for s, e in self.wrong if e.shape != s.shape]

    @property
    def wrong_dtype(self) -> list[tuple[TensorSpec, TensorEntry]]:
        return [(s, e) for s, e in self.wrong if e.shape == s.shape]

    @property
    def files(self) -> list[str]:
        return sorted({e.file for e in self.unexpected} | {e.file for _, e in self.wrong})


def compare(expected: list[TensorSpec], found: dict[str, TensorEntry],
            min_length: dict[str, int] | None = None) -> Mismatch:
    """Expected vs found tensors; a 1-D tensor named in `min_length` may be stored at any length >= its value
    (`a_log_heads`): a different such length is `padded`, not `wrong`."""
    out = Mismatch()
    want = {s.name: s for s in expected}
    min_length = min_length or {}
    for name, spec in want.items():
        entry = found.get(name)
        if entry is None:
            out.missing.append(spec)
        elif entry.dtype == spec.dtype and entry.shape != spec.shape and name in min_length and \
                len(entry.shape) == 1 and entry.shape[0] >= min_length[name]:
            out.padded.append((spec, entry))
        elif entry.shape != spec.shape or entry.dtype != spec.dtype:
            out.wrong.append((spec, entry))
    out.unexpected = [e for name, e in found.items() if name not in want]
    return out


def _fmt(shape: tuple[int, ...], dtype: torch.dtype) -> str:
    return f"{list(shape)} {str(dtype).removeprefix('torch.')}"


def difference_lines(m: Mismatch, limit: int | None = 3) -> list[str]:
    """Readable lines for the first `limit` of EACH kind of difference (missing, unexpected, wrong shape, wrong
    dtype), so one wrong tensor is never hidden behind a long list of missing ones."""
    lines = [f"  missing     {s.name}: expected {_fmt(s.shape, s.dtype)}" for s in m.missing[:limit]]
    lines += [f"  unexpected  {e.name} in {e.file}: {_fmt(e.shape, e.dtype)}" for e in m.unexpected[:limit]]
    for kind, pairs in (("shape", m.wrong_shape), ("dtype", m.wrong_dtype)):
        lines += [f"  wrong {kind} {s.name} in {e.file}: expected {_fmt(s.shape, s.dtype)}, found "
                  f"{_fmt(e.shape, e.dtype)}" for s, e in pairs[:limit]]
    return lines


def padding_note(m: Mismatch) -> str | None:
    """One line about A_log tensors stored at another length than we write (a note, not a difference)."""
    if not m.padded:
        return None
    lengths = sorted({e.shape[0] for _, e in m.padded})
    return (f"{len(m.padded)} A_log tensors are stored with length {', '.join(map(str, lengths))} (this "
            f"implementation writes {m.padded[0][0].shape[0]}); only the first num_heads are used: padding, "
            "not a difference")


def _experts_hint(m: Mismatch, experts: ExpertFormat) -> str:
    dense = any(e.name.endswith("experts.0.w1.weight") for e in m.unexpected)
    packed = any(e.name.endswith("experts.0.w1.weight_packed") for e in m.unexpected)
    if experts == "mxfp4" and dense:
        return ("\n  (config.json's quantization_config says the routed experts are MXFP4, but the shards hold "
                "dense '.weight' experts: drop quantization_config from text_config)")
    if experts == "bf16" and packed:
        return ("\n  (the shards hold MXFP4 experts but config.json's text_config has no quantization_config)")
    return ""


def mismatch_error(where: str, m: Mismatch, cfg: K3Config) -> ValueError:
    """One ValueError naming the files and the first offending tensors, expected vs found."""
    files = ", ".join(m.files[:4]) + (f" and {len(m.files) - 4} more" if len(m.files) > 4 else "")
    experts = cfg.storage.experts
    head = (f"{where}: the weights do not match config.json (dtype {cfg.storage.dtype}, experts {experts}): "
            f"{len(m.missing)} missing, {len(m.unexpected)} unexpected, {len(m.wrong_shape)} with the wrong "
            f"shape, {len(m.wrong_dtype)} with the wrong dtype" + (f"; offending shards: {files}" if files else ""))
    return ValueError("\n".join([head, *difference_lines(m)]) + _experts_hint(m, experts))
