"""Parameter groups, Muon + AdamW, and the learning-rate schedules."""

from __future__ import annotations

import math

import pytest
import torch

from kimik3.model import K3ForCausalLM
from kimik3.train.optim import AdamW, build_optimizer, lr_factor, param_groups


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


@pytest.mark.parametrize("max_norm", [1e-3, 1e3, 0.0])  # clipped, under the limit, no limit
def test_clipping_folded_into_fused_adamw_equals_clip_then_step(tiny_config, max_norm):
    """The trainer's AdamW with the clip folded in (`grad_scale`) updates the weights as torch's
    clip_grad_norm_ followed by the foreach AdamW does, to fp32 rounding, and reports the same norm. Both get
    the same fresh random gradients each step (so the comparison is of the optimizers, not of two forwards)."""
    from kimik3.train.step import clip_and_update

    lm = K3ForCausalLM(tiny_config.text, torch.float32).init_weights(3)
    ref = K3ForCausalLM(tiny_config.text, torch.float32)
    ref.load_state_dict(lm.state_dict())
    opt = build_optimizer(lm, "adamw", 1e-2, 0.1, (0.9, 0.95), 1e-8)
    assert isinstance(opt.optimizers[0], AdamW) and opt.folds_clipping
    groups = param_groups(ref, use_muon=False)
    ref_opt = torch.optim.AdamW([{"params": [p for _, p in groups["decay"]], "weight_decay": 0.1},
                                 {"params": [p for _, p in groups["plain"]], "weight_decay": 0.0}],
                                lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=True)
    for _ in range(3):
        for p, q in zip(lm.parameters(), ref.parameters()):
            p.grad = torch.randn_like(p) * 0.1
            q.grad = p.grad.clone()
        norm = clip_and_update(lm, opt, max_norm)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm if max_norm > 0 else float("inf"))
        ref_opt.step()
        ref_opt.zero_grad()
        assert norm == ref_norm
        assert all(p.grad is None for p in lm.parameters())
    worst = max(((p - q).norm() / q.norm()).item() for p, q in zip(lm.parameters(), ref.parameters()))
    print(f"max_norm {max_norm}: weights after 3 steps, worst relative difference {worst:.1e}")
    assert worst < 1e-6, worst


def test_muon_clips_before_the_step(tiny_config):
    lm = K3ForCausalLM(tiny_config.text, torch.float32).init_weights(0)
    opt = build_optimizer(lm, "muon", 1e-3, 0.1, (0.9, 0.95), 1e-8)
    assert not opt.folds_clipping  # Muon has no fused update: the trainer clips the gradients in place first
    with pytest.raises(ValueError, match="folds_clipping"):
        opt.step(grad_scale=torch.tensor(2.0))
