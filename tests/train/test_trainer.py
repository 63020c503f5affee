"""The trainer end to end on the tiny model: exact resume, checkpoints, signals, evaluation, errors, CLI."""

from __future__ import annotations

import copy
import json
import random
import signal

import pytest
import torch

from kimik3.checkpoint import load
from kimik3.cli import main
from kimik3.model.moe import Router
from kimik3.train import Trainer
from kimik3.train.checkpointing import list_checkpoints
from kimik3.train.config import from_dict
from kimik3.train.metrics import read_metrics
from kimik3.train.step import autocast, keep_routers_fp32
from tests.helpers import REPO, randomize

pytestmark = pytest.mark.filterwarnings("ignore:quantile balancing with q")
BYTES = str(REPO / "configs/train/bytes.tiktoken")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Twenty deterministic pseudo-English documents (byte-level ids < 256) and a validation file."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    words = ["the", "expert", "router", "balances", "tokens", "of", "a", "model", "kimi", "delta", "attention"]
    for i in range(20):
        (root / f"doc{i:02d}.txt").write_text(" ".join(rng.choice(words) for _ in range(rng.randint(5, 60))))
    (root / "valid.txt").write_text(" ".join(rng.choice(words) for _ in range(300)))
    return root


def run_config(out, corpus, **sections) -> dict:
    raw = {"out_dir": str(out), "model": {"config": "tiny"},
           "data": {"train": [str(corpus / "doc*.txt")], "tokenizer": BYTES, "seq_len": 32},
           "train": {"steps": 6, "micro_batch_rows": 2}, "optim": {"lr": 3e-3, "warmup_steps": 2},
           "log": {"progress": False}}
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return raw


def losses(out) -> list[tuple[int, float, float]]:
    return [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(out / "metrics.jsonl") if "loss" in r]


def final_state(out) -> dict[str, torch.Tensor]:
    return load(list_checkpoints(out / "checkpoints")[-1] / "model", dtype=torch.float32, quiet=True).state_dict()


def _interrupt_at(trainer: Trainer, step: int) -> None:
    """Deliver SIGINT during the forward of `step` (1-based), as a Ctrl-C would."""
    def hook(module, args, out):
        if trainer.step == step - 1 and module.training and not getattr(trainer, "_sent", False):
            trainer._sent = True
            signal.raise_signal(signal.SIGINT)
    trainer.lm.lm_head.register_forward_hook(hook)
    trainer.lm.model.norm.register_forward_hook(hook)


@pytest.mark.parametrize("optim, balancing", [("adamw", "qb"), ("muon", "sign")])
def test_resume_is_bit_exact(tmp_path, corpus, optim, balancing):
    """6 steps straight == 3 steps, Ctrl-C (saved), a new Trainer resuming to 6: losses, norms, weights, biases."""
    sections = {"optim": {"name": optim}, "balancing": {"method": balancing}}
    Trainer(from_dict(run_config(tmp_path / "a", corpus, **sections))).run()
    first = Trainer(from_dict(run_config(tmp_path / "b", corpus, **sections)))
    _interrupt_at(first, 3)
    assert first.run() == "interrupted" and first.step == 3
    first.close()
    second = Trainer(from_dict(run_config(tmp_path / "b", corpus, **sections)))
    assert second.step == 3 and second.run() == "done"
    a, b = losses(tmp_path / "a"), losses(tmp_path / "b")
    print(f"\n{optim}/{balancing} uninterrupted: {[x[1] for x in a]}\n{optim}/{balancing} resumed:       "
          f"{[x[1] for x in b]}")
    assert [x[0] for x in a] == list(range(1, 7)) and a == b
    sa, sb = final_state(tmp_path / "a"), final_state(tmp_path / "b")
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(k.endswith("e_score_correction_bias") and sa[k].abs().max() > 0 for k in sa)


def test_checkpoints_keep_load_and_partials(tmp_path, corpus):
    raw = run_config(tmp_path, corpus, train={"steps": 4}, checkpoint={"every": 1, "keep": 2})
    trainer = Trainer(from_dict(raw))
    trainer.run(stop_at=3)
    steps = list_checkpoints(tmp_path / "checkpoints")
    assert [p.name for p in steps] == ["step-00000002", "step-00000003"]
    loaded = load(steps[-1] / "model", quiet=True)  # the released layout: kimik3.load reads it back
    assert loaded.language_model.lm_head.weight.dtype == torch.float32
    assert all(torch.equal(a, b) for a, b in zip(loaded.language_model.state_dict().values(),
                                                 trainer.lm.state_dict().values()))
    assert json.loads((steps[-1] / "model" / "config.json").read_text())["dtype"] == "float32"
    partial = tmp_path / "checkpoints" / ".step-00000004.partial-dead"  # what a kill during a save leaves
    (partial / "model").mkdir(parents=True)
    resumed = Trainer(from_dict(raw))
    assert resumed.step == 3 and not partial.exists()
    resumed.run()
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == ["step-00000003", "step-00000004"]


def test_failed_save_keeps_the_last_good_checkpoint(tmp_path, corpus, monkeypatch):
    trainer = Trainer(from_dict(run_config(tmp_path, corpus, train={"steps": 2})))
    trainer.run(stop_at=1)

    def crash(*args, **kwargs):
        raise KeyboardInterrupt  # a kill in the middle of writing the weights

    monkeypatch.setattr("kimik3.checkpoint.save", crash)
    with pytest.raises(KeyboardInterrupt):
        trainer.run()
    root = tmp_path / "checkpoints"
    assert [p.name for p in root.iterdir()] == ["step-00000001"]
    assert load(root / "step-00000001" / "model", quiet=True) is not None


