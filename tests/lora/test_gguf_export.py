"""`kimik3 lora export ADAPTER OUT.gguf`: routed-expert adapters in llama.cpp's LoRA GGUF layout; any other adapter
refused in one line (llama.cpp's kimi-k3 graph would ignore it). llama.cpp running it: test_gguf_llama_cpp.py."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

import kimik3
from kimik3 import lora
from kimik3.cli import main
from kimik3.lora.layers import LoraExperts
from kimik3.presets import DEMO_MODEL
from tests.lora.conftest import randomize_adapter


def adapter_on(targets, folder, seed=1, **kw):
    model = lora.apply(kimik3.load(DEMO_MODEL, dtype=torch.float32, keep_experts_packed=True, quiet=True),
                       lora.LoraConfig(rank=4, targets=targets, **kw))
    randomize_adapter(model, seed=seed)
    return model, lora.save(model, folder, base_name_or_path=str(DEMO_MODEL))


@pytest.mark.parametrize("layout", ["per_expert", "shared_a"])
def test_expert_adapter_factors_land_under_the_base_names(tmp_path, capsys, layout):
    model, folder = adapter_on(["*.block_sparse_moe.experts"], tmp_path / "adapter", experts=layout)
    assert main(["lora", "export", str(folder), str(tmp_path / "a.gguf")]) == 0  # base from adapter_config.json
    r = gguf.GGUFReader(tmp_path / "a.gguf")
    kv = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    assert kv["general.type"] == "adapter" and kv["adapter.type"] == "lora" and kv["adapter.lora.alpha"] == 16.0
    tensors = {t.name: np.asarray(t.data) for t in r.tensors}
    checked = 0
    for name, m in lora.lora_modules(model).items():
        assert isinstance(m, LoraExperts)
        i = int(name.split(".layers.")[1].split(".")[0])
        for p, g in (("w1", "ffn_gate_exps"), ("w3", "ffn_up_exps"), ("w2", "ffn_down_exps")):
            a, b = getattr(m, f"{p}_lora_A").expand(m.num_experts, -1, -1), getattr(m, f"{p}_lora_B").expand(
                m.num_experts, -1, -1)
            np.testing.assert_array_equal(tensors[f"blk.{i}.{g}.weight.lora_a"], a.detach().numpy())
            np.testing.assert_array_equal(tensors[f"blk.{i}.{g}.weight.lora_b"], b.detach().numpy())
            checked += 1
    assert checked == 3 * 7 and len(tensors) == 2 * checked


def test_other_adapters_are_refused_in_one_line(tmp_path, capsys):
    _, folder = adapter_on(["*.self_attn.q_proj", "*.block_sparse_moe.experts"], tmp_path / "adapter")
    assert main(["lora", "export", str(folder), str(tmp_path / "a.gguf"), "--base", str(DEMO_MODEL)]) == 2
    err = capsys.readouterr().err
    assert "applies LoRA only to the routed experts" in err and "kimik3 lora merge" in err and err.count("\n") == 1
    assert not (tmp_path / "a.gguf").exists()
