"""Packing, document boundaries, no cross-document leakage, shards, text tokenization, row placement."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kimik3.model import K3ForCausalLM
from kimik3.train.data import (
    IGNORE_INDEX,
    RowSampler,
    TokenStream,
    eval_batches,
    open_stream,
    pack_rows,
    prepare_shards,
    step_batches,
)
from kimik3.train.loss import CausalLMLoss
from tests.helpers import randomize

EOS = 9
BYTES = "configs/train/bytes.tiktoken"


def test_pack_rows_boundaries_and_labels():
    rows = np.array([[1, 2, EOS, 3, 4, 5, EOS],  # T = 6: inputs 1 2 EOS 3 4 5, labels 2 EOS 3 4 5 EOS
                     [6, EOS, 7, 8, EOS, EOS, 1]])
    mb = pack_rows(rows, EOS)
    assert mb.input_ids.tolist() == [[1, 2, EOS, 3, 4, 5, 6, EOS, 7, 8, EOS, EOS]]
    assert mb.labels.tolist() == [[2, EOS, IGNORE_INDEX, 4, 5, EOS, EOS, IGNORE_INDEX, 8, EOS, IGNORE_INDEX,
                                   IGNORE_INDEX]]
    assert mb.cu_seqlens.tolist() == [0, 3, 6, 8, 11, 12]  # after each EOS, at the row end; no empty document
    assert mb.num_targets == 8


def test_no_cross_document_leakage(tiny_config):
    """The loss of document 2 has exactly zero gradient w.r.t. document 1's embeddings (and vice versa)."""
    lm = randomize(K3ForCausalLM(tiny_config.text, torch.float32), seed=2)
    rows = np.concatenate([np.random.default_rng(0).integers(0, 250, 30), [EOS],
                           np.random.default_rng(1).integers(0, 250, 17), [EOS]])[None]
    mb = pack_rows(rows, EOS)
    first_doc = int(mb.cu_seqlens[1])
    captured = {}

    def keep(module, args, out):
        out.retain_grad()
        captured["emb"] = out

    lm.model.embed_tokens.register_forward_hook(keep)
    for doc in (0, 1):
        labels = mb.labels.clone()
        if doc == 0:
            labels[:, first_doc:] = IGNORE_INDEX
        else:
            labels[:, :first_doc] = IGNORE_INDEX
        CausalLMLoss(lm, chunk_tokens=8)(mb.input_ids, labels, mb.cu_seqlens).backward()
        g = captured["emb"].grad[0]
        other = g[first_doc:] if doc == 0 else g[:first_doc]
        own = g[:first_doc] if doc == 0 else g[first_doc:]
        assert own.abs().max() > 0 and torch.equal(other, torch.zeros_like(other)), f"document {doc} leaks"
        lm.zero_grad()


def test_token_stream_reads_across_shards():
    s = TokenStream([np.arange(5, dtype=np.uint32), np.arange(5, 9, dtype=np.uint32), np.zeros(0, np.uint32),
                     np.arange(9, 12, dtype=np.uint32)], EOS, "t")
    assert s.read(3, 8).tolist() == list(range(3, 11)) and s.num_tokens == 12


def test_prepare_and_open_shards(tmp_path):
    docs = [tmp_path / "a.txt", tmp_path / "b.jsonl"]
    docs[0].write_text("hello world")
    docs[1].write_text(json.dumps({"text": "one"}) + "\n\n" + json.dumps({"text": "two!"}) + "\n")
    out = prepare_shards([str(d) for d in docs], BYTES, tmp_path / "shards", shard_tokens=7)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["eos_id"] == 257 and meta["num_tokens"] == 11 + 1 + 3 + 1 + 4 + 1 and len(meta["files"]) == 3
    stream = open_stream([str(out)], "data.train")
    text = open_stream([str(d) for d in docs], "data.train", tokenizer=BYTES)
    assert stream.read(0, stream.num_tokens).tolist() == text.read(0, text.num_tokens).tolist()
    ids = stream.read(0, stream.num_tokens).tolist()
    assert bytes(ids[:11]).decode() == "hello world" and ids[11] == 257 and bytes(ids[12:15]) == b"one"
    bins = open_stream([str(out / "*.bin")], "data.train", eos_id=257)  # raw .bin files need eos_id
    assert bins.num_tokens == stream.num_tokens


def test_data_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="data.train: no file or folder matches"):
        open_stream([str(tmp_path / "missing*.txt")], "data.train", tokenizer=BYTES)
    (tmp_path / "x.txt").write_text("abc")
    with pytest.raises(ValueError, match="data.tokenizer"):
        open_stream([str(tmp_path / "x.txt")], "data.train")
    (tmp_path / "y.bin").write_bytes(b"\x01\x00\x00")
    with pytest.raises(ValueError, match="multiple of 4"):
        open_stream([str(tmp_path / "y.bin")], "data.train", eos_id=0)
    with pytest.raises(ValueError, match="data.eos_id"):
        open_stream([str(tmp_path / "y.bin")], "data.train")
    big = TokenStream([np.full(40, 400, dtype=np.uint32)], EOS, "data.valid")
    with pytest.raises(ValueError, match="token id 400 >= the model's vocab_size 300"):
        RowSampler(big, 8, 300).row(0)
    with pytest.raises(ValueError, match="do not fill one row"):
        RowSampler(TokenStream([np.arange(5, dtype=np.uint32)], EOS, "data.train"), 8, 300)


def test_rows_per_rank_cover_the_global_batch():
    """Two ranks x one micro-batch read exactly the rows of one rank x two micro-batches, and epochs wrap."""
    sampler = RowSampler(TokenStream([np.arange(200, dtype=np.uint32)], 999, "t"), 8, 1000, shuffle=True, seed=3)
    for step in range(4):
        single = step_batches(sampler, step, 0, 1, 2, 3)
        ranks = [step_batches(sampler, step, r, 2, 1, 3)[0] for r in range(2)]
        assert [b.input_ids.tolist() for b in single] == [b.input_ids.tolist() for b in ranks]
    positions = [sampler.row(p)[0] // 8 for p in range(sampler.num_rows * 2)]
    assert sorted(positions[:sampler.num_rows]) == list(range(sampler.num_rows))  # one epoch = a permutation
    assert positions[:sampler.num_rows] != positions[sampler.num_rows:]  # the next epoch reshuffles
    ev = eval_batches(RowSampler(sampler.stream, 8, 1000, shuffle=False), 10, 1, 2, 2)
    assert len(ev) == 2 and ev[0].input_ids[0, 0].item() == 16  # rank 1 starts at row 2
