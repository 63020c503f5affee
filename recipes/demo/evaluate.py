"""Evidence the demo model learned: validation loss and perplexity per token and per byte for the trained
(bf16-expert) model, its shipped MXFP4 checkpoint and a unigram baseline, plus sample generations.

    python recipes/demo/evaluate.py --trained out/demo/checkpoints/step-00000600/model \
        --shipped models/k3-shakespeare --out eval.json
"""

from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np
import torch

import kimik3
from kimik3.inference import SamplingParams, generate
from kimik3.tokenizer import Tokenizer
from kimik3.train.data import RowSampler, eval_batches, open_stream
from kimik3.train.loss import CausalLMLoss
from kimik3.train.step import evaluate

DATA = {"train": ["data/shakespeare/train/*.txt"], "valid": ["data/shakespeare/val/*.txt"]}
SEQ_LEN, ROWS = 512, 16


def validation(tokenizer: str):
    """Every validation row (stream order) as packed micro-batches, and the byte count of their targets."""
    tok = Tokenizer.from_file(tokenizer)
    stream = open_stream(DATA["valid"], "data.valid", tokenizer)
    sampler = RowSampler(stream, SEQ_LEN, tok.vocab_size, shuffle=False)
    batches = eval_batches(sampler, sampler.num_rows, 0, 1, ROWS)
    nbytes = sum(len(tok.decode_bytes([t])) for mb in batches for t in mb.labels[mb.labels >= 0].tolist())
    return tok, stream, batches, nbytes


def unigram_loss(tokenizer: str, batches, vocab: int) -> float:
    """Add-one unigram model of the training tokens, scored on the same validation targets."""
    train = open_stream(DATA["train"], "data.train", tokenizer)
    counts = np.bincount(np.concatenate([np.asarray(p) for p in train.parts]), minlength=vocab) + 1.0
    logp = np.log(counts / counts.sum())
    labels = torch.cat([mb.labels[mb.labels >= 0] for mb in batches]).numpy()
    return float(-logp[labels].mean())


def score(path: str, batches, device: torch.device, experts: str) -> float:
    model = kimik3.load(path, device=device, experts=experts, quiet=True).language_model.eval()
    return evaluate(CausalLMLoss(model), batches, device=device, precision="bf16")["eval_loss"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trained", required=True, help="the trainer's last model folder (dense bf16 experts)")
    ap.add_argument("--shipped", required=True, help="the MXFP4 checkpoint that ships in the repository")
    ap.add_argument("--tokenizer", default="models/k3-shakespeare/tiktoken.model")
    ap.add_argument("--out", default="eval.json")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tok, _, batches, nbytes = validation(args.tokenizer)
    tokens = sum(mb.num_targets for mb in batches)
    losses = {"trained (bf16 experts)": score(args.trained, batches, device, "dequantize"),
              "shipped (MXFP4 experts)": score(args.shipped, batches, device, "dequantize"),
              "unigram": unigram_loss(args.tokenizer, batches, tok.vocab_size)}
    report = {"val_tokens": tokens, "val_bytes": nbytes, "models": {}}
    for name, loss in losses.items():
        report["models"][name] = {"loss_per_token": loss, "ppl_per_token": math.exp(loss),
                                  "bits_per_byte": loss * tokens / nbytes / math.log(2),
                                  "ppl_per_byte": math.exp(loss * tokens / nbytes)}
    model = kimik3.load(args.shipped, device="cpu", quiet=True).eval()
    samples = []
    for prompt, params in (("ROMEO:", SamplingParams(temperature=0, max_new_tokens=80)),
                           ("JULIET:\n", SamplingParams(temperature=0.8, top_p=0.95, seed=1, max_new_tokens=80)),
                           ("KING HENRY V:\n", SamplingParams(temperature=0.8, top_p=0.95, seed=2, max_new_tokens=80))):
        t0 = time.perf_counter()
        out = generate(model, [tok.encode(prompt)], params, tokenizer=tok)[0]
        samples.append({"prompt": prompt, "params": params.__dict__, "text": out.text,
                        "cpu_seconds": round(time.perf_counter() - t0, 2)})
    report["samples"] = samples
    print(json.dumps(report, indent=2))
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
