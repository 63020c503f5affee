"""Training checkpoints: atomic step folders holding released-format weights plus the trainer's state.

    OUT_DIR/checkpoints/step-00000300/
        model/        kimik3.save(..., experts="bf16", dtype=float32): config.json + safetensors, loadable by
                      kimik3.load; fp32 master weights, dense experts, and the balancing biases
                      (`e_score_correction_bias`, the whole balancing state) -- so resume is exact
        trainer.pt    step, optimizer state (keyed by parameter name), RNG states, the run's config
        train.json    the run's config, for people
    A LoRA run (`[lora]`) writes `adapter/` (kimik3.lora.save: PEFT's adapter_config.json and
    adapter_model.safetensors) instead of `model/`: the base stays the run's model.checkpoint, untouched.

A folder is written by `kimik3.checkpoint.publish_atomically` as `.step-00000300.partial-<id>` (files and
folders fsynced), then renamed into place and the parent fsynced; a kill at any moment leaves the previous step
folders intact and at worst a hidden `.partial`/`.old` folder, which the next start deletes. `model/` also gets
the tokenizer and model card of the run's `model.checkpoint` folder (else its `data.tokenizer`), so it is a
complete checkpoint folder for `kimik3 generate --model`. After a save only the newest `checkpoint.keep` step
folders are kept.
Optimizer state is keyed by parameter name (the format of torch.distributed.checkpoint's full state dict), so
a checkpoint written by N ranks resumes on any number of ranks.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shutil
from dataclasses import fields, is_dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from kimik3.config import K3Config, TextConfig

_STEP = re.compile(r"^step-(\d{8})$")
TRAINER_STATE = "trainer.pt"
ADAPTER = "adapter"  # a LoRA run's step folder holds this instead of model/


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def list_checkpoints(root: Path) -> list[Path]:
    """Complete step folders under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP.match(p.name) and (p / TRAINER_STATE).is_file()]
    return sorted(found, key=lambda p: p.name)


def remove_partials(root: Path) -> None:
    """Delete folders a killed save left behind (never a complete step folder)."""
    from kimik3.checkpoint.folder import is_hidden_sibling

    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(".step-") and is_hidden_sibling(p.name):
                shutil.rmtree(p, ignore_errors=True)


def rng_state() -> dict:
    """torch (CPU and CUDA), python and numpy global generators, as tensors and plain values (weights_only)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "python": random.getstate(),
            "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached]}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


def named_optimizer_state(model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict:
    """The optimizers' state keyed by parameter name: {"state": {name: ...}, "param_groups": [{"params": names}]}."""
    names = {id(p): n for n, p in model.named_parameters()}
    state, groups = {}, []
    for opt in optimizers:
        sd = opt.state_dict()
        name_of = {i: names[id(p)] for g_sd, g in zip(sd["param_groups"], opt.param_groups, strict=True)
                   for i, p in zip(g_sd["params"], g["params"], strict=True)}
        state.update({name_of[i]: s for i, s in sd["state"].items()})
        groups += [{**g, "params": [name_of[i] for i in g["params"]]} for g in sd["param_groups"]]
    return {"state": state, "param_groups": groups}


def load_named_optimizer_state(model: nn.Module, optimizers: list[torch.optim.Optimizer], full: dict) -> None:
    """Inverse of `named_optimizer_state` (single process); groups are matched by their parameter names."""
    names = {id(p): n for n, p in model.named_parameters()}
    by_params = {tuple(g["params"]): g for g in full["param_groups"]}
    for opt in optimizers:
        sd = opt.state_dict()
        groups, state = [], {}
        for g_sd, g in zip(sd["param_groups"], opt.param_groups, strict=True):
            key = tuple(names[id(p)] for p in g["params"])
            if key not in by_params:
                raise ValueError("the checkpoint's optimizer groups do not match this model's parameters "
                                 "(optim.name or the model changed?)")
            groups.append({**by_params[key], "params": g_sd["params"]})
            state.update({i: full["state"][n] for i, n in zip(g_sd["params"], key, strict=True) if n in full["state"]})
        opt.load_state_dict({"state": state, "param_groups": groups})


