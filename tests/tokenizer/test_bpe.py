"""Tokenizer: loading, special-id layout, round trips, pre-tokenization, the long-input guard, streaming."""

from __future__ import annotations

import random

import pytest
import tiktoken

from kimik3.tokenizer import NUM_SPECIAL, PATTERN, SPECIAL_OFFSETS, Tokenizer
from kimik3.tokenizer.bpe import MAX_RUN_CHARS, _guard_chunks

regex = pytest.importorskip("regex")  # tiktoken depends on it; the oracle for the `&&` class syntax

SAMPLES = [
    "",
    "Hello, world!",
    "你好，世界！汉字和English混合",
    "Привет, мир! ÀÉÎÕÜ àéîõü",
    "Emoji 😀👍🏽🇺🇸❤️ and ZWJ 👨‍👩‍👧",
    "tabs\t\tand   spaces\n\n\r\n   \n",
    "日本語テキストとカタカナ 한국어",
    "mixed123456789 x1 \u00a0nbsp \u2028line sep",
    "<|end_of_msg|><|open|>message<|sep|>",
]


def test_special_layout(tok, ranks):
    n = len(ranks)
    assert tok.num_ranks == n and tok.vocab_size == n + NUM_SPECIAL
    assert min(tok.special_ids.values()) == n and max(tok.special_ids.values()) == n + 255
    assert len(tok.special_ids) == NUM_SPECIAL
    for name, off in SPECIAL_OFFSETS.items():
        assert tok.encode_special(name) == n + off
    assert tok.encode_special("<|reserved_token_%d|>" % (n + 8)) == n + 8
    assert tok.encode_special("<|reserved_token_%d|>" % (n + 253)) == n + 253
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.unk_id) == (n, n + 2, n + 255, n + 254)
    assert tok.special_name(n + 3) == "<|open|>"
    with pytest.raises(ValueError, match="unknown special"):
        tok.encode_special("<|nope|>")


def test_released_ids_from_offsets():
    released = {"[BOS]": 163584, "[EOS]": 163585, "<|end_of_msg|>": 163586, "<|open|>": 163587,
                "<|close|>": 163588, "<|sep|>": 163589, "[start_header_id]": 163590, "[end_header_id]": 163591,
                "[EOT]": 163593, "<|media_begin|>": 163602, "<|media_content|>": 163603, "<|media_end|>": 163604,
                "<|media_pad|>": 163605, "<osagent_mode>": 163649, "[UNK]": 163838, "[PAD]": 163839}
    assert {k: 163584 + v for k, v in SPECIAL_OFFSETS.items()} == released


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.num_ranks for i in ids)  # ordinary text never yields special ids
    assert tok.decode(ids) == text


def test_special_looking_text_is_plain(tok):
    text = "say <|end_of_msg|> then <|open|>message role=\"system\"<|sep|>[BOS]"
    ids = tok.encode(text)
    assert not any(tok.is_special(i) for i in ids)
    assert tok.decode(ids) == text
    ids = tok.encode(text, allow_special=True)
    assert [i for i in ids if tok.is_special(i)] == [tok.encode_special(s) for s in
                                                      ("<|end_of_msg|>", "<|open|>", "<|sep|>", "[BOS]")]
    assert tok.decode(ids) == text


def test_no_bos(tok):
    assert tok.encode("Hi")[0] != tok.bos_id and tok.encode("") == []


def _pieces(pattern: str, text: str) -> list[bytes]:
    """tiktoken's own split of `text`: with every substring of `text` in the vocabulary, BPE merges each piece
    into exactly one token (any two adjacent parts of a piece concatenate to a vocabulary entry), so the tokens
    are the pre-tokenizer's pieces."""
    b = text.encode()
    ranks = {bytes([i]): i for i in range(256)}
    for sub in sorted({b[i:j] for i in range(len(b)) for j in range(i + 2, len(b) + 1)}):
        ranks.setdefault(sub, len(ranks))
    enc = tiktoken.Encoding("probe", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})
    return [enc.decode_single_token_bytes(t) for t in enc.encode_ordinary(text)]


