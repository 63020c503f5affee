"""Chat JSONL training data: the assistant mask through tokenization, shards, packing, the chunked loss and a run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kimik3.model import K3ForCausalLM
from kimik3.tokenizer import Tokenizer, encode_chat_with_mask
from kimik3.train import Trainer
from kimik3.train.config import from_dict
from kimik3.train.data import IGNORE_INDEX, RowSampler, open_stream, pack_rows, prepare_shards
from kimik3.train.loss import CausalLMLoss
from kimik3.train.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
BYTES = str(REPO / "configs/train/bytes.tiktoken")  # 256 byte ranks + K3's specials: [EOS] 257, <|end_of_msg|> 258
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}


def chats(n: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    words = ["rain", "sun", "wind", "snow", "fog", "hail", "storm", "calm"]

    def say(k):
        return " ".join(rng.choice(words, k))

    out = []
    for i in range(n):
        msgs = [{"role": "user", "content": say(4)}, {"role": "assistant", "content": say(6)}]
        if i % 2:
            call = {"id": "c", "type": "function", "function": {"name": "weather", "arguments": {"city": say(1)}}}
            msgs += [{"role": "user", "content": say(3)}, {"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "c", "content": say(2)},
                     {"role": "assistant", "content": say(5), "reasoning_content": say(3)}]
        out.append({"messages": msgs, **({"tools": [WEATHER]} if i % 2 else {"thinking": False})})
    return out


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def expected(tok: Tokenizer, records: list, eos: int) -> tuple[list[int], list[bool]]:
    """The stream built here from the chat encoder: each document's ids and mask, then an untrained EOS."""
    ids, mask = [], []
    for r in records:
        if isinstance(r, str):
            doc = tok.encode(r)
            ids += doc + [eos]
            mask += [True] * (len(doc) + 1)
            continue
        opts = {k: v for k, v in r.items() if k != "messages"}
        doc, doc_mask = encode_chat_with_mask(tok, r["messages"], add_generation_prompt=False, **opts)
        ids += doc + [eos]
        mask += doc_mask + [False]
    return ids, mask


def test_chat_jsonl_stream_carries_the_assistant_mask(tmp_path):
    tok = Tokenizer.from_file(BYTES)
    records = chats(5, seed=0)
    path = write_jsonl(tmp_path / "chat.jsonl", records[:3] + [{"text": "plain words"}] + records[3:])
    stream = open_stream([str(path)], "data.train", BYTES)
    want_ids, want_mask = expected(tok, records[:3] + ["plain words"] + records[3:], stream.eos_id)
    assert stream.read(0, stream.num_tokens).tolist() == want_ids
    assert stream.read_mask(0, stream.num_tokens).tolist() == want_mask
    assert 0 < sum(want_mask) < len(want_mask)
    # the same through a shard folder (mask shards beside the token shards), split over several files
    out = prepare_shards([str(path)], BYTES, tmp_path / "shards", shard_tokens=100)
    meta = json.loads((out / "meta.json").read_text())
    assert len(meta["mask_files"]) == len(meta["files"]) > 1
    shards = open_stream([str(out)], "data.train")
    assert shards.read(0, shards.num_tokens).tolist() == want_ids
    assert shards.read_mask(0, shards.num_tokens).tolist() == want_mask
    # text-only data carries no mask (every token is a label), as before
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"text": "a b"}, {"text": "c", "source": "x"}])
    assert open_stream([str(plain)], "data.train", BYTES).masks is None
    assert "mask_files" not in json.loads((prepare_shards([str(plain)], BYTES, tmp_path / "p") / "meta.json")
                                          .read_text())


def test_pack_rows_masks_labels():
    rows = np.array([[1, 2, 3, 9, 4, 5, 6]])
    mask = np.array([[0, 0, 1, 0, 0, 1, 1]], dtype=bool)  # label j is trained where mask[j + 1]
    mb = pack_rows(rows, 9, mask)
    assert mb.labels.tolist() == [[IGNORE_INDEX, 3, IGNORE_INDEX, IGNORE_INDEX, 5, 6]]
    assert mb.num_targets == 3


