"""Checkpoints written by other K3 implementations, built here with safetensors' own `save_file` (never
through `kimik3.save`): per-expert dense tensors, A_log padded to their own length, a config.json that keeps
the vision_config over text-only shards."""

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from kimik3.checkpoint import inspect_checkpoint, load, save
from kimik3.cli import main
from tests.helpers import CONFIGS

A_LOG = re.compile(r"\.layers\.\d+\.self_attn\.A_log$")
EXPERTS = re.compile(r"^(.+\.block_sparse_moe\.experts)\.(w[123])$")


def foreign_tensors(model: torch.nn.Module, a_log_length: int) -> dict[str, torch.Tensor]:
    """The model's tensors as another implementation stores them: one dense tensor per expert, A_log padded
    (or cut) to `a_log_length` with random values past the heads."""
    heads = model.config.text.kda.num_heads
    gen = torch.Generator().manual_seed(11)
    out = {}
    for name, t in model.state_dict().items():
        m = EXPERTS.match(name)
        if m:
            out.update({f"{m[1]}.{e}.{m[2]}.weight": t[e].clone() for e in range(t.shape[0])})
        elif A_LOG.search(name):
            tail = torch.rand(max(a_log_length - heads, 0), generator=gen)
            out[name] = torch.cat([t[:heads], tail])[:a_log_length].contiguous()
        else:
            out[name] = t.clone().contiguous()
    return out


def write_foreign(folder, tensors: dict[str, torch.Tensor], vision_config: bool = True):
    """One `model.safetensors` plus a config.json: the tiny config with its vision_config kept, dense experts."""
    folder.mkdir()
    hf = json.loads((CONFIGS / "tiny.json").read_text())
    hf["text_config"].pop("quantization_config", None)
    if not vision_config:
        hf.pop("vision_config")
    (folder / "config.json").write_text(json.dumps(hf))
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def assert_same_model(loaded, model):
    heads = model.config.text.kda.num_heads
    a, b = loaded.state_dict(), model.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        x, y = (a[name][:heads], b[name][:heads]) if A_LOG.search(name) else (a[name], b[name])
        assert x.dtype == y.dtype and torch.equal(x, y), name


@pytest.mark.parametrize("length", [3, 24, 128, 256])  # the heads exactly, the old max(H, K), released, more
def test_a_log_of_any_length_from_the_heads_up_loads(dense_model, tmp_path, capsys, length):
    folder = write_foreign(tmp_path / "ck", foreign_tensors(dense_model, length))
    model = load(folder, quiet=True)
    assert_same_model(model, dense_model)
    report = inspect_checkpoint(folder)
    assert report.ok, report.lines()
    assert report.notes[-1].endswith("a text model")  # the vision_config over text-only shards
    if length == 128:
        assert len(report.notes) == 1
    else:
        assert len(report.notes) == 2 and f"length {length}" in report.notes[0] and "padding" in report.notes[0]
        capsys.readouterr()
        assert main(["inspect", str(folder)]) == 0
        out = capsys.readouterr().out
        assert "note" in out and "no differences from config.json" in out


def test_a_log_shorter_than_the_heads_is_refused(dense_model, tmp_path):
    folder = write_foreign(tmp_path / "ck", foreign_tensors(dense_model, 2))
    with pytest.raises(ValueError, match=r"wrong shape language_model\.model\.layers\.0\.self_attn\.A_log"):
        load(folder)
    assert not inspect_checkpoint(folder).ok


def test_we_write_the_released_a_log_length(dense_model, tmp_path):
    """ceil(num_heads / 128) * 128: the tiny model's 3 heads are stored as 128, as the release stores 96."""
    folder = write_foreign(tmp_path / "ck", foreign_tensors(dense_model, 24))
    out = save(load(folder, quiet=True), tmp_path / "ours", experts="bf16", quiet=True)
    tensors = load_file(out / "model-00001-of-000001.safetensors")
    lengths = {tuple(t.shape) for n, t in tensors.items() if A_LOG.search(n)}
    assert lengths == {(128,)}
    assert inspect_checkpoint(out).notes == []  # and the written config.json has no vision_config


def test_vision_config_over_text_only_shards_loads_the_text_model(dense_model, tmp_path, capsys):
    folder = write_foreign(tmp_path / "ck", foreign_tensors(dense_model, 128))
    capsys.readouterr()
    model = load(folder, quiet=True)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "vision_config" in err[0] and "text model" in err[0], err
    assert not model.has_vision
    assert_same_model(model, dense_model)
    assert_same_model(load(folder, text_only=True, quiet=True), dense_model)
    with pytest.raises(ValueError, match=r"missing.*vision_tower\."):  # asked for the tower: it is not there
        load(folder, text_only=False)


def test_text_only_false_on_a_text_config_says_what_to_pass(dense_model, tmp_path):
    folder = write_foreign(tmp_path / "ck", foreign_tensors(dense_model, 128), vision_config=False)
    with pytest.raises(ValueError, match=r"text-only model.*text_only=None or True"):
        load(folder, text_only=False)


def test_partial_vision_tensors_remain_an_error(dense_model, tiny_config, tmp_path):
    from kimik3.model import K3ForConditionalGeneration

    vision = K3ForConditionalGeneration(tiny_config).state_dict()
    projector = {n: torch.randn(t.shape).to(t.dtype) for n, t in vision.items() if n.startswith("mm_projector.")}
    assert projector
    folder = write_foreign(tmp_path / "ck", foreign_tensors(dense_model, 128) | projector)
    with pytest.raises(ValueError, match=r"missing     vision_tower\."):
        load(folder)


def test_mismatch_names_the_first_offender_of_each_kind(dense_model, tmp_path):
    """Many missing tensors never hide the one unexpected, the one of the wrong shape and the one of the wrong
    dtype."""
    tensors = foreign_tensors(dense_model, 128)
    for name in [n for n in tensors if ".experts." in n][:40]:
        del tensors[name]
    tensors["language_model.model.extra.weight"] = torch.zeros(2)
    norm = "language_model.model.norm.weight"
    tensors[norm] = tensors[norm][:-1].clone()
    head = "language_model.lm_head.weight"
    tensors[head] = tensors[head].to(torch.float16)
    folder = write_foreign(tmp_path / "ck", tensors)
    with pytest.raises(ValueError) as err:
        load(folder)
    msg = str(err.value)
    assert "40 missing, 1 unexpected, 1 with the wrong shape, 1 with the wrong dtype" in msg
    assert "missing     language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight" in msg
    assert "unexpected  language_model.model.extra.weight" in msg
    assert f"wrong shape {norm} in model.safetensors: expected [80] bfloat16, found [79] bfloat16" in msg
    assert f"wrong dtype {head} in model.safetensors: expected [300, 80] bfloat16, found [300, 80] float16" in msg


def test_keep_experts_packed_and_the_deprecated_spelling(saved):
    packed = load(saved, keep_experts_packed=True, quiet=True)
    assert any(n.endswith("w1_packed") for n in packed.state_dict())
    with pytest.warns(DeprecationWarning, match="keep_experts_packed"):
        old = load(saved, experts="mxfp4", quiet=True)
    assert old.state_dict().keys() == packed.state_dict().keys()
    with pytest.warns(DeprecationWarning):
        dense = load(saved, experts="dequantize", quiet=True)
    assert any(n.endswith("experts.w1") for n in dense.state_dict())
    with pytest.raises(ValueError, match="keep_experts_packed"):
        load(saved, keep_experts_packed="yes")
