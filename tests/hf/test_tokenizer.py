"""AutoTokenizer gives kimik3's ids, special tokens, decoding and XTML chat encoding."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizer

from kimik3.hf import KimiK3Tokenizer
from kimik3.presets import DEMO_MODEL
from kimik3.tokenizer import THINKING_EFFORTS, encode_chat, encode_chat_with_mask, render_chat
from tests.tokenizer.test_chat import WEATHER, _conversation

TEXTS = ["ROMEO: But soft, what light", "  spaces\n\nand\ttabs ", "Zürich — 東京 🙂", "a<|end_of_msg|>b[EOS]",
         "<|open|>message<|sep|>", ""]


def test_auto_tokenizer_is_a_pretrained_tokenizer(hf_tok):
    assert isinstance(hf_tok, KimiK3Tokenizer) and isinstance(hf_tok, PreTrainedTokenizer)


@pytest.mark.parametrize("text", TEXTS)
def test_ids_and_decoding_equal_kimik3(hf_tok, demo_tok, text):
    ids = demo_tok.encode(text, allow_special=True)  # text names special tokens: they are one id each
    assert hf_tok(text).input_ids == hf_tok.encode(text) == ids
    assert hf_tok.decode(ids) == demo_tok.decode(ids)
    assert hf_tok.convert_tokens_to_ids(hf_tok.convert_ids_to_tokens(ids)) == ids


def test_special_tokens(hf_tok, demo_tok):
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id, hf_tok.pad_token_id, hf_tok.unk_token_id) == (
        demo_tok.bos_id, demo_tok.eos_id, demo_tok.pad_id, demo_tok.unk_id)
    assert hf_tok.vocab_size == len(hf_tok) == demo_tok.vocab_size
    for name, i in demo_tok.special_ids.items():
        assert hf_tok.convert_tokens_to_ids(name) == i and hf_tok.decode([i]) == name
    ids = demo_tok.encode("hi<|end_of_msg|>", allow_special=True)
    assert hf_tok.decode(ids, skip_special_tokens=True) == "hi"


@pytest.mark.parametrize("thinking", [True, False])
def test_chat_template_is_the_xtml_encoder(hf_tok, demo_tok, thinking):
    msgs = _conversation()
    kw = {"tools": [WEATHER], "thinking": thinking}
    for gen in (True, False):
        got = hf_tok.apply_chat_template(msgs, add_generation_prompt=gen, return_dict=False, **kw)
        assert got == encode_chat(demo_tok, msgs, add_generation_prompt=gen, **kw)
    out = hf_tok.apply_chat_template(msgs, return_assistant_tokens_mask=True, **kw)
    ids, mask = encode_chat_with_mask(demo_tok, msgs, add_generation_prompt=False, **kw)
    assert out["input_ids"] == ids and out["assistant_masks"] == [int(m) for m in mask]
    assert hf_tok.apply_chat_template(msgs, tokenize=False, **kw) == render_chat(msgs, add_generation_prompt=False,
                                                                                 **kw)


@pytest.mark.parametrize("effort", THINKING_EFFORTS)
def test_effort_and_batches(hf_tok, demo_tok, effort):
    convs = [[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "A longer question here?"}]]
    out = hf_tok.apply_chat_template(convs, add_generation_prompt=True, thinking_effort=effort, padding=True,
                                     return_tensors="pt")
    want = [encode_chat(demo_tok, c, thinking_effort=effort) for c in convs]
    for row, mask, w in zip(out["input_ids"], out["attention_mask"], want):
        assert row[mask.bool()].tolist() == w
    assert isinstance(out["input_ids"], torch.Tensor)
    one = hf_tok.apply_chat_template(convs[0], add_generation_prompt=True, thinking_effort=effort, return_tensors="pt")
    assert one["input_ids"].tolist() == [want[0]]  # one conversation as tensors: a batch of one


def test_unknown_chat_argument_is_named(hf_tok):
    with pytest.raises(ValueError, match="thinking_efort"):
        hf_tok.apply_chat_template([{"role": "user", "content": "x"}], thinking_efort="max")


def test_save_and_reload(hf_tok, tmp_path):
    hf_tok.save_pretrained(tmp_path)
    assert (tmp_path / "tiktoken.model").read_bytes() == (DEMO_MODEL / "tiktoken.model").read_bytes()
    back = KimiK3Tokenizer.from_pretrained(tmp_path)
    assert back.encode(TEXTS[2]) == hf_tok.encode(TEXTS[2])


def test_released_tokenizer_config_needs_no_remote_code(tmp_path, hf_tok):
    # the release's tokenizer_config.json names its remote TikTokenTokenizer; the registered class wins
    folder = tmp_path / "released"
    shutil.copytree(DEMO_MODEL, folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "TikTokenTokenizer", "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer",
                                                                               None]}}))
    tok = AutoTokenizer.from_pretrained(folder)
    assert isinstance(tok, KimiK3Tokenizer) and tok.encode(TEXTS[0]) == hf_tok.encode(TEXTS[0])
