"""A tiny byte-level BPE trainer and rank-file writer, so tokenizer tests need neither network nor the release."""

from __future__ import annotations

import base64
from collections import Counter
from pathlib import Path

import regex

# A mixed corpus: the chat format's own words (so tags merge), English, code, Chinese, Russian, Japanese, emoji,
# digits and whitespace runs.
CORPUS = "\n".join([
    'message role="user" role="assistant" role="system" role="tool" type="tool-declare" think response tools',
    'call tool="get_weather" index="1" argument key="city" type="string" type="number"',
    'json type="object"',
    "The quick brown fox jumps over the lazy dog. It's what they'd say, isn't it? We'll see; you're right.",
    "def encode(self, text: str) -> list[int]:\n    return [ord(c) for c in text]  # 1234567890\n",
    "Hello, world! HELLO World hello WORLD. Thinking effort: low, medium, high, max.",
    "你好，世界！今天天气很好。我们一起去公园散步吧。中文分词测试，汉字和English混合。",
    "Привет, мир! Как дела? Это тест токенизатора на русском языке.",
    "日本語のテキストとカタカナ、ひらがなを含む文章です。",
    "Emoji: 😀😃😄 👍🏽 🇺🇸 ❤️ — “quotes” and ‘single’ … ellipsis",
    "    indented\n\n\n\tTabbed\r\n  trailing   \n",
    '{"location": "Paris", "unit": "celsius", "days": 3, "flag": true, "none": null}',
] * 3)


def train_bpe(text: str, num_merges: int, pattern: str) -> dict[bytes, int]:
    """Ranks: the 256 bytes in byte order, then up to `num_merges` merges, most frequent pair first.

    Words are the pre-tokenizer's pieces (`pattern`, parsed with `regex` in V1 mode for the `&&` class syntax);
    ties break on the pair's bytes, so the result is deterministic.
    """
    words = Counter(p.encode() for p in regex.findall("(?V1)" + pattern, text))
    seqs = {w: [bytes([b]) for b in w] for w in words}
    ranks = {bytes([b]): b for b in range(256)}
    for _ in range(num_merges):
        pairs: Counter = Counter()
        for w, n in words.items():
            s = seqs[w]
            for pair in zip(s, s[1:]):
                pairs[pair] += n
        if not pairs:
            break
        (a, b), count = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        if count < 2:
            break
        ranks.setdefault(a + b, len(ranks))
        for w, s in seqs.items():
            i, out = 0, []
            while i < len(s):
                if i + 1 < len(s) and s[i] == a and s[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            seqs[w] = out
    return ranks


def write_ranks(ranks: dict[bytes, int], path: Path) -> Path:
    """Write `ranks` in the tiktoken.model format: `<base64 bytes> <rank>` per line, in rank order."""
    lines = [f"{base64.b64encode(t).decode()} {r}" for t, r in sorted(ranks.items(), key=lambda kv: kv[1])]
    path.write_text("\n".join(lines) + "\n")
    return path
