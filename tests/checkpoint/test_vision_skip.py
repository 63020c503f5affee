"""Text-only loads skip every vision_tower.* / mm_projector.* tensor without reading its data."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from kimik3.checkpoint import inspect_checkpoint, load, save
from kimik3.checkpoint.keys import TensorSpec, checkpoint_specs, is_vision_key
from kimik3.checkpoint.safetensors_header import encode_header
from kimik3.model import K3ForConditionalGeneration
from kimik3.quant import pack_experts
from tests.checkpoint.conftest import assert_state_equal, copy_of, edit_json
from tests.helpers import CONFIGS, randomize

VISION = json.loads((CONFIGS / "tiny.json").read_text())["vision_config"]


def vision_specs(cfg) -> list[TensorSpec]:
    """The tower's and projector's own checkpoint tensors (bf16, from the meta-built module)."""
    with torch.device("meta"):
        model = K3ForConditionalGeneration(cfg)
    return [s for s in checkpoint_specs(model) if is_vision_key(s.name)]


@pytest.fixture
def with_vision(saved, tmp_path, tiny_config):
    """The saved tiny checkpoint plus its vision config and a vision-only last shard (header only)."""
    ck = copy_of(saved, tmp_path / "ck")
    edit_json(ck / "config.json", lambda c: c.update(vision_config=VISION))
    specs = vision_specs(tiny_config)
    header, sizes = encode_header([(s.name, s.dtype, s.shape) for s in specs])
    shard = ck / "model-99999-of-000099.safetensors"
    with open(shard, "wb") as f:
        f.write(header)  # and no data at all: reading any of it would fail
    edit_json(ck / "model.safetensors.index.json",
              lambda c: c["weight_map"].update({s.name: shard.name for s in specs}))
    return ck


def test_unreadable_vision_shard_loads_text_only(with_vision, packed_model):
    assert_state_equal(packed_model, load(with_vision, keep_experts_packed=True, text_only=True))
    with pytest.raises(ValueError, match="past the end of their shard"):
        load(with_vision, text_only=False)
    report = inspect_checkpoint(with_vision)  # the inspector does look, and sees the damage
    assert not report.mismatch and len(report.problems) == 1 and "truncated" in report.problems[0]


def test_vision_tensors_in_a_text_shard_are_never_read(saved, tmp_path, tiny_config, packed_model, tensors_read):
    ck = copy_of(saved, tmp_path / "ck")
    edit_json(ck / "config.json", lambda c: c.update(vision_config=VISION))
    first = sorted(ck.glob("model-*.safetensors"))[0]
    tensors = load_file(first)
    for s in vision_specs(tiny_config):
        tensors[s.name] = torch.full(s.shape, float("nan"), dtype=s.dtype)
    save_file(tensors, first)
    edit_json(ck / "model.safetensors.index.json",
              lambda c: c["weight_map"].update({n: first.name for n in tensors}))

    read = tensors_read
    assert_state_equal(packed_model, load(ck, keep_experts_packed=True, text_only=True))
    assert read and not [n for n in read if n.startswith(("vision_tower.", "mm_projector."))]
    assert inspect_checkpoint(ck).ok  # headers and the vision inventory agree


@pytest.fixture(scope="module")
def vision_model(tiny_config):
    # experts from MXFP4, so the default (MXFP4) save is exact
    return pack_experts(randomize(K3ForConditionalGeneration(tiny_config), seed=6))


def test_vision_round_trip(vision_model, tmp_path, tiny_config):
    """With the tower built, its tensors go through save -> load(text_only=False) bit for bit."""
    path = save(vision_model, tmp_path / "ck", max_shard_size="300KB")
    assert json.loads((path / "config.json").read_text())["vision_config"] == VISION
    assert inspect_checkpoint(path).ok
    assert_state_equal(vision_model, load(path, text_only=False, keep_experts_packed=True))
    text = load(path, text_only=True)
    assert not any(n.startswith(("vision_tower.", "mm_projector.")) for n in text.state_dict())


def test_default_load_includes_vision(vision_model, tmp_path):
    path = save(vision_model, tmp_path / "ck")
    assert any(n.startswith("vision_tower.") for n in load(path, keep_experts_packed=True).state_dict())
