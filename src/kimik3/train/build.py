"""The model a run trains: fresh from a config, from a released-layout checkpoint, or from a step folder.

The trainer holds the text model (`K3ForCausalLM`) in fp32 (master weights) and the `K3Config` it writes
next to the weights. A checkpoint is loaded with `kimik3.checkpoint.load(..., text_only=True)`; its config
must describe the same model as the run's (storage dtype and expert format may differ).
"""

from __future__ import annotations

from pathlib import Path

import torch

from kimik3.checkpoint import load
from kimik3.config import K3Config
from kimik3.model import K3ForCausalLM
from kimik3.presets import load_config, resolve_config
from kimik3.train.checkpointing import check_same_model
from kimik3.train.config import ModelSection


def _load_lm(path: Path, device: torch.device, packed: bool = False) -> tuple[K3Config, K3ForCausalLM]:
    model = load(path, dtype=torch.float32, device=device, text_only=True, keep_experts_packed=packed, quiet=True)
    return model.config, model.language_model


def build_model(section: ModelSection, resume: Path | None, device: torch.device, *, frozen_base: bool = False
                ) -> tuple[K3Config, K3ForCausalLM]:
    """(config to save with, fp32 text model on `device`); `resume` is a step folder or None.

    frozen_base (a LoRA run): always `model.checkpoint`, its routed experts kept MXFP4-packed; a step folder holds
    only the adapter, which the trainer loads on top."""
    if section.config is not None:
        wanted, what = load_config(section.config), f"model.config '{resolve_config(section.config)}'"
    else:
        source = Path(section.checkpoint)
        if not (source / "config.json").is_file():
            raise FileNotFoundError(f"model.checkpoint: no checkpoint folder (config.json) at '{source}'")
        wanted, what = K3Config.from_file(source), f"model.checkpoint '{source}'"
        if frozen_base:
            return _load_lm(source, device, packed=True)
    if resume is not None:
        cfg, lm = _load_lm(resume / "model", device)
        check_same_model(lm.config, wanted.text, f"checkpoint {resume}", what)
        return cfg, lm
    if section.checkpoint is not None:
        return _load_lm(Path(section.checkpoint), device)
    torch.manual_seed(section.init_seed)
    lm = K3ForCausalLM(wanted.text, torch.float32).init_weights(section.init_seed)
    return wanted, lm.to(device)
