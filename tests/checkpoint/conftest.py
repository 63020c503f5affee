"""Fixtures for the checkpoint tests: random tiny models and helpers that write (broken) checkpoint folders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kimik3.checkpoint import save
from kimik3.checkpoint.inventory import without_vision
from kimik3.config import K3Config
from kimik3.model import K3ForConditionalGeneration
from kimik3.quant import pack_experts
from tests.helpers import randomize


@pytest.fixture(scope="session")
def text_config(tiny_config) -> K3Config:
    """The tiny config without its vision part: these tests are about the text checkpoint."""
    return without_vision(tiny_config)


@pytest.fixture(scope="session")
def dense_model(text_config) -> K3ForConditionalGeneration:
    """Random bf16 weights, dense experts."""
    return randomize(K3ForConditionalGeneration(text_config), seed=3)


@pytest.fixture(scope="session")
def packed_model(text_config) -> K3ForConditionalGeneration:
    """Random weights with the experts MXFP4-packed (so they came from MXFP4: saving them is exact)."""
    return pack_experts(randomize(K3ForConditionalGeneration(text_config), seed=4))


@pytest.fixture(scope="session")
def saved(packed_model, tmp_path_factory) -> Path:
    """The packed model saved as released (MXFP4 experts) in several shards; tests must not modify it (nor the
    models above: they are shared by the whole session)."""
    return save(packed_model, tmp_path_factory.mktemp("ckpt") / "tiny", max_shard_size="400KB")


def copy_of(folder: Path, dst: Path) -> Path:
    import shutil

    return Path(shutil.copytree(folder, dst))


def all_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a folder, read with the safetensors library (an independent reader)."""
    out = {}
    for shard in sorted(folder.glob("*.safetensors")):
        out |= load_file(shard)
    return out


def rewrite_single(folder: Path, change) -> Path:
    """Replace the shards by one `model.safetensors` written by the safetensors library after `change(dict)`."""
    tensors = all_tensors(folder)
    change(tensors)
    for f in list(folder.glob("*.safetensors")) + [folder / "model.safetensors.index.json"]:
        f.unlink()
    save_file(tensors, folder / "model.safetensors")
    return folder


def edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data, indent=2))


def assert_state_equal(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    bad = [k for k in sa if sa[k].dtype != sb[k].dtype or not torch.equal(sa[k], sb[k])]
    assert not bad, bad[:5]
