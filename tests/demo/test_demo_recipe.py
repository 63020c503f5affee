"""recipes/demo/evaluate.py: scores the shipped model with no trainer checkpoint, from any directory, in fp32 and
with the routed experts zeroed (the model card's CPU figures), on a corpus cut to small rows so CI can afford it."""

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from kimik3.model.moe import Experts
from kimik3.presets import DEMO_MODEL

REPO = Path(__file__).resolve().parents[2]
LINES = ["ROMEO:\nBut soft, what light through yonder window breaks?\n", "JULIET:\nO Romeo, Romeo, wherefore art "
         "thou Romeo?\n", "MERCUTIO:\nA plague o' both your houses!\n", "FRIAR:\nThese violent delights have "
         "violent ends.\n"]


@pytest.fixture
def evaluate(monkeypatch):
    spec = importlib.util.spec_from_file_location("demo_evaluate", REPO / "recipes" / "demo" / "evaluate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "SEQ_LEN", 32)  # the recipe's 512-token rows in micro-batches of 16, made small
    monkeypatch.setattr(module, "ROWS", 2)
    return module


def corpus(root: Path) -> Path:
    for split, n in (("train", 6), ("val", 3)):
        (root / split).mkdir(parents=True)
        for i in range(n):
            (root / split / f"work{i}.txt").write_text("".join(LINES[(i + j) % 4] for j in range(5)))
    return root


def test_evaluate_runs_on_the_shipped_model_from_anywhere(evaluate, tmp_path, monkeypatch):
    data = corpus(tmp_path / "corpus")
    monkeypatch.chdir(tmp_path)  # not the repository root
    report = evaluate.main(["--data", str(data), "--precision", "fp32", "--zero-experts", "--no-samples",
                            "--device", "cpu", "--out", "eval.json"])
    assert report["model"] == str(DEMO_MODEL) and (tmp_path / "eval.json").is_file()
    assert report["val_rows_scored"] == report["val_rows"] - report["val_rows"] % 2 > 0
    losses = {k: v["loss_per_token"] for k, v in report["models"].items()}
    assert set(losses) == {"model (MXFP4 experts)", "model, routed experts zeroed", "unigram"}
    assert all(math.isfinite(v) and v > 0 for v in losses.values())
    assert losses["model, routed experts zeroed"] != losses["model (MXFP4 experts)"]


def test_zero_routed_experts_zeroes_every_routed_expert_only(evaluate):
    lm = evaluate.load_lm(DEMO_MODEL, torch.device("cpu"), "fp32")
    shared = {n: p.clone() for n, p in lm.named_parameters() if "shared" in n}
    assert evaluate.zero_routed_experts(lm) == 7  # layers 1-7 are MoE
    experts = [m for m in lm.modules() if isinstance(m, Experts)]
    assert experts and all(int(torch.count_nonzero(w)) == 0 for m in experts for w in (m.w1, m.w2, m.w3))
    assert shared and all(torch.equal(p, shared[n]) for n, p in lm.named_parameters() if n in shared)


def test_missing_corpus_says_make_demo_data(evaluate, tmp_path):
    with pytest.raises(FileNotFoundError, match="make demo-data"):
        evaluate.main(["--data", str(tmp_path / "nothing"), "--no-samples"])
