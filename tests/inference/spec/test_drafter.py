"""The DSpark-style drafter: config checks, taps, and the safetensors round trip."""

import json

import pytest
import torch

from kimik3.inference.spec.drafter import DraftConfig, DSparkDrafter
from kimik3.inference.spec.dspark import DSparkProposer, load_drafter, save_drafter
from kimik3.inference.spec.taps import stack_taps, tapped
from kimik3.model import K3ForCausalLM
from kimik3.presets import load_config


def _cfg(**kw) -> DraftConfig:
    base = dict(target_layer_ids=(0, 2), target_hidden_size=48, target_num_hidden_layers=4, vocab_size=100,
                mask_token_id=97, hidden_size=48, num_hidden_layers=2, num_attention_heads=3, head_dim=8,
                intermediate_size=40, block_size=5, markov_rank=6)
    return DraftConfig(**{**base, **kw})


def test_round_trip(tmp_path):
    d = DSparkDrafter(_cfg())
    with torch.no_grad():
        for p in d.parameters():
            p.normal_()
    save_drafter(d, tmp_path / "fp32", dtype=torch.float32)
    back = load_drafter(tmp_path / "fp32")
    assert back.config == d.config
    for (k, a), (k2, b) in zip(d.state_dict().items(), back.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k
    save_drafter(d, tmp_path / "bf16")  # the default: bf16 on disk, fp32 once loaded
    back = load_drafter(tmp_path / "bf16")
    for k, v in d.state_dict().items():
        assert torch.equal(back.state_dict()[k], v.bfloat16().float()), k
    raw = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert raw["model_type"] == "k3_dspark" and raw["target_layer_ids"] == [0, 2]


def test_load_errors_name_the_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    save_drafter(DSparkDrafter(_cfg()), tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    state["fc.weight"] = state["fc.weight"][:, :5].contiguous()
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="fc.weight"):
        load_drafter(tmp_path)
    del state["fc.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="fc.weight"):
        load_drafter(tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_drafter(tmp_path / "nothing")


@pytest.mark.parametrize("kw,field", [(dict(hidden_size=40), "hidden_size"), (dict(block_size=1), "block_size"),
                                      (dict(target_layer_ids=(0, 4)), "target_layer_ids"),
                                      (dict(mask_token_id=100), "mask_token_id"), (dict(head_dim=7), "head_dim")])
def test_config_errors_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        _cfg(**kw)


def test_taps_are_the_residual_stream():
    """Layer i's tap is the embedding plus every attention and FFN output of layers 0..i (the stream a plain
    pre-norm transformer carries), whichever AttnRes block the layer is in."""
    cfg = load_config("tiny").text
    lm = K3ForCausalLM(cfg, torch.float32).init_weights(0).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    parts = []
    hooks = [m.register_forward_hook(lambda mod, a, o: parts.append(o)) for layer in lm.model.layers
             for m in (layer.self_attn, layer.ffn)]
    every = tuple(range(cfg.num_layers))
    with torch.no_grad(), tapped(lm, every) as found:
        lm(ids)
    for h in hooks:
        h.remove()
    stream = lm.model.embed_tokens(ids).detach()
    for i in every:
        stream = stream + parts[2 * i] + parts[2 * i + 1]
        torch.testing.assert_close(found[i], stream, rtol=1e-5, atol=1e-5)
    assert stack_taps(found).shape == (2, 9, cfg.num_layers * cfg.hidden_size)
    with pytest.raises(ValueError, match="target_layer_ids"):
        with tapped(lm, (cfg.num_layers,)):
            pass


def test_proposer_contract():
    cfg = load_config("tiny").text
    lm = K3ForCausalLM(cfg, torch.float32).init_weights(0).eval()
    dc = _cfg(target_layer_ids=(0, 1), target_hidden_size=cfg.hidden_size, hidden_size=cfg.hidden_size,
              target_num_hidden_layers=cfg.num_layers, vocab_size=cfg.vocab_size, mask_token_id=cfg.vocab_size - 3)
    prop = DSparkProposer(DSparkDrafter(dc).eval(), lm, sample=True, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, cfg.vocab_size, (1, 6))
    with torch.no_grad(), tapped(lm, dc.target_layer_ids) as found:
        lm(ids)
    taps = stack_taps(found)[0]
    draft = prop.propose(0, ids[0].tolist() + [3], 9, taps)
    assert len(draft.tokens) == dc.num_drafts and draft.probs.shape == (dc.num_drafts, cfg.vocab_size)
    torch.testing.assert_close(draft.probs.sum(-1), torch.ones(dc.num_drafts))
    with pytest.raises(ValueError, match="taps of 6 positions"):
        prop.propose(0, ids[0].tolist() + [3, 4], 3)
    cut = DSparkProposer(prop.drafter, lm, min_confidence=1.0)  # confidence < 1: only the first token
    assert len(cut.propose(1, ids[0].tolist() + [3], 4, taps).tokens) == 1
