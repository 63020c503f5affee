"""evaluate: the mean CE over the validation targets, and NaN (not ppl 1.0) when there are none."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kimik3.model import K3ForCausalLM
from kimik3.train.data import IGNORE_INDEX, MicroBatch
from kimik3.train.loss import CausalLMLoss, plain_cross_entropy
from kimik3.train.step import evaluate
from tests.helpers import randomize, rel_err

CPU = torch.device("cpu")


def _batch(vocab: int, masked_every: int | None) -> MicroBatch:
    """One packed row of two documents; labels IGNORE_INDEX at every position when masked_every is None."""
    ids = torch.randint(0, vocab, (1, 24))
    labels = torch.roll(ids, -1, 1)
    if masked_every is None:
        labels[:] = IGNORE_INDEX
    else:
        labels[0, ::masked_every] = IGNORE_INDEX
    return MicroBatch(ids, labels, torch.tensor([0, 10, 24]), int((labels != IGNORE_INDEX).sum()))


def test_mean_over_targets(tiny_config):
    torch.manual_seed(0)
    lm = randomize(K3ForCausalLM(tiny_config.text, torch.float32), seed=3)
    batches = [_batch(tiny_config.text.vocab_size, 3), _batch(tiny_config.text.vocab_size, None),
               _batch(tiny_config.text.vocab_size, 5)]
    out = evaluate(CausalLMLoss(lm, chunk_tokens=7), batches, device=CPU, precision="fp32")
    n = sum(mb.num_targets for mb in batches)
    ref = sum(plain_cross_entropy(lm(mb.input_ids, cu_seqlens=mb.cu_seqlens), mb.labels) for mb in batches) / n
    assert out["eval_tokens"] == n
    assert rel_err(torch.tensor(out["eval_loss"]), ref) < 1e-5
    assert rel_err(torch.tensor(out["eval_ppl"]), ref.exp()) < 1e-5


def test_no_target_tokens_is_nan_not_a_perfect_model(tiny_config):
    # validation rows whose loss mask is all zero (chat without an assistant turn) used to report ppl 1.0
    torch.manual_seed(0)
    model = CausalLMLoss(randomize(K3ForCausalLM(tiny_config.text, torch.float32), seed=3))
    batches = [_batch(tiny_config.text.vocab_size, None) for _ in range(2)]
    out = evaluate(model, batches, device=CPU, precision="fp32")
    assert out["eval_tokens"] == 0
    assert math.isnan(out["eval_loss"]) and math.isnan(out["eval_ppl"])
    assert model.training  # evaluation hands the model back in training mode


def test_metrics_log_writes_strict_json(tmp_path):
    """A NaN evaluation (no trained tokens) is written as null, at any depth: strict JSON readers accept the file."""
    from kimik3.train.metrics import MetricsLog, read_metrics

    log = MetricsLog(tmp_path / "metrics.jsonl", enabled=True, resume_step=None)
    log.write({"step": 3, "eval_loss": float("nan"), "eval_ppl": float("inf"), "qb": {"layer": [1.0, float("-inf")]}})
    line = (tmp_path / "metrics.jsonl").read_text().strip()
    json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 3, "eval_loss": None, "eval_ppl": None,
                                                          "qb": {"layer": [1.0, None]}}]
