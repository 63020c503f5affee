"""Parameter groups, Muon + AdamW, and the learning-rate schedules."""

from __future__ import annotations

import math

import pytest
import torch

from kimik3.model import K3ForCausalLM
from kimik3.train.optim import build_optimizer, lr_factor, param_groups


def test_param_groups(tiny_config):
    lm = K3ForCausalLM(tiny_config.text, torch.float32)
    groups = {k: dict(v) for k, v in param_groups(lm, use_muon=True).items()}
    muon, decay, plain = groups["muon"], groups["decay"], groups["plain"]
    assert len(muon) + len(decay) + len(plain) == len(list(lm.parameters()))
    assert "model.layers.0.self_attn.q_proj.weight" in muon and "model.layers.1.block_sparse_moe.gate.weight" in muon
    assert "lm_head.weight" in decay and "model.embed_tokens.weight" in decay
    assert "model.layers.1.block_sparse_moe.experts.w1" in decay  # 3-D stacked experts stay with AdamW
    for name in ("model.norm.weight", "model.layers.0.self_attn.A_log", "model.layers.0.self_attn.q_conv1d.weight",
                 "model.layers.0.mlp_res_proj.weight"):
        assert name in plain
    assert not param_groups(lm, use_muon=False)["muon"]


def test_muon_and_adamw_step(tiny_config):
    lm = K3ForCausalLM(tiny_config.text, torch.float32).init_weights(0)
    opt = build_optimizer(lm, "muon", 1e-3, 0.1, (0.9, 0.95), 1e-8)
    assert [type(o).__name__ for o in opt.optimizers] == ["AdamW", "Muon"]
    before = {n: p.detach().clone() for n, p in lm.named_parameters()}
    lm(torch.randint(0, 300, (1, 12))).float().logsumexp(-1).mean().backward()
    opt.set_lr(0.5)
    assert all(g["lr"] == 0.5e-3 for g in opt.param_groups)
    opt.step()
    opt.zero_grad()
    moved = [n for n, p in lm.named_parameters() if not torch.equal(p, before[n])]
    assert "model.layers.0.self_attn.q_proj.weight" in moved and "lm_head.weight" in moved
    with pytest.raises(ValueError, match="optim.name"):
        build_optimizer(lm, "sgd", 1e-3, 0.1, (0.9, 0.95), 1e-8)


def test_schedules():
    f = lambda step, kind: lr_factor(step, 100, 10, kind, 0.1, 0.2)  # noqa: E731
    assert [f(s, "cosine") for s in (1, 5, 10)] == [0.1, 0.5, 1.0]
    assert math.isclose(f(55, "cosine"), 0.1 + 0.9 * 0.5) and math.isclose(f(100, "cosine"), 0.1)
    assert f(80, "wsd") == 1.0 and math.isclose(f(90, "wsd"), 0.55) and math.isclose(f(100, "wsd"), 0.1)
    assert f(11, "constant") == f(100, "constant") == 1.0
    assert lr_factor(1, 10, 0, "cosine", 0.0, 0.2) > 0.97  # no warmup: starts at the peak