@pytest.mark.parametrize("line, match", [
    ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant turn"),
    ('{"messages": [], "tool": []}', "unknown key 'tool'"),
    ('{"messages": [{"role": "bot", "content": "x"}]}', r"messages\[0\].role"),
    ('{"message": []}', 'a "text" string or a "messages" list'),
    ('{"messages": [{"role": "assistant", "content": "x"}], "thinking": "no"}', '"thinking" must be true or false'),
    ('{"text": "a"', "not valid JSON"),
])
def test_bad_chat_lines_name_file_and_line(tmp_path, line, match):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n' + line + "\n")
    with pytest.raises(ValueError, match=rf"bad.jsonl:2: .*{match}"):
        open_stream([str(path)], "data.train", BYTES)


def test_masked_positions_have_zero_gradient(tmp_path, tiny_config):
    """Through the chunked loss: the loss is the CE of the assistant labels alone (vs an independent full-logits
    CE), the final hidden state of every untrained position gets exactly zero gradient, every trained one some."""
    path = write_jsonl(tmp_path / "chat.jsonl", chats(4, seed=1))
    stream = open_stream([str(path)], "data.train", BYTES)
    sampler = RowSampler(stream, 96, tiny_config.text.vocab_size, shuffle=False)
    mb = sampler.micro_batches(0, 1, 2)[0]
    ids = stream.read(0, 2 * 96 + 1)
    trained = stream.read_mask(0, 2 * 96 + 1)
    lm = K3ForCausalLM(tiny_config.text, torch.float32).init_weights(seed=3)
    captured = {}

    def keep(module, args, out):
        if out.requires_grad:  # not in the no-grad reference forward below
            out.retain_grad()
            captured["h"] = out

    lm.model.norm.register_forward_hook(keep)
    loss = CausalLMLoss(lm, chunk_tokens=24)(mb.input_ids, mb.labels, mb.cu_seqlens)
    loss.backward()
    grad = captured["h"].grad[0].abs().amax(-1)
    # independent labels: row r's label j is ids[r*96 + j + 1], trained when its mask is set (and not after an EOS)
    want = torch.zeros(2 * 96, dtype=torch.bool)
    for r in range(2):
        for j in range(96):
            k = r * 96 + j
            want[k] = bool(trained[k + 1]) and bool(ids[k] != stream.eos_id)
    assert (mb.labels[0] != IGNORE_INDEX).tolist() == want.tolist() and 0 < int(want.sum()) < 2 * 96
    assert torch.equal(grad[~want], torch.zeros_like(grad[~want])), "an untrained position has a gradient"
    assert bool((grad[want] > 0).all())
    with torch.no_grad():
        logits = lm(mb.input_ids, cu_seqlens=mb.cu_seqlens)
        logits = getattr(logits, "logits", logits)[0].float()
        ref = F.cross_entropy(logits[want], mb.labels[0][want], reduction="sum")
    assert abs(float(loss.detach()) - float(ref)) / float(ref) < 1e-5


def test_trainer_runs_on_chat_jsonl(tmp_path):
    """A tiny run on chat JSONL: finite, falling loss over the assistant tokens only (the step's token count is
    every position, its targets the masked labels)."""
    path = write_jsonl(tmp_path / "chat.jsonl", chats(12, seed=2))
    raw = {"out_dir": str(tmp_path / "run"), "model": {"config": "tiny"},
           "data": {"train": [str(path)], "tokenizer": BYTES, "seq_len": 64, "shuffle": False},
           "train": {"steps": 8, "micro_batch_rows": 2}, "optim": {"lr": 3e-3, "warmup_steps": 1},
           "log": {"progress": False}, "balancing": {"method": "frozen"}}
    trainer = Trainer(from_dict(raw))
    assert trainer.train_rows.stream.masks is not None
    assert trainer.run() == "done"
    trainer.close()
    records = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    losses = [r["loss"] for r in records]
    assert len(losses) == 8 and all(np.isfinite(losses)) and losses[-1] < losses[0]
