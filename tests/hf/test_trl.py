"""TRL's SFTTrainer on the demo model: a chat dataset through the tokenizer's template, assistant-only loss.

`slow`: TRL is not one of the chosen dependencies (design.md 5), so CI does not install it, and six CPU steps
take minutes on two cores. Run by hand (it passed with trl 1.16.0, transformers 5.24, on 2026-12-02):
    pip install trl && pytest -m slow tests/hf/test_trl.py
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from kimik3.presets import DEMO_MODEL

CHATS = [
    [{"role": "user", "content": "Who loves Juliet?"}, {"role": "assistant", "content": "Romeo, of the Montagues."}],
    [{"role": "user", "content": "Where is Elsinore?"}, {"role": "assistant", "content": "In Denmark, my lord."}],
    [{"role": "system", "content": "Speak as a fool."}, {"role": "user", "content": "What is the world?"},
     {"role": "assistant", "content": "A stage, and we but players."}],
    [{"role": "user", "content": "Who killed Duncan?"}, {"role": "assistant", "content": "Macbeth, at night."}],
]


@pytest.mark.slow
def test_sft_trainer_runs_with_assistant_only_loss(hf_tok, tmp_path):
    # imported here, not at collection: CI deselects this `slow` test rather than reporting a skip
    trl = pytest.importorskip("trl", reason="trl is not installed (pip install trl)")
    datasets = pytest.importorskip("datasets", reason="datasets is not installed")
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, dtype=torch.float32)
    data = datasets.Dataset.from_list([{"messages": c} for c in CHATS * 4])
    args = trl.SFTConfig(output_dir=str(tmp_path), max_steps=6, per_device_train_batch_size=4, learning_rate=3e-3,
                         logging_steps=1, report_to=[], assistant_only_loss=True, save_strategy="no",
                         use_cpu=True, dataloader_num_workers=0, bf16=False, fp16=False)
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=data, processing_class=hf_tok)
    row = trainer.train_dataset[0]
    # TRL folds the tokenizer's assistant_masks into labels: -100 outside the assistant's generated ids
    trained = hf_tok.decode([t for t, label in zip(row["input_ids"], row["labels"]) if label != -100])
    assert "Romeo, of the Montagues." in trained and "Who loves Juliet?" not in trained
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 6 and losses[-1] < losses[0], losses
