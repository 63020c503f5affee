"""K3's tokenizer as a GGUF vocabulary (llama.cpp's "gpt2" BPE with the `kimi-k2` pre-tokenizer) and back.

    tokenizer.ggml.tokens      id -> token: the rank's bytes through GPT-2's byte-to-character table, special
                               tokens by name
    tokenizer.ggml.token_type  1 (normal) for ranks, 3 (control) for the 256 special ids, 5 (unused) for rows a
                               model has past them; a model with fewer rows (the tiny preset's 300 over a byte
                               vocabulary) gets the ids below its size only, as llama.cpp needs one token per row
    tokenizer.ggml.merges      "left right" per multi-byte rank, in rank order: the pair BPE joins to make it
    tokenizer.ggml.pre         kimi-k2: llama.cpp's K2/K3 pre-tokenizer (K3 keeps K2's vocabulary and regex)
"""

from __future__ import annotations

import base64
from pathlib import Path

from kimik3.tokenizer import SPECIAL_OFFSETS, Tokenizer
from kimik3.tokenizer.bpe import byte_chars

NORMAL, CONTROL, UNUSED = 1, 3, 5
PRE = "kimi-k2"


def _merge_pair(ranks: dict[bytes, int], token: bytes) -> tuple[bytes, bytes]:
    """The two parts BPE joins last to make `token`: merge the lowest-ranked adjacent pair (ranks below the
    token's own) until two parts are left."""
    limit, parts = ranks[token], [bytes([b]) for b in token]
    while len(parts) > 2:
        best = min(range(len(parts) - 1), key=lambda i: ranks.get(parts[i] + parts[i + 1], limit))
        if ranks.get(parts[best] + parts[best + 1], limit) >= limit:
            break
        parts[best:best + 2] = [parts[best] + parts[best + 1]]
    assert len(parts) == 2, f"rank {limit}: BPE cannot build {token!r} from lower ranks"
    return parts[0], parts[1]


def vocab_metadata(tok: Tokenizer, size: int) -> dict[str, list]:
    """tokens, token types and merges of `tok` for a model with `size` embedding rows, as GGUF arrays."""
    chars = byte_chars()
    ranks = tok._enc._mergeable_ranks  # bytes -> rank: the tiktoken.model file
    by_rank = sorted(ranks, key=ranks.__getitem__)
    tokens = ["".join(chars[b] for b in t) for t in by_rank]
    tokens += [tok.special_name(i) for i in range(tok.num_ranks, tok.vocab_size)]
    merges = []
    for t in by_rank:
        if len(t) > 1:
            left, right = _merge_pair(ranks, t)
            merges.append("".join(chars[b] for b in left) + " " + "".join(chars[b] for b in right))
    types = [NORMAL] * tok.num_ranks + [CONTROL] * (tok.vocab_size - tok.num_ranks)
    if size < tok.num_ranks:
        raise ValueError(f"the model has {size} embedding rows, fewer than the tokenizer's {tok.num_ranks} ordinary "
                         "tokens")
    tokens = tokens[:size] + [f"[PAD{i}]" for i in range(len(tokens), size)]
    types = types[:size] + [UNUSED] * (size - len(types))
    return {"tokens": tokens, "token_type": types, "merges": merges}


def ranks_from_tokens(tokens: list[str], types: list[int], where: str) -> dict[bytes, int]:
    """The rank file's contents from a GGUF vocabulary in K3's layout (ranks, then the specials by name, perhaps
    cut at the model's size or followed by unused rows)."""
    byte_of = {c: b for b, c in enumerate(byte_chars())}
    num_ranks = sum(1 for t in types if t == NORMAL)
    if any(t != NORMAL for t in types[:num_ranks]) or any(t == NORMAL for t in types[num_ranks:]):
        raise ValueError(f"{where}: the vocabulary is not K3's layout (ordinary tokens, then the special tokens)")
    specials = len(tokens) - num_ranks
    wrong = [n for n, off in SPECIAL_OFFSETS.items() if off < specials and types[num_ranks + off] != UNUSED
             and tokens[num_ranks + off] != n]
    if wrong:
        raise ValueError(f"{where}: special token {wrong[0]!r} is not at id {num_ranks + SPECIAL_OFFSETS[wrong[0]]} "
                         "(K3's special ids follow the ordinary tokens at fixed offsets)")
    try:
        return {bytes(byte_of[c] for c in t): i for i, t in enumerate(tokens[:num_ranks])}
    except KeyError as e:
        raise ValueError(f"{where}: token text with character {e} outside GPT-2's byte table") from None


def write_ranks(ranks: dict[bytes, int], path: Path) -> None:
    """A tiktoken.model file: `<base64 bytes> <rank>` per line, in rank order."""
    with open(path, "wb") as f:
        for token in sorted(ranks, key=ranks.__getitem__):
            f.write(base64.b64encode(token) + b" %d\n" % ranks[token])
