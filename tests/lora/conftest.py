"""A random tiny base checkpoint with MXFP4 experts (written once per session) and helpers to load and run it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kimik3
from kimik3.checkpoint import save
from kimik3.checkpoint.inventory import without_vision
from kimik3.model import K3ForConditionalGeneration
from kimik3.quant import pack_experts
from tests.helpers import randomize


@pytest.fixture(scope="session")
def base_dir(tiny_config, tmp_path_factory) -> Path:
    """The tiny text model, random weights, routed experts MXFP4 (as released), saved as a checkpoint folder."""
    model = pack_experts(randomize(K3ForConditionalGeneration(without_vision(tiny_config)), seed=7))
    return save(model, tmp_path_factory.mktemp("lora-base") / "tiny", quiet=True)


def load_base(folder: Path, packed: bool = True) -> K3ForConditionalGeneration:
    return kimik3.load(folder, dtype=torch.float32, keep_experts_packed=packed, quiet=True).eval()


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
    return out.logits if hasattr(out, "logits") else out


@torch.no_grad()
def randomize_adapter(model, seed: int = 0) -> None:
    """Nonzero B everywhere (a fresh adapter is the base exactly), so the tests compare real updates."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.requires_grad and "lora_B" in name:
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
