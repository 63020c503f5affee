"""Evidence the demo model learned: validation loss and perplexity per token and per byte of a K3 checkpoint (by
default the shipped one), optionally the trainer's dense checkpoint and the same model with its routed experts
zeroed, against a unigram baseline; plus sample generations. Runs from any directory.

    make demo-data                                              # data/shakespeare (the held-out works)
    python recipes/demo/evaluate.py --precision fp32 --zero-experts --no-samples    # the model card's CPU figures
    python recipes/demo/evaluate.py --trained out/demo/run/checkpoints/step-00000300/model --model out/demo/ship

Scored: the validation stream (Othello, Twelfth Night, the Sonnets) cut into rows of 512 tokens, in stream order,
as micro-batches of 16 rows; the last partial micro-batch is left out (192 of the 199 rows), as the trainer's
evaluation does.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

import kimik3
from kimik3.inference import SamplingParams, generate
from kimik3.model.moe import Experts
from kimik3.presets import DEMO_MODEL
from kimik3.tokenizer import Tokenizer
from kimik3.train.data import RowSampler, eval_batches, open_stream
from kimik3.train.loss import CausalLMLoss
from kimik3.train.step import evaluate

REPO = Path(__file__).resolve().parents[2]
SEQ_LEN, ROWS = 512, 16


def texts(data: Path, split: str) -> list[str]:
    files = sorted(str(p) for p in (data / split).glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no {split} texts in {data / split}: run `make demo-data` in the repository "
                                "(or pass --data)")
    return files


def validation(data: Path, tokenizer: str):
    """Every full micro-batch of validation rows (stream order), the row counts, and the byte count of the targets."""
    tok = Tokenizer.from_file(tokenizer)
    sampler = RowSampler(open_stream(texts(data, "val"), "data.valid", tokenizer), SEQ_LEN, tok.vocab_size,
                         shuffle=False)
    batches = eval_batches(sampler, sampler.num_rows, 0, 1, ROWS)
    nbytes = sum(len(tok.decode_bytes([t])) for mb in batches for t in mb.labels[mb.labels >= 0].tolist())
    return tok, batches, sampler.num_rows, nbytes


def unigram_loss(data: Path, tokenizer: str, batches, vocab: int) -> float:
    """Add-one unigram model of the training tokens, scored on the same validation targets."""
    train = open_stream(texts(data, "train"), "data.train", tokenizer)
    counts = np.bincount(np.concatenate([np.asarray(p) for p in train.parts]), minlength=vocab) + 1.0
    logp = np.log(counts / counts.sum())
    labels = torch.cat([mb.labels[mb.labels >= 0] for mb in batches]).numpy()
    return float(-logp[labels].mean())


def load_lm(path: str | Path, device: torch.device, precision: str):
    # fp32: parameters and compute in fp32 (experts dequantized exactly); bf16: the stored bf16 weights under the
    # recipe's autocast, as the trainer evaluated
    dtype = torch.float32 if precision == "fp32" else None
    return kimik3.load(path, device=device, dtype=dtype, quiet=True).language_model.eval()  # experts dequantized


def zero_routed_experts(lm) -> int:
    """Zero every routed expert's weights (the shared experts stay): what the routed experts are worth."""
    n = 0
    with torch.no_grad():
        for mod in lm.modules():
            if isinstance(mod, Experts):
                for w in (mod.w1, mod.w2, mod.w3):
                    w.zero_()
                n += 1
    if n == 0:
        raise ValueError("the model has no routed-expert layers to zero")
    return n


def score(lm, batches, device: torch.device, precision: str) -> float:
    return evaluate(CausalLMLoss(lm), batches, device=device, precision=precision)["eval_loss"]


def samples(path: str | Path, tok: Tokenizer) -> list[dict]:
    model = kimik3.load(path, device="cpu", quiet=True).eval()
    out = []
    for prompt, params in (("ROMEO:", SamplingParams(temperature=0, max_new_tokens=80)),
                           ("JULIET:\n", SamplingParams(temperature=0.8, top_p=0.95, seed=1, max_new_tokens=80)),
                           ("KING HENRY V:\n", SamplingParams(temperature=0.8, top_p=0.95, seed=2, max_new_tokens=80))):
        t0 = time.perf_counter()
        res = generate(model, [tok.encode(prompt)], params, tokenizer=tok)[0]
        out.append({"prompt": prompt, "params": params.__dict__, "text": res.text,
                    "cpu_seconds": round(time.perf_counter() - t0, 2)})
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(DEMO_MODEL), help="the MXFP4 checkpoint to score (default: the shipped "
                    "demo model)")
    ap.add_argument("--trained", default=None, help="also score the trainer's last model folder (dense experts)")
    ap.add_argument("--zero-experts", action="store_true", help="also score --model with its routed experts zeroed")
    ap.add_argument("--precision", choices=("bf16", "fp32"), default="bf16",
                    help="bf16: stored weights under bf16 autocast, as trained (default); fp32: fp32 end to end")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--data", default=str(REPO / "data" / "shakespeare"), help="make demo-data's corpus folder")
    ap.add_argument("--tokenizer", default=None, help="tiktoken.model (default: --model's)")
    ap.add_argument("--no-samples", action="store_true", help="skip the sample generations")
    ap.add_argument("--out", default=None, help="also write the report here (JSON)")
    args = ap.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    data = Path(args.data)
    tokenizer = args.tokenizer or str(Path(args.model) / "tiktoken.model")
    tok, batches, total_rows, nbytes = validation(data, tokenizer)
    tokens = sum(mb.num_targets for mb in batches)
    losses = {}
    if args.trained:
        losses["trained (dense experts)"] = score(load_lm(args.trained, device, args.precision), batches, device,
                                                  args.precision)
    lm = load_lm(args.model, device, args.precision)
    losses["model (MXFP4 experts)"] = score(lm, batches, device, args.precision)
    if args.zero_experts:
        zero_routed_experts(lm)
        losses["model, routed experts zeroed"] = score(lm, batches, device, args.precision)
    del lm
    losses["unigram"] = unigram_loss(data, tokenizer, batches, tok.vocab_size)
    report = {"model": str(args.model), "precision": args.precision, "device": str(device),
              "val_rows_scored": len(batches) * ROWS, "val_rows": total_rows, "val_tokens": tokens,
              "val_bytes": nbytes, "models": {}}
    for name, loss in losses.items():
        report["models"][name] = {"loss_per_token": loss, "ppl_per_token": math.exp(loss),
                                  "bits_per_byte": loss * tokens / nbytes / math.log(2),
                                  "ppl_per_byte": math.exp(loss * tokens / nbytes)}
    if not args.no_samples:
        report["samples"] = samples(args.model, tok)
    print(f"{report['val_rows_scored']} of {total_rows} validation rows of {SEQ_LEN} tokens ({tokens:,} target "
          f"tokens, {nbytes:,} bytes), {args.precision} on {device}:")
    for name, m in report["models"].items():
        print(f"  {name:32s} loss/token {m['loss_per_token']:.6f}  ppl {m['ppl_per_token']:8.1f}  "
              f"bits/byte {m['bits_per_byte']:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
