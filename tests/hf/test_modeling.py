"""The registered auto classes load a released-layout folder without remote code and are kimik3's model."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText

import kimik3
from kimik3.hf import KimiK3Cache, KimiK3Config, KimiK3ForConditionalGeneration
from kimik3.inference import SamplingParams
from kimik3.inference.generate import generate
from kimik3.presets import DEMO_MODEL

REFERENCE_CONFIG = DEMO_MODEL.parents[1] / "configs" / "k3.json"


def test_auto_config_dispatch_keeps_kimi_linear_native():
    # kimi_k3 is ours; transformers' own kimi_linear is untouched, and the released auto_map is not followed
    cfg = AutoConfig.from_pretrained(DEMO_MODEL)
    assert isinstance(cfg, KimiK3Config)
    assert type(AutoConfig.for_model("kimi_linear")).__module__.startswith("transformers.")
    released = json.loads(REFERENCE_CONFIG.read_text())
    assert released["auto_map"] and released["text_config"]["model_type"] == "kimi_linear"
    k3 = KimiK3Config(**released).to_k3()
    assert k3.text.num_layers == 93 and k3.vision is not None


def test_released_auto_map_needs_no_remote_code(tmp_path):
    # the demo folder with the released config.json's auto_map and architectures: still our classes
    folder = tmp_path / "with-auto-map"
    shutil.copytree(DEMO_MODEL, folder)
    d = json.loads((folder / "config.json").read_text())
    released = json.loads(REFERENCE_CONFIG.read_text())
    d["auto_map"] = released["auto_map"]
    d["text_config"]["auto_map"] = released["text_config"]["auto_map"]
    (folder / "config.json").write_text(json.dumps(d))
    for auto in (AutoModelForCausalLM, AutoModel, AutoModelForImageTextToText):
        model = auto.from_pretrained(folder, dtype="float32")
        assert isinstance(model, KimiK3ForConditionalGeneration)
    assert not (folder / "modeling_kimi_k3.py").exists()


def test_logits_equal_kimik3_load_bit_for_bit(hf_model, k3_model):
    ids = torch.randint(0, 8000, (2, 13))
    with torch.no_grad():
        assert torch.equal(hf_model(input_ids=ids).logits, k3_model(ids))
    # the parameters are the released names, and the same values
    assert dict(hf_model.named_parameters()).keys() == dict(k3_model.named_parameters()).keys()


def test_dtype_and_device_map():
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, device_map="auto")  # the checkpoint's bf16, one device
    assert model.dtype == torch.bfloat16 and model.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="one device"):
        AutoModelForCausalLM.from_pretrained(DEMO_MODEL, device_map={"language_model": "cpu", "lm_head": "meta"})


def test_labels_give_the_shifted_loss(hf_model, k3_model):
    ids = torch.randint(0, 8000, (2, 11))
    labels = ids.clone()
    labels[0, :4] = -100
    with torch.no_grad():
        loss = hf_model(input_ids=ids, labels=labels).loss
        logits = k3_model(ids)
    want = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                             ignore_index=-100)
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=0)


def test_gradient_checkpointing_gives_the_same_gradients(hf_model):
    ids = torch.randint(0, 8000, (1, 17))
    hf_model.train()
    try:
        grads = []
        for checkpointing in (False, True):
            hf_model.zero_grad()
            if checkpointing:
                with warnings.catch_warnings():  # transformers 5 renames it activation_checkpointing_enable
                    warnings.simplefilter("ignore", FutureWarning)
                    hf_model.gradient_checkpointing_enable()
                assert hf_model.is_gradient_checkpointing
            hf_model(input_ids=ids, labels=ids).loss.backward()
            grads.append(hf_model.language_model.model.layers[1].self_attn.q_proj.weight.grad.clone())
    finally:
        hf_model.activation_checkpointing_disable()
        hf_model.zero_grad(set_to_none=True)
        hf_model.eval()
    assert not hf_model.is_gradient_checkpointing
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-7)


def test_save_pretrained_writes_the_released_layout(hf_model, tmp_path):
    out = hf_model.save_pretrained(tmp_path / "saved", experts="bf16")
    assert {"config.json", "model.safetensors.index.json", "tiktoken.model"} <= {p.name for p in out.iterdir()}
    assert json.loads((out / "config.json").read_text())["text_config"]["model_type"] == "kimi_linear"
    back = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.randint(0, 8000, (1, 7))
    with torch.no_grad():  # stored bf16 (the config's dtype): the round trip is the bf16 rounding of the weights
        assert (back(input_ids=ids).logits - hf_model(input_ids=ids).logits).abs().max() < 0.1
    reloaded = kimik3.load(out, dtype=torch.float32, quiet=True)
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids).logits, reloaded(ids))


def test_left_padding_without_a_cache_is_each_row_alone(hf_model, k3_model):
    a, b = [5, 6, 7, 8, 9], [11, 12, 13]
    ids = torch.tensor([a, [0, 0] + b])
    mask = torch.tensor([[1] * 5, [0, 0, 1, 1, 1]])
    with torch.no_grad():
        out = hf_model(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(out[1, 2:], k3_model(torch.tensor([b]))[0], rtol=1e-5, atol=1e-5)
        right = hf_model(input_ids=torch.tensor([b + [0, 0]]), attention_mask=torch.tensor([[1, 1, 1, 0, 0]])).logits
        # right padding needs no mask (causal); another length reorders float sums, hence close, not equal
        torch.testing.assert_close(right[0, :3], k3_model(torch.tensor([b]))[0], rtol=1e-5, atol=1e-5)


def test_greedy_generate_equals_kimik3_generate(hf_model, hf_tok, k3_model, demo_tok):
    prompts = ["ROMEO:", "To be, or not to be"]
    batch = hf_tok(prompts, return_tensors="pt", padding=True, padding_side="left")
    out = hf_model.generate(**batch, max_new_tokens=12, do_sample=False)
    want = generate(k3_model, [demo_tok.encode(p) for p in prompts],
                    SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))
    for row, w in zip(out, want):
        assert row[batch.input_ids.shape[1]:].tolist()[:len(w.token_ids)] == w.token_ids


def test_generate_stops_at_the_models_positions_as_kimik3_generate_does(hf_model, hf_tok):
    """A prompt past max_position_embeddings, or max_new_tokens that would run past it, is a ValueError before any
    forward (transformers checks only its own max_length, which max_new_tokens overrides)."""
    positions = hf_model.k3_config.text.max_position_embeddings
    long = torch.randint(0, 8000, (1, positions + 10))
    with pytest.raises(ValueError, match=f"a prompt of {positions + 10} tokens leaves no room for output within the "
                                         f"model's {positions} positions"):
        hf_model.generate(long, max_new_tokens=4)
    ids = hf_tok("ROMEO:", return_tensors="pt").input_ids
    with pytest.raises(ValueError, match=f"max_new_tokens 100000 exceed the model's {positions} positions .*lower "
                                         f"max_new_tokens to {positions - ids.shape[1]}"):
        hf_model.generate(ids, max_new_tokens=100000)
    room = positions - ids.shape[1]
    with pytest.raises(ValueError, match="exceed"):
        hf_model.generate(ids, max_new_tokens=room + 1)
    assert hf_model.generate(ids, max_new_tokens=2).shape[1] == ids.shape[1] + 2


def test_generate_at_the_demos_defaults_is_quiet(hf_model, hf_tok, capfd):
    """No 'flags not valid' (temperature, top_p without do_sample) and no 'max_new_tokens and max_length both
    set': the demo's generation_config.json says it samples, and holds no max_length of its own."""
    batch = hf_tok(["ROMEO:"], return_tensors="pt")
    capfd.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hf_model.generate(**batch, max_new_tokens=4)
        hf_model.generate(**batch, max_new_tokens=4, do_sample=False)
    err = capfd.readouterr().err
    assert "not valid" not in err and "seem to have been set" not in err, err


def test_sampling_with_a_seed_is_reproducible(hf_model, hf_tok):
    batch = hf_tok(["ROMEO:"], return_tensors="pt")
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        runs.append(hf_model.generate(**batch, max_new_tokens=10, do_sample=True, temperature=1.0, top_k=0).tolist())
    assert runs[0] == runs[1]


def test_the_cache_is_a_transformers_cache_over_kimik3_state(hf_model):
    from transformers import Cache

    ids = torch.randint(0, 8000, (1, 9))
    cache = KimiK3Cache(hf_model.new_cache, 16)
    assert isinstance(cache, Cache)
    with torch.no_grad():
        first = hf_model(input_ids=ids[:, :6], cache=cache).logits
        rest = [hf_model(input_ids=ids[:, t:t + 1], cache=cache).logits for t in range(6, 9)]
        full = hf_model(input_ids=ids).logits
    assert cache.get_seq_length() == 9
    torch.testing.assert_close(torch.cat([first] + rest, 1), full, rtol=1e-5, atol=1e-5)
    with pytest.raises(NotImplementedError, match="beam"):
        cache.reorder_cache(torch.tensor([0]))
