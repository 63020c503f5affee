"""The transformers config classes of a K3 folder: `kimi_k3` at the top, its text part as a sub-config.

The released config.json's `text_config.model_type` is `kimi_linear`, a type transformers (>= 5.17) defines for
another model. The text class keeps that string, so a config round-trips byte for byte, but it is never
registered with AutoConfig: `AutoConfig.for_model("kimi_linear")` stays transformers' own. Both classes hold the
released keys as attributes; `to_k3()` hands them to `K3Config.from_hf`, the one place HF keys are translated.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

from kimik3.config import K3Config
from kimik3.config.hf import TEXT_KEYS, TOP_KEYS, VISION_KEYS


class KimiK3TextConfig(PretrainedConfig):
    """`text_config` of a K3 config.json (every released key as an attribute: vocab_size, hidden_size, ...)."""

    model_type = "kimi_linear"  # as released; deliberately not registered (see the module docstring)
    base_config_key = "text_config"


class KimiK3Config(PretrainedConfig):
    """A K3 config.json: top-level ids, `text_config` (a KimiK3TextConfig) and an optional `vision_config` dict."""

    model_type = "kimi_k3"
    sub_configs_defaults = {"text_config": KimiK3TextConfig}
    keys_to_ignore_at_inference = ["cache"]

    text_config: dict | PretrainedConfig | None = None
    vision_config: dict | None = None

    def to_k3(self) -> K3Config:
        """The kimik3 config tree of this config (a ValueError names a bad field)."""
        return K3Config.from_hf(self.released_dict())

    def released_dict(self) -> dict[str, Any]:
        """This config in the released config.json layout: only keys that layout has (transformers adds its own
        bookkeeping, such as `transformers_version` or `output_attentions`, which K3 does not read)."""
        d = self.to_dict()
        top = {k: v for k, v in d.items() if k in TOP_KEYS and k not in ("text_config", "vision_config")}
        text = {k: v for k, v in d["text_config"].items() if k in TEXT_KEYS}
        text["model_type"] = KimiK3TextConfig.model_type
        top["model_type"] = self.model_type
        top["text_config"] = text
        if d.get("vision_config"):
            top["vision_config"] = {k: v for k, v in d["vision_config"].items() if k in VISION_KEYS}
        return top

    @classmethod
    def from_k3(cls, cfg: K3Config) -> KimiK3Config:
        """The transformers config of a kimik3 config (its `hf` dict, the config.json it was read from)."""
        if not cfg.hf:
            raise ValueError("K3Config.hf is empty: build the config with K3Config.from_hf or from_file")
        return cls(**cfg.hf)
