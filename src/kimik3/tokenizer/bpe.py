"""K3's byte-level BPE tokenizer: a checkpoint's `tiktoken.model` ranks, K3's pre-tokenizer and 256 special ids.

Id layout (spec §5): ids `0 .. R-1` are the R mergeable ranks of the file (R = 163,584 for the released file);
ids `R .. R+255` are special tokens. The named ones sit at fixed OFFSETS from R (`SPECIAL_OFFSETS`), so a small
demo vocabulary gets the same layout as the released one; the rest are `<|reserved_token_{id}|>` with the
absolute id in the name.

Ordinary text never turns into special ids: `encode(text)` encodes `"<|end_of_msg|>"` as plain bytes. Only
`encode(text, allow_special=True)` and `encode_special(name)` produce them; the chat encoder uses the latter for
structural markers, so user text cannot inject control tokens.
"""

from __future__ import annotations

import base64
import binascii
import codecs
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType

import tiktoken

__all__ = ["NUM_SPECIAL", "PATTERN", "SPECIAL_OFFSETS", "StreamDecoder", "Tokenizer", "byte_chars", "load_ranks"]

# The pre-tokenizer regex, exactly as the released tokenizer builds it (spec §5; S1 `tokenization.py`, index id
# 61702949424). `[...&&[^\p{Han}]]` is the set intersection of the Rust `regex` crate, which tiktoken's
# fancy-regex hands classes to; tiktoken accepts it verbatim (checked against the `regex` package in V1 mode,
# tests/tokenizer/test_bpe.py), so no translation is needed. Han runs are split off first so that Chinese never
# fuses with adjacent Latin/kana letters.
_NON_HAN_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_NON_HAN_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?" + _NON_HAN_UPPER + "*" + _NON_HAN_LOWER + "+" + _CONTRACTION,
    r"[^\r\n\p{L}\p{N}]?" + _NON_HAN_UPPER + "+" + _NON_HAN_LOWER + "*" + _CONTRACTION,
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])

NUM_SPECIAL = 256
# Offsets from the first special id (= number of ranks); spec §5 table, ids 163584 + offset in the release.
SPECIAL_OFFSETS: Mapping[str, int] = MappingProxyType({
    "[BOS]": 0,
    "[EOS]": 1,  # document terminator; generation stops on <|end_of_msg|> instead
    "<|end_of_msg|>": 2,
    "<|open|>": 3,
    "<|close|>": 4,
    "<|sep|>": 5,
    "[start_header_id]": 6,
    "[end_header_id]": 7,
    "[EOT]": 9,
    "<|media_begin|>": 18,
    "<|media_content|>": 19,
    "<|media_end|>": 20,
    "<|media_pad|>": 21,
    "<osagent_mode>": 65,
    "[UNK]": 254,
    "[PAD]": 255,
})

# tiktoken panics on inputs past ~400k chars and is slow on very long runs of one character class
# (openai/tiktoken#195); the released tokenizer cuts at these sizes before BPE, so we cut at the same places.
MAX_ENCODE_CHARS = 400_000
MAX_RUN_CHARS = 25_000
_RUNS = re.compile(r"\s+|\S+")  # `re`'s \s is exactly str.isspace(), the test the released code uses


def byte_chars() -> tuple[str, ...]:
    """GPT-2's bytes_to_unicode: byte b -> one printable character (printable bytes map to themselves). The token
    strings of llama.cpp's BPE vocabularies and of transformers' byte-level tokenizers are bytes through it.
    (`tokenization_kimi.py` keeps its own copy: it runs without kimik3.)"""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1)) | set(range(ord("®"), 256))
    chars, extra = [], 0
    for b in range(256):
        chars.append(chr(b) if b in keep else chr(256 + extra))
        extra += b not in keep
    return tuple(chars)


