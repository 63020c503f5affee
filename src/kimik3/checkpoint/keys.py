"""The key map between our modules and the released checkpoint: structural deviations only.

Our parameter names ARE the released names, with one deviation: routed experts are stacked
`...block_sparse_moe.experts.w{1,2,3}` [E, out, in] (or, kept packed, `.w{1,2,3}_packed` [E, out, in/2] and
`.w{1,2,3}_scale` [E, out, in/32]), where the checkpoint has one tensor per expert,
`...experts.{e}.w{1,2,3}.weight` (bf16) or `.weight_packed` uint8 [out, in/2] + `.weight_scale` uint8
[out, in/32] (MXFP4). A text-only module (`K3ForCausalLM`) gets the `language_model.` prefix.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from kimik3.config import EXPERT_FORMATS, ExpertFormat
from kimik3.ops.mxfp4 import GROUP_SIZE

TEXT_PREFIX = "language_model."
VISION_PREFIXES = ("vision_tower.", "mm_projector.")

# text_config.quantization_config of a checkpoint whose routed experts are MXFP4 (the release's block, written
# as is so that compressed-tensors readers such as vLLM and transformers read our folders as they read the release)
RELEASED_QUANTIZATION: dict = {
    "config_groups": {
        "group_0": {
            "format": "mxfp4-pack-quantized",
            "input_activations": None,
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {
                "actorder": None, "block_structure": None, "dynamic": False, "group_size": GROUP_SIZE,
                "num_bits": 4, "observer": "minmax", "observer_kwargs": {}, "scale_dtype": "torch.uint8",
                "strategy": "group", "symmetric": True, "type": "float", "zp_dtype": None,
            },
        }
    },
    "format": "mxfp4-pack-quantized",
    "global_compression_ratio": None,
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
               "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}

_STACKED = re.compile(r"^(?P<head>.+\.block_sparse_moe\.experts)\.(?P<w>w[123])(?P<part>|_packed|_scale)$")
_PER_EXPERT = re.compile(r"^(?P<head>.+\.block_sparse_moe\.experts)\.(?P<e>\d+)\.(?P<w>w[123])\."
                         r"(?P<part>weight|weight_packed|weight_scale)$")


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor: name, shape, dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class ExpertKey:
    """A per-expert checkpoint name parsed into the stacked parameter it belongs to."""

    stacked: str  # our tensor name: ...experts.w1 ("weight"), ...experts.w1_packed, ...experts.w1_scale
    expert: int
    part: str  # "weight", "weight_packed" or "weight_scale"


def parse_expert_key(name: str) -> ExpertKey | None:
    m = _PER_EXPERT.match(name)
    if m is None:
        return None
    suffix = {"weight": "", "weight_packed": "_packed", "weight_scale": "_scale"}[m["part"]]
    return ExpertKey(f"{m['head']}.{m['w']}{suffix}", int(m["e"]), m["part"])


def is_vision_key(name: str) -> bool:
    """True for the vision tower's and the projector's checkpoint tensors."""
    return name.startswith(VISION_PREFIXES)


def checkpoint_prefix(model: nn.Module) -> str:
    """'' for the multimodal wrapper (names already carry `language_model.`), else the text prefix."""
    return "" if hasattr(model, "language_model") else TEXT_PREFIX


def expert_specs(name: str, shape: tuple[int, ...], dtype: torch.dtype, experts: ExpertFormat
                 ) -> Iterator[TensorSpec]:
    """Unstack one stacked expert tensor into its per-expert checkpoint tensors.

    `name` is a dense `...experts.w1` [E, out, in] or a packed `...experts.w1_packed` [E, out, in/2] (whose
    `_scale` partner adds nothing: it is emitted here); `dtype` is the dense dtype for bf16 output.
    """
    m = _STACKED.match(name)
    assert m is not None and m["part"] != "_scale", name
    E, out, inp = shape
    if m["part"] == "_packed":
        inp, dtype = inp * 2, torch.bfloat16
    if experts == "mxfp4" and inp % GROUP_SIZE:
        raise ValueError(f"{name}: MXFP4 experts need an input width that is a multiple of the group size "
                         f"{GROUP_SIZE} (config routed_expert_hidden_size / moe_intermediate_size), got {inp}")
    for e in range(E):
        base = f"{m['head']}.{e}.{m['w']}"
        if experts == "mxfp4":
            yield TensorSpec(f"{base}.weight_packed", (out, inp // 2), torch.uint8)
            yield TensorSpec(f"{base}.weight_scale", (out, inp // GROUP_SIZE), torch.uint8)
        else:
            yield TensorSpec(f"{base}.weight", (out, inp), dtype)


def is_stacked_expert(name: str) -> bool:
    return _STACKED.match(name) is not None


def checkpoint_specs(model: nn.Module, experts: ExpertFormat = "mxfp4") -> list[TensorSpec]:
    """Every tensor the released layout holds for `model` (works on the meta device)."""
    if experts not in EXPERT_FORMATS:
        raise ValueError(f"experts must be one of {EXPERT_FORMATS}, got {experts!r}")
    prefix = checkpoint_prefix(model)
    specs: list[TensorSpec] = []
    for name, t in model.state_dict(keep_vars=True).items():
        name = prefix + name
        if is_stacked_expert(name):
            if not name.endswith("_scale"):
                specs.extend(expert_specs(name, tuple(t.shape), t.dtype, experts))
        else:
            specs.append(TensorSpec(name, tuple(t.shape), t.dtype))
    return specs