def save_checkpoint(root: Path, step: int, model_to_save: nn.Module, k3cfg: K3Config, trainer_state: dict,
                    keep: int, config_json: dict, *, adapter_only: bool = False, eos_id: int | None = None) -> Path:
    """Write step folder `step` atomically (rank 0 only), then prune to the newest `keep`. Returns its path.

    `model/` is a complete model folder: weights, config.json and generation_config.json whose eos_token_id
    is the run's document separator `eos_id` (what the model learned to end a text with), and the run's
    tokenizer as `tiktoken.model` (whatever the run's file is called). adapter_only: write `model_to_save`'s
    LoRA adapter (`adapter/`) instead of the weights."""
    from kimik3.checkpoint import publish_atomically, save

    source = _companion_source(config_json)
    if eos_id is not None:
        k3cfg = with_eos(k3cfg, eos_id)

    def write(tmp: Path) -> None:
        if adapter_only:
            from kimik3.lora import save as save_adapter

            save_adapter(model_to_save, tmp / ADAPTER, base_name_or_path=(config_json.get("model") or {}).get(
                "checkpoint"))
        else:
            save(model_to_save, tmp / "model", experts="bf16", dtype=torch.float32, config=k3cfg, source=source,
                 quiet=True)  # a tokenizer file lands as tiktoken.model, with the HF tokenizer files beside it
        with open(tmp / TRAINER_STATE, "wb") as f:
            torch.save(trainer_state, f)
            f.flush()
            os.fsync(f.fileno())
        (tmp / "train.json").write_text(json.dumps(config_json, indent=2, default=str) + "\n")

    root.mkdir(parents=True, exist_ok=True)
    # re-saving a step (a resumed run stopped where it started) replaces the whole step folder
    final = publish_atomically(step_dir(root, step), write)
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old)
    return final


def with_eos(cfg: K3Config, eos_id: int) -> K3Config:
    """`cfg` with eos_token_id = `eos_id` (top level and text_config, as config.json carries it)."""
    hf = json.loads(json.dumps(cfg.hf))
    for d in (hf, hf.get("text_config")):
        if isinstance(d, dict):
            d["eos_token_id"] = int(eos_id)
    return dataclasses.replace(cfg, eos_token_id=int(eos_id), hf=hf)


def _companion_source(config_json: dict) -> Path | None:
    """Where the run's tokenizer and model card are: the model.checkpoint folder, else data.tokenizer."""
    folder = (config_json.get("model") or {}).get("checkpoint")
    if folder and Path(folder).is_dir():
        return Path(folder)
    tokenizer = (config_json.get("data") or {}).get("tokenizer")
    if tokenizer and Path(tokenizer).is_dir():  # a folder holding a tiktoken.model (and perhaps the corpus)
        tokenizer = Path(tokenizer) / "tiktoken.model"
    return Path(tokenizer) if tokenizer and Path(tokenizer).is_file() else None


def load_trainer_state(path: Path) -> dict:
    f = path / TRAINER_STATE
    if not f.is_file():
        raise FileNotFoundError(f"{path} is not a training checkpoint (no {TRAINER_STATE})")
    return torch.load(f, map_location="cpu", weights_only=True)


def _differences(a, b, prefix: str = "") -> list[str]:
    """Field-by-field differences of two (nested) frozen dataclasses, as 'name: a != b'."""
    out = []
    for f in fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if is_dataclass(x) and is_dataclass(y):
            out += _differences(x, y, f"{prefix}{f.name}.")
        elif x != y:
            out.append(f"{prefix}{f.name}: {x!r} != {y!r}")
    return out


def check_same_model(found: TextConfig, wanted: TextConfig, where: str, what: str) -> None:
    """ValueError naming the differing fields unless the two text configs describe the same model.

    How each is stored (dtype, expert format: `K3Config.storage`) is not part of a TextConfig, so a checkpoint
    of fp32 dense experts matches the bf16 MXFP4 config it started from.
    """
    diff = _differences(found, wanted)
    if diff:
        raise ValueError(f"{where} does not match {what}: " + "; ".join(diff[:4]) + (" ..." if len(diff) > 4 else ""))
