"""`kimik3 train RUN.toml` with a [draft] table trains a drafter against the frozen demo target (loss falls)."""

import json

import pytest
import torch

from kimik3.cli import main
from kimik3.inference.spec.dspark import load_drafter
from kimik3.presets import DEMO_MODEL
from kimik3.train import load_train_config
from kimik3.train.draft import block_batch

RUN = """
out_dir = "{out}"
[draft]
target = "{target}"
target_layer_ids = [1, 7]
num_hidden_layers = 1
num_attention_heads = 2
head_dim = 16
intermediate_size = 96
block_size = 4
markov_rank = 8
anchors = 6
[data]
train = ["{text}"]
tokenizer = "{target}/tiktoken.model"
seq_len = 48
shuffle = false
[train]
steps = 12
micro_batch_rows = 2
device = "cpu"
[optim]
lr = 1e-2
schedule = "constant"
weight_decay = 0.0
[log]
progress = false
"""

TEXT = ("ROMEO:\nBut, soft! what light through yonder window breaks?\nIt is the east, and Juliet is the sun.\n"
        "Arise, fair sun, and kill the envious moon,\nWho is already sick and pale with grief.\n")


def _write(tmp_path, extra: str = "") -> str:
    (tmp_path / "text.txt").write_text(TEXT * 3)
    path = tmp_path / "run.toml"
    path.write_text(RUN.format(out=tmp_path / "out", target=DEMO_MODEL, text=tmp_path / "text.txt") + extra)
    return str(path)


def test_draft_run_trains_and_writes_a_drafter(tmp_path):
    assert main(["train", _write(tmp_path), "--no-progress"]) == 0
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 12
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3, losses
    drafter = load_drafter(tmp_path / "out" / "draft")
    assert drafter.config.target_layer_ids == (1, 7) and drafter.config.block_size == 4


@pytest.mark.parametrize("extra,message", [
    ("[model]\nconfig = 'tiny'\n", "remove the \\[model\\] table"),
    ("", None),
])
def test_draft_config_errors(tmp_path, extra, message):
    path = _write(tmp_path, extra)
    if message is None:
        cfg = load_train_config(path)
        assert cfg.draft.target_layer_ids == [1, 7] and cfg.to_dict()["draft"]["block_size"] == 4
        with pytest.raises(ValueError, match="draft.layerz"):
            load_train_config(path, ["draft.layerz=[1]"])
        with pytest.raises(ValueError, match=r"'draft.target_layer_ids' must be distinct layer indices in \[0, 8\)"):
            load_train_config(path, ["draft.target_layer_ids=[1, 8]"])  # the demo target has 8 layers
        with pytest.raises(ValueError, match="'draft.head_dim' must be a positive even number"):
            load_train_config(path, ["draft.head_dim=15"])
        with pytest.raises(ValueError, match="'draft.labels'"):
            load_train_config(path, ["draft.labels='argmax'"])
        with pytest.raises(ValueError, match="'draft.block_size'"):
            load_train_config(path, ["draft.block_size=1"])
        return
    with pytest.raises(ValueError, match=message):
        load_train_config(path)


def test_missing_target_names_the_field(tmp_path):
    _write(tmp_path)
    path = tmp_path / "run.toml"
    path.write_text(path.read_text().replace(f'target = "{DEMO_MODEL}"\n', ""))
    with pytest.raises(ValueError, match="'draft.target' is required"):
        load_train_config(path)


def test_block_batch_masks_and_labels():
    ids = torch.arange(10)[None] + 100
    labels = ids + 1000
    block, pos, mask, lab, prev = block_batch(ids, labels, torch.tensor([[2, 5]]), 3, mask_id=7)
    assert block.tolist() == [[102, 7, 7, 105, 7, 7]]
    assert pos.tolist() == [[2, 3, 4, 5, 6, 7]]
    assert lab[0, [1, 2, 4, 5]].tolist() == [1103, 1104, 1106, 1107]
    assert prev[0, [1, 2, 4, 5]].tolist() == [102, 1103, 105, 1106]
    ctx, own = mask[0, :, :10], mask[0, :, 10:]
    assert ctx[0].tolist() == [True, True] + [False] * 8 and ctx[3].sum() == 5  # positions before the anchor
    assert own[0].tolist() == [True] * 3 + [False] * 3 and own[4].tolist() == [False] * 3 + [True] * 3
