"""The demo model's dense baseline: a pre-norm transformer (RoPE attention, SwiGLU MLP) with about the same
parameter count as the demo K3 (20.5M), trained with the same recipe and the same token rows
(configs/train/demo.toml: data order, batch, steps, AdamW, LR schedule, bf16 autocast, clipping).

    python recipes/demo/baseline.py --recipe configs/train/demo.toml --out baseline.json
Not part of the package: the comparison the demo's model card reports.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F
from torch import nn

from kimik3.tokenizer import Tokenizer
from kimik3.train.config import load_train_config
from kimik3.train.data import RowSampler, eval_batches, open_stream, step_batches
from kimik3.train.optim import build_optimizer, lr_factor

D, LAYERS, HEADS, FFN = 384, 8, 6, 1024
EVAL_ROWS = 16  # rows per validation micro-batch (the whole validation set is scored)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(D, eps=1e-5), nn.RMSNorm(D, eps=1e-5)
        self.qkv, self.o = nn.Linear(D, 3 * D, bias=False), nn.Linear(D, D, bias=False)
        self.gate, self.up, self.down = (nn.Linear(D, FFN, bias=False), nn.Linear(D, FFN, bias=False),
                                         nn.Linear(FFN, D, bias=False))

    def forward(self, x, cos, sin, mask):
        R, T, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(R, T, 3, HEADS, D // HEADS).unbind(2)
        q, k = (rope(t, cos, sin).transpose(1, 2) for t in (q, k))
        a = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), attn_mask=mask)
        x = x + self.o(a.transpose(1, 2).reshape(R, T, D))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def rope(x, cos, sin):
    x1, x2 = x.float().chunk(2, -1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).to(x.dtype)


class DenseLM(nn.Module):
    def __init__(self, vocab: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, D)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm, self.head = nn.RMSNorm(D, eps=1e-5), nn.Linear(D, vocab, bias=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, input_ids, labels, cu_seqlens, rows: int):
        """Summed CE over a packed micro-batch of `rows` rows; attention stays inside each document."""
        ids = input_ids.view(rows, -1)
        T = ids.shape[1]
        doc = torch.searchsorted(cu_seqlens, torch.arange(ids.numel(), device=ids.device), right=True).view(rows, T)
        mask = (doc[:, :, None] == doc[:, None, :]) & torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()
        row_start = torch.arange(rows, device=ids.device)[:, None] * T
        pos = torch.arange(T, device=ids.device) - (cu_seqlens[doc - 1] - row_start)
        inv = 10000 ** (-torch.arange(0, D // HEADS, 2, device=ids.device) / (D // HEADS))
        ang = pos[..., None].float() * inv
        cos, sin = ang.cos()[:, :, None], ang.sin()[:, :, None]
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x, cos, sin, mask[:, None])
        logits = self.head(self.norm(x)).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100, reduction="sum")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default="configs/train/demo.toml")
    ap.add_argument("--out", default="baseline.json")
    ap.add_argument("--set", action="append", default=[], help="recipe override, as kimik3 train --set")
    args = ap.parse_args()
    cfg = load_train_config(args.recipe, args.set)
    d, t, o = cfg.data, cfg.train, cfg.optim
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tok = Tokenizer.from_file(d.tokenizer)
    # the trainer's streams and row order (kimik3.train.loop.Trainer), on one rank
    train = RowSampler(open_stream(d.train, key="data.train", tokenizer=d.tokenizer, eos_id=d.eos_id),
                       seq_len=d.seq_len, vocab_size=tok.vocab_size, shuffle=d.shuffle, seed=d.seed)
    val = RowSampler(open_stream(d.valid, key="data.valid", tokenizer=d.tokenizer, eos_id=d.eos_id),
                     seq_len=d.seq_len, vocab_size=tok.vocab_size, shuffle=False)
    val_batches = eval_batches(val, num_rows=val.num_rows, rank=0, world=1, rows=EVAL_ROWS)
    torch.manual_seed(t.seed)
    model = DenseLM(tok.vocab_size).to(device)
    params = sum(p.numel() for p in model.parameters())
    opt = build_optimizer(model, name=o.name, lr=o.lr, weight_decay=o.weight_decay, betas=tuple(o.betas), eps=o.eps,
                          muon_momentum=o.muon_momentum)
    t0, losses = time.perf_counter(), []
    for step in range(t.steps):
        opt.set_lr(lr_factor(step + 1, total=t.steps, warmup=o.warmup_steps, schedule=o.schedule,
                             min_ratio=o.min_lr_ratio, decay_fraction=o.decay_fraction))
        total, targets = 0.0, 0
        for mb in step_batches(train, step=step, rank=0, world=1, accum=t.grad_accum, rows=t.micro_batch_rows):
            mb = mb.to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=t.precision == "bf16"):
                loss = model(mb.input_ids, mb.labels, mb.cu_seqlens, rows=t.micro_batch_rows)
            (loss / mb.num_targets).backward()
            total, targets = total + float(loss.detach()), targets + mb.num_targets
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.clip_grad_norm)
        opt.step()
        opt.zero_grad()
        losses.append(total / targets)
    model.eval()
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=t.precision == "bf16"):
        tot = sum(float(model(mb.to(device).input_ids, mb.to(device).labels, mb.to(device).cu_seqlens,
                              rows=EVAL_ROWS)) for mb in val_batches)
    val_loss = tot / sum(mb.num_targets for mb in val_batches)
    out = {"params": params, "steps": t.steps, "train_loss_last": losses[-1], "val_loss": val_loss,
           "val_ppl": math.exp(val_loss), "seconds": time.perf_counter() - t0}
    print(json.dumps(out, indent=2))
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
