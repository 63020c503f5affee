"""PEFT LoRA over the attention and dense projections: trains on the demo, saves, reloads to the same logits."""

from __future__ import annotations

import pytest
import torch

peft = pytest.importorskip("peft", reason="peft (the hf extra) is not installed")

from transformers import AutoModelForCausalLM  # noqa: E402

from kimik3.presets import DEMO_MODEL  # noqa: E402

# KDA and MLA projections and the dense MLP. kv_b_proj is left out: cached MLA decode reads its weight directly
# (absorbed into the latent attention), so an unmerged adapter on it would reach prefill but not decode
TARGETS = ["q_proj", "k_proj", "v_proj", "g_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
           "gate_proj", "up_proj", "down_proj"]
TEXT = ("ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet is the sun. "
        "Arise, fair sun, and kill the envious moon, who is already sick and pale with grief.")


def _base():
    return AutoModelForCausalLM.from_pretrained(DEMO_MODEL, dtype=torch.float32)


def test_lora_trains_saves_and_reloads(hf_tok, tmp_path):
    model = peft.get_peft_model(_base(), peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                         target_modules=TARGETS, init_lora_weights=True))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert any("self_attn.q_b_proj.lora_A" in n for n in trainable) and any("mlp.down_proj" in n for n in trainable)
    ids = torch.tensor([hf_tok.encode(TEXT)])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    model.train()
    losses = []
    for _ in range(8):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3, losses
    model.eval()
    model.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    reloaded = peft.PeftModel.from_pretrained(_base(), tmp_path / "adapter").eval()
    probe = torch.randint(0, 8000, (2, 9))
    with torch.no_grad():
        want = model(input_ids=probe).logits
        assert torch.equal(reloaded(input_ids=probe).logits, want)
        # the adapter changes the model, and merging it in gives the adapted logits
        assert not torch.equal(_base()(input_ids=probe).logits, want)
        merged = reloaded.merge_and_unload()
        torch.testing.assert_close(merged(input_ids=probe).logits, want, rtol=1e-4, atol=1e-4)