@pytest.mark.parametrize("text, pieces", [
    ("Hello世界World", ["Hello", "世界", "World"]),
    ("HELLOWorld 中文English", ["HELLOWorld", " ", "中文", "English"]),
    ("Привет, Мир! don't I'M", ["Привет", ",", " Мир", "!", " don't", " I'M"]),
    ("日本語テキスト", ["日本語", "テキスト"]),
    ("1234567 x", ["123", "456", "7", " x"]),
    ("a  \n\n  b   ", ["a", "  \n\n", " ", " b", "   "]),
    ("x&&y [&&]", ["x", "&&", "y", " [&&]"]),
])
def test_pretokenizer_hand_checked(text, pieces):
    assert _pieces(PATTERN, text) == [p.encode() for p in pieces]


def test_pretokenizer_matches_regex_v1_oracle():
    """tiktoken runs the `&&` intersection verbatim: its splits equal the `regex` package's (V1 set syntax)."""
    rng = random.Random(0)
    alphabet = (list("abcXYZ  \n\t\r'!?.,-_&[]") + list("你好世界") + list("жЖяЯ") + list("ﾃアか")
                + ["1", "23", "é", "É", "\u0301", "ǅ", "😀", "\u00a0", "ʰ"])
    oracle = regex.compile("(?V1)" + PATTERN)
    for _ in range(60):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 24)))
        assert _pieces(PATTERN, text) == [p.encode() for p in oracle.findall(text)], repr(text)


def test_guard_cuts_like_the_release():
    s = "a" * 60_000 + "  " + " " * 30_000 + "b"
    chunks = list(_guard_chunks(s))
    assert "".join(chunks) == s
    assert [len(c) for c in chunks] == [25_000, 25_000, 10_000 + 25_000, 5_002 + 1]


@pytest.mark.parametrize("ch", ["a", " ", "\n", "中"])
def test_long_runs_are_cut_before_bpe_and_round_trip(tok, ch, monkeypatch):
    # tiktoken's BPE is slow on long runs of one character class (superlinear in the run): the guard must hand it
    # no run longer than MAX_RUN_CHARS. Asserted on what BPE receives, not on the time it takes.
    seen = []
    bpe = tok._enc.encode_ordinary
    monkeypatch.setattr(tok._enc, "encode_ordinary", lambda chunk: seen.append(chunk) or bpe(chunk))
    text = ch * 100_000
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert "".join(seen) == text and len(seen) == 100_000 // MAX_RUN_CHARS
    assert max(len(c) for c in seen) == MAX_RUN_CHARS


def test_stream_decoder_holds_partial_utf8(tok):
    text = "ok 🦀🧪👍🏽 中文 done"
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # emoji are split across several byte tokens in this small vocab
    dec = tok.stream_decoder()
    pieces = [dec.feed([i]) for i in ids]
    assert "".join(pieces) + dec.flush() == text
    assert all("\ufffd" not in p for p in pieces)
    dec = tok.stream_decoder()
    head = dec.feed(tok.encode("🦀")[:1])
    assert head == "" and dec.pending and dec.flush() == "\ufffd" and dec.pending == b""


def test_decode_partial_utf8_replaces(tok):
    ids = tok.encode("🦀")
    assert tok.decode(ids[:1]) == "\ufffd"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])


def test_load_errors(tmp_path, ranks):
    with pytest.raises(FileNotFoundError, match="nothere"):
        Tokenizer.from_file(tmp_path / "nothere")
    with pytest.raises(FileNotFoundError, match="tiktoken.model"):
        Tokenizer.from_file(tmp_path)  # a folder without the file
    bad = tmp_path / "bad.model"
    bad.write_text("AA== 0\nAQ== 1\nnot-base64!! 2\n")
    with pytest.raises(ValueError, match="line 3"):
        Tokenizer.from_file(bad)
    bad.write_text("AA== 0\nAQ==\n")
    with pytest.raises(ValueError, match="line 2"):
        Tokenizer.from_file(bad)
    bad.write_text("AA== 0\nAA== 1\n")
    with pytest.raises(ValueError, match="line 2: duplicate"):
        Tokenizer.from_file(bad)
    with pytest.raises(ValueError, match="single-byte"):
        Tokenizer({b"a": 0})
    with pytest.raises(ValueError, match="exactly 0.."):
        Tokenizer({**ranks, b"zzzz-gap": len(ranks) + 5})