def load_ranks(path: str | Path) -> dict[bytes, int]:
    """Read a tiktoken rank file: one `<base64 token bytes> <rank>` per line; blank lines are skipped.

    Raises:
        FileNotFoundError: `path` does not exist.
        ValueError: a malformed line, a duplicate token or a duplicate rank (the message names the line number).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer: rank file not found: {path}")
    ranks: dict[bytes, int] = {}
    seen_ranks: set[int] = set()
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, start=1):
            fields = line.split()
            if not fields:
                continue
            try:
                if len(fields) != 2:
                    raise ValueError("expected two fields")
                token = base64.b64decode(fields[0], validate=True)
                rank = int(fields[1])
            except (binascii.Error, ValueError) as e:
                raise ValueError(f"tokenizer: {path} line {lineno}: expected '<base64 bytes> <rank>', got "
                                 f"{line[:80]!r} ({e})") from None
            if token in ranks or rank in seen_ranks:
                raise ValueError(f"tokenizer: {path} line {lineno}: duplicate token or rank {rank}")
            ranks[token] = rank
            seen_ranks.add(rank)
    return ranks


def _guard_chunks(text: str) -> Iterator[str]:
    """Cut `text` into pieces of <= MAX_ENCODE_CHARS, each with runs of <= MAX_RUN_CHARS (non-)whitespace chars.

    A run longer than the limit is cut every MAX_RUN_CHARS chars from its start, as the released tokenizer does.
    """
    for start in range(0, len(text), MAX_ENCODE_CHARS):
        piece = text[start:start + MAX_ENCODE_CHARS]
        if len(piece) <= MAX_RUN_CHARS:  # no run can be too long: skip the scan (the common case)
            yield piece
            continue
        cut = 0
        for run in _RUNS.finditer(piece):
            for end in range(run.start() + MAX_RUN_CHARS, run.end(), MAX_RUN_CHARS):
                yield piece[cut:end]
                cut = end
        yield piece[cut:]


class Tokenizer:
    """K3 BPE tokenizer over tiktoken.

    Args:
        mergeable_ranks: token bytes -> rank; ranks must be exactly `0 .. R-1` and include all 256 single bytes.
        name: a label for tiktoken (shown in reprs only).

    Attributes:
        num_ranks: R, the number of ordinary tokens (= the first special id).
        vocab_size: R + 256.
        bos_id / eos_id / pad_id / unk_id: `[BOS]`, `<|end_of_msg|>` (the generation EOS: `config.eos_token_id`),
            `[PAD]`, `[UNK]`.
    """

    def __init__(self, mergeable_ranks: Mapping[bytes, int], *, name: str = "kimi-k3"):
        num_ranks = len(mergeable_ranks)
        if set(mergeable_ranks.values()) != set(range(num_ranks)):
            raise ValueError(f"tokenizer: mergeable_ranks must be exactly 0..{num_ranks - 1} (one token per rank)")
        missing = [b for b in range(256) if bytes([b]) not in mergeable_ranks]
        if missing:
            raise ValueError(f"tokenizer: mergeable_ranks lacks single-byte tokens {missing[:8]} (byte-level BPE "
                             "needs all 256)")
        named = {off: name for name, off in SPECIAL_OFFSETS.items()}
        special = {named.get(off, f"<|reserved_token_{num_ranks + off}|>"): num_ranks + off
                   for off in range(NUM_SPECIAL)}
        self.num_ranks = num_ranks
        self.vocab_size = num_ranks + NUM_SPECIAL
        self._special = MappingProxyType(special)
        self._special_names = {i: s for s, i in special.items()}
        # longest names first so that no name can win on a shorter prefix of another
        self._special_re = re.compile("|".join(re.escape(s) for s in sorted(special, key=len, reverse=True)))
        self._enc = tiktoken.Encoding(name, pat_str=PATTERN, mergeable_ranks=dict(mergeable_ranks),
                                      special_tokens=special)
        self.bos_id = special["[BOS]"]
        self.eos_id = special["<|end_of_msg|>"]
        self.pad_id = special["[PAD]"]
        self.unk_id = special["[UNK]"]

    @classmethod
    def from_file(cls, path_or_dir: str | Path) -> Tokenizer:
        """Load `tiktoken.model` from a file path or from a checkpoint folder that contains one."""
        path = Path(path_or_dir)
        if path.is_dir():
            path = path / "tiktoken.model"
        return cls(load_ranks(path), name=path.name)

    def __repr__(self) -> str:
        return f"Tokenizer(num_ranks={self.num_ranks}, vocab_size={self.vocab_size})"

    @property
    def special_ids(self) -> Mapping[str, int]:
        """All 256 special names -> ids (read-only)."""
        return self._special

    def encode_special(self, name: str) -> int:
        """The id of special token `name` (e.g. `"<|open|>"`)."""
        try:
            return self._special[name]
        except KeyError:
            raise ValueError(f"tokenizer: unknown special token {name!r}") from None

    def is_special(self, token_id: int) -> bool:
        return self.num_ranks <= token_id < self.vocab_size

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Token ids of `text`. No BOS is added.

        With `allow_special=False` (the default) special-looking strings are ordinary text. With
        `allow_special=True` every exact special name in `text` becomes its id (for trusted, rendered prompts).
        """
        if not isinstance(text, str):
            raise TypeError(f"tokenizer: encode expects str, got {type(text).__name__}")
        if not allow_special:
            return self._encode_ordinary(text)
        ids: list[int] = []
        pos = 0
        for m in self._special_re.finditer(text):
            ids += self._encode_ordinary(text[pos:m.start()])
            ids.append(self._special[m.group()])
            pos = m.end()
        ids += self._encode_ordinary(text[pos:])
        return ids

    def _encode_ordinary(self, text: str) -> list[int]:
        ids: list[int] = []
        for chunk in _guard_chunks(text):
            if chunk:
                ids += self._enc.encode_ordinary(chunk)
        return ids

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        """The bytes of `ids`; special ids give their names' bytes."""
        ids = list(ids)
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            bad = next(i for i in ids if not 0 <= i < self.vocab_size)
            raise ValueError(f"tokenizer: token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        return self._enc.decode_bytes(ids)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`; special ids appear as their names; invalid/partial UTF-8 becomes U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def special_name(self, token_id: int) -> str:
        """The name of special id `token_id`."""
        try:
            return self._special_names[token_id]
        except KeyError:
            raise ValueError(f"tokenizer: {token_id} is not a special id "
                             f"[{self.num_ranks}, {self.vocab_size})") from None

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self)


class StreamDecoder:
    """Incremental detokenizer: feed ids, get only the newly completed text.

    A multi-byte UTF-8 character split across tokens is held back until its last byte arrives (an emoji is often
    2-4 byte-level tokens); bytes that can never become valid UTF-8 come out as U+FFFD at once. Concatenating
    every `feed` result and `flush()` equals `tokenizer.decode(all_ids)`.
    """

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, ids: Sequence[int]) -> str:
        return self._utf8.decode(self._tok.decode_bytes(ids), final=False)

    @property
    def pending(self) -> bytes:
        """Bytes held back as the start of an incomplete character."""
        return self._utf8.getstate()[0]

    def flush(self) -> str:
        """End of stream: whatever is held back, as U+FFFD; the decoder is then empty and reusable."""
        return self._utf8.decode(b"", final=True)