def test_eval_metrics_checkpointing_and_balance(tmp_path, corpus):
    raw = run_config(tmp_path, corpus, data={"valid": [str(corpus / "valid.txt")]}, eval={"every": 2, "rows": 4},
                     train={"steps": 4, "activation_checkpointing": True})
    Trainer(from_dict(raw)).run()
    records = read_metrics(tmp_path / "metrics.jsonl")
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4] and all(r["eval_tokens"] > 100 for r in evals)
    steps = [r for r in records if "loss" in r]
    layer = steps[0]["balance"]["layers"]["1"]
    assert {"max_mean", "maxvio", "min_mean", "cv", "dead", "bias_delta", "clamped"} <= set(layer)
    # activation checkpointing recomputes the router in backward: still counted once per token
    assert layer["tokens"] == steps[0]["tokens"] and layer["clamped"] == 0
    plain = run_config(tmp_path / "plain", corpus, train={"steps": 4})
    Trainer(from_dict(plain)).run()
    assert [x[1] for x in losses(tmp_path / "plain")] == [x[1] for x in losses(tmp_path)]


def test_bf16_autocast_keeps_router_fp32(tiny_config, tmp_path, corpus):
    router = randomize(torch.nn.ModuleList([Router(80, 8, 3, True, 1.0)]), seed=1)
    x = torch.randn(6, 80)
    _, _, ref = router[0](x)
    with autocast(torch.device("cpu"), "bf16"):
        _, _, cast = router[0](x)
        keep_routers_fp32(router)
        _, _, kept = router[0](x)
    assert not torch.equal(cast, ref) and torch.equal(kept, ref)
    Trainer(from_dict(run_config(tmp_path, corpus, train={"steps": 2, "precision": "bf16"}))).run()
    assert all(torch.isfinite(torch.tensor(x[1])) for x in losses(tmp_path))


def test_resume_refuses_a_different_run(tmp_path, corpus):
    Trainer(from_dict(run_config(tmp_path, corpus, train={"steps": 1}))).run()
    with pytest.raises(ValueError, match=r"different data.seq_len; resuming would not continue"):
        Trainer(from_dict(run_config(tmp_path, corpus, data={"seq_len": 16})))
    hf = copy.deepcopy(json.loads((REPO / "configs/tiny.json").read_text()))
    hf["text_config"]["intermediate_size"] = 120
    other = tmp_path / "other.json"
    other.write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=r"does not match model.config .*intermediate_size: 112 != 120"):
        Trainer(from_dict(run_config(tmp_path, corpus, model={"config": str(other)})))
    with pytest.raises(FileNotFoundError, match="data.train: no file or folder matches"):
        Trainer(from_dict(run_config(tmp_path / "new", corpus, data={"train": [str(corpus / "none*.txt")]})))


def test_cli(tmp_path, corpus, capsys):
    toml = tmp_path / "run.toml"
    toml.write_text(f'out_dir = "{tmp_path / "run"}"\n[model]\nconfig = "tiny"\n[data]\n'
                    f'train = "{tmp_path / "shards"}"\nseq_len = 32\n[train]\nsteps = 2\n')
    assert main(["train", "--prepare", str(tmp_path / "shards"), "--tokenizer", BYTES,
                 str(corpus / "doc00.txt"), str(corpus / "doc01.txt")]) == 0
    assert main(["train", str(toml), "--no-progress", "--set", "log.every=2"]) == 0
    assert "done at step 2/2" in capsys.readouterr().out
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [2]
    assert main(["train", str(toml), "--set", "train.stpes=3"]) == 2
    assert "unknown key 'train.stpes'; did you mean 'train.steps'" in capsys.readouterr().err


@pytest.mark.slow
def test_sigkill_then_resume_matches_uninterrupted(tmp_path, corpus):
    """A `kill -9` mid-run (a real process) loses only the steps since the last save; resuming is exact."""
    import os
    import subprocess
    import sys
    import time

    sections = {"train": {"steps": 12}, "checkpoint": {"every": 3}}
    Trainer(from_dict(run_config(tmp_path / "a", corpus, **sections))).run()
    raw = run_config(tmp_path / "b", corpus, **sections)
    toml = tmp_path / "b.toml"
    toml.write_text(f'out_dir = "{raw["out_dir"]}"\n[model]\nconfig = "tiny"\n'
                    f'[data]\ntrain = "{raw["data"]["train"][0]}"\ntokenizer = "{BYTES}"\nseq_len = 32\n'
                    f'[train]\nsteps = 12\nmicro_batch_rows = 2\n'
                    f'[optim]\nlr = 3e-3\nwarmup_steps = 2\n[checkpoint]\nevery = 3\n[log]\nprogress = false\n')
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.Popen([sys.executable, "-m", "kimik3", "train", str(toml)], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = tmp_path / "b" / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and (not metrics.exists() or len(read_metrics(metrics)) < 7):
        time.sleep(0.05)
    proc.kill()  # SIGKILL: no handler runs
    proc.wait()
    saved = int(list_checkpoints(tmp_path / "b" / "checkpoints")[-1].name.removeprefix("step-"))
    assert saved in (6, 9)  # the kill came after step 7 was logged
    resumed = Trainer(from_dict(raw))
    assert resumed.step == saved and resumed.run() == "done"
    assert losses(tmp_path / "a") == losses(tmp_path / "b")
