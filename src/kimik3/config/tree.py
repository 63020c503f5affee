"""The K3 configuration tree: `K3Config`, the frozen dataclasses of `sections` under it, each validating its own
values once.

They are built from the released `config.json` by `K3Config.from_hf` / `from_file`, whose translation (HF key
names, nesting, the 1-based `kda_layers` / `full_attn_layers` lists, type checks, unknown-key warnings) lives in
`kimik3.config.hf`; everything else reads `TextConfig.layer_types` and `TextConfig.moe_layers`. Runtime knobs
(device, dtype, backend, batch limits) are not model config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kimik3.config.hf import k3_fields, k3_file_fields
from kimik3.config.sections import Storage, TextConfig, VisionConfig


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
    def from_file(cls, path: str | Path) -> K3Config:
        """Read a config.json (or a folder holding one); errors and unknown-key warnings name the file."""
        return cls(**k3_file_fields(path))

    @classmethod
    def from_hf(cls, d: dict) -> K3Config:
        """Build from the released config.json layout (top level + `text_config` + optional `vision_config`).

        A bare text config (a dict with `linear_attn_config` at top level) is accepted too. A value of the
        wrong type is a ValueError naming the field; an unknown key is a warning naming the closest known one.
        """
        return cls(**k3_fields(d))
