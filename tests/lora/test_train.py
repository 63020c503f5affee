"""`kimik3 train` with [lora] on the tiny MXFP4 base: what trains, what stays frozen, checkpoints, exact resume."""

from __future__ import annotations

import random

import pytest
import torch

from kimik3.lora.layers import LoraExperts, LoraLinear
from kimik3.model.moe import Router
from kimik3.train import Trainer
from kimik3.train.checkpointing import list_checkpoints
from kimik3.train.config import from_dict, load_train_config
from kimik3.train.metrics import read_metrics
from tests.helpers import REPO
from tests.lora.conftest import load_base

BYTES = str(REPO / "configs/train/bytes.tiktoken")
TARGETS = ["*.self_attn.q_proj", "*.block_sparse_moe.experts", "*.shared_experts.down_proj"]
pytestmark = pytest.mark.filterwarnings("ignore:quantile balancing with q")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-corpus")
    rng = random.Random(1)
    words = ["the", "captain", "hoists", "a", "sail", "at", "dawn", "and", "mate", "sings", "of", "sea"]
    for i in range(12):
        (root / f"doc{i:02d}.txt").write_text(" ".join(rng.choice(words) for _ in range(rng.randint(10, 60))))
    return root


def run_config(out, corpus, base_dir, **lora) -> dict:
    return {"out_dir": str(out), "model": {"checkpoint": str(base_dir)},
            "data": {"train": [str(corpus / "doc*.txt")], "tokenizer": BYTES, "seq_len": 32},
            "train": {"steps": 4, "micro_batch_rows": 2, "device": "cpu"},
            "optim": {"lr": 1e-2, "warmup_steps": 1, "weight_decay": 0.0},
            "log": {"progress": False}, "lora": {"rank": 4, "targets": TARGETS, **lora}}


@pytest.mark.parametrize("layout", ["per_expert", "shared_a"])
def test_every_target_trains_and_the_base_stays_bit_identical(tmp_path, corpus, base_dir, capsys, one_thread,
                                                              layout):
    trainer = Trainer(from_dict(run_config(tmp_path / "run", corpus, base_dir, experts=layout)))
    assert "LoRA adapter:" in capsys.readouterr().out  # printed before step 1
    routed: dict[str, set[int]] = {}

    def seen(name):
        def hook(module, args, out):
            if module.training:
                routed.setdefault(name, set()).update(out[0].unique().tolist())
        return hook

    for name, m in trainer.lm.named_modules():
        if isinstance(m, Router):
            m.register_forward_hook(seen(name.removesuffix(".gate")))
    before = {n: p.detach().clone() for n, p in trainer.lm.named_parameters() if p.requires_grad}
    assert trainer.run() == "done"
    state = {n: s for opt in trainer.optim.optimizers for p, s in opt.state.items()
             for n, q in trainer.lm.named_parameters() if q is p}
    modules = {n: m for n, m in trainer.lm.named_modules() if isinstance(m, (LoraLinear, LoraExperts))}
    assert modules
    for name, m in modules.items():
        for pname, p in [(n, q) for n, q in m.named_parameters() if q.requires_grad]:
            full = f"{name}.{pname}"
            moved = (p.detach() != before[full]).flatten(1) if p.ndim == 3 else (p.detach() != before[full])[None]
            history = state[full]["exp_avg_sq"].flatten(1) if p.ndim == 3 else state[full]["exp_avg_sq"][None]
            if isinstance(m, LoraExperts) and p.shape[0] > 1:  # per expert: every expert that got tokens
                rows = sorted(routed[name.removesuffix(".experts")])
                assert rows, name
            else:
                rows = [0]
            for e in rows:
                assert moved[e].any() and (history[e] > 0).any(), (full, e)
    base = load_base(base_dir).language_model.state_dict()
    trained = {k: v for k, v in trainer.lm.state_dict().items() if "lora_" not in k}
    assert trained.keys() == base.keys()
    assert [k for k in base if not torch.equal(trained[k], base[k])] == []
    last = list_checkpoints(tmp_path / "run" / "checkpoints")[-1]
    assert (last / "adapter" / "adapter_model.safetensors").is_file() and not (last / "model").exists()


def test_resume_is_bit_exact(tmp_path, corpus, base_dir, one_thread):
    """4 steps straight == 2 steps, saved, then a new Trainer resuming to 4: losses and adapter."""
    a = Trainer(from_dict(run_config(tmp_path / "a", corpus, base_dir, dropout=0.1)))
    a.run()
    b = Trainer(from_dict(run_config(tmp_path / "b", corpus, base_dir, dropout=0.1)))
    assert b.run(stop_at=2) == "stopped"
    c = Trainer(from_dict(run_config(tmp_path / "b", corpus, base_dir, dropout=0.1)))
    assert c.step == 2 and c.run() == "done"
    losses = [[(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(t / "metrics.jsonl") if "loss" in r]
              for t in (tmp_path / "a", tmp_path / "b")]
    assert losses[0] == losses[1]
    fa = {n: p for n, p in a.lm.named_parameters() if p.requires_grad}
    fc = {n: p for n, p in c.lm.named_parameters() if p.requires_grad}
    assert all(torch.equal(fa[n], fc[n]) for n in fa)
    with pytest.raises(ValueError, match=r"\[lora\] settings"):
        Trainer(from_dict(run_config(tmp_path / "b", corpus, base_dir, dropout=0.2)))


def test_lora_section_is_checked(tmp_path, corpus, base_dir):
    raw = run_config(tmp_path, corpus, base_dir)
    with pytest.raises(ValueError, match="unknown key 'lora.ranks'"):
        from_dict({**raw, "lora": {"ranks": 4}})
    with pytest.raises(ValueError, match="lora.experts must be one of"):
        from_dict({**raw, "lora": {"experts": "every"}})
    with pytest.raises(ValueError, match="set 'model.checkpoint'"):
        from_dict({**raw, "model": {"config": "tiny"}})
    cfg = load_train_config(REPO / "recipes/lora/shanty.toml")
    assert cfg.lora is not None and cfg.lora.experts == "per_expert"
