"""What a checkpoint folder should hold, given its config, and how what it does hold differs.

The expected tensors are `checkpoint_specs` of the model built on the meta device in the checkpoint's
dtype (config.json `dtype`; the fp32 islands stay fp32), with the routed experts in the stored format
(`quantization_config` present: MXFP4 `weight_packed`/`weight_scale`, absent: dense `weight`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from kimik3.checkpoint.keys import TensorSpec, checkpoint_specs, is_vision_key
from kimik3.checkpoint.safetensors_header import TensorEntry
from kimik3.config import K3Config
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
    return parse_dtype(cfg.text.dtype, "config.json 'dtype'")


def stored_experts(cfg: K3Config) -> str:
    """'mxfp4' when config.json's text_config has the MXFP4 quantization_config, else 'bf16' (dense)."""
    return "mxfp4" if cfg.text.experts_quantization == "mxfp4" else "bf16"


def without_vision(cfg: K3Config) -> K3Config:
    """The same config without its vision part (the model built from it has no vision modules)."""
    return replace(cfg, vision=None)


def model_specs(model: torch.nn.Module, experts: str, dtype: torch.dtype) -> list[TensorSpec]:
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
    return checkpoint_specs(model, stored_experts(cfg))


@dataclass
class Mismatch:
    """Differences between the expected tensors and those found in the shard headers."""

    missing: list[TensorSpec] = field(default_factory=list)
    unexpected: list[TensorEntry] = field(default_factory=list)
    wrong: list[tuple[TensorSpec, TensorEntry]] = field(default_factory=list)  # shape or dtype differs

    def __bool__(self) -> bool:
        return bool(self.missing or self.unexpected or self.wrong)

    @property
    def files(self) -> list[str]:
        return sorted({e.file for e in self.unexpected} | {e.file for _, e in self.wrong})


def compare(expected: list[TensorSpec], found: dict[str, TensorEntry]) -> Mismatch:
    out = Mismatch()
    want = {s.name: s for s in expected}
    for name, spec in want.items():
        entry = found.get(name)
        if entry is None:
            out.missing.append(spec)
        elif entry.shape != spec.shape or entry.dtype != spec.dtype:
            out.wrong.append((spec, entry))
    out.unexpected = [e for name, e in found.items() if name not in want]
    return out


def _fmt(shape: tuple[int, ...], dtype: torch.dtype) -> str:
    return f"{list(shape)} {str(dtype).removeprefix('torch.')}"


def difference_lines(m: Mismatch, limit: int | None = 3) -> list[str]:
    """Readable lines for (the first `limit` of) each kind of difference."""
    lines = [f"  missing     {s.name}: expected {_fmt(s.shape, s.dtype)}" for s in m.missing[:limit]]
    lines += [f"  unexpected  {e.name} in {e.file}: {_fmt(e.shape, e.dtype)}" for e in m.unexpected[:limit]]
    lines += [f"  wrong       {s.name} in {e.file}: expected {_fmt(s.shape, s.dtype)}, found {_fmt(e.shape, e.dtype)}"
              for s, e in m.wrong[:limit]]
    return lines


def _experts_hint(m: Mismatch, experts: str) -> str:
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
    experts = stored_experts(cfg)
    head = (f"{where}: the weights do not match config.json (dtype {cfg.text.dtype}, experts {experts}): "
            f"{len(m.missing)} missing, {len(m.unexpected)} unexpected, {len(m.wrong)} with the wrong shape "
            f"or dtype" + (f"; offending shards: {files}" if files else ""))
    return ValueError("\n".join([head, *difference_lines(m)]) + _experts_hint(m, experts))
