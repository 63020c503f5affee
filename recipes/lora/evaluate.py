"""Validation loss of a LoRA recipe's base, with and without an adapter, on the rows the trainer evaluates.

    python3 recipes/lora/evaluate.py recipes/lora/shanty.toml [--adapter RUN/checkpoints/step-*/adapter]

Prints one JSON line: {"adapter": ..., "eval_loss": ..., "eval_ppl": ..., "eval_tokens": ...}.
"""

from __future__ import annotations

import argparse
import json

import torch

import kimik3
from kimik3 import lora
from kimik3.train.config import load_train_config
from kimik3.train.data import RowSampler, eval_batches, open_stream
from kimik3.train.loss import CausalLMLoss
from kimik3.train.step import evaluate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("recipe")
    p.add_argument("--adapter", default=None)
    args = p.parse_args()
    cfg = load_train_config(args.recipe)
    torch.set_num_threads(1)
    model = kimik3.load(cfg.model.checkpoint, dtype=torch.float32, text_only=True, keep_experts_packed=True,
                        quiet=True)
    if args.adapter:
        lora.load(model, args.adapter)
    lm, d = model.language_model, cfg.data
    rows = RowSampler(open_stream(d.valid, "data.valid", d.tokenizer, d.eos_id), d.seq_len, lm.config.vocab_size,
                      shuffle=False)
    batches = eval_batches(rows, cfg.eval.rows, 0, 1, cfg.train.micro_batch_rows)
    result = evaluate(CausalLMLoss(lm, cfg.train.loss_chunk_tokens), batches, device=torch.device("cpu"),
                      precision=cfg.train.precision)
    print(json.dumps({"adapter": args.adapter, **result}))


if __name__ == "__main__":
    main()
