"""Training a DSpark-style drafter (`kimik3 train RUN.toml` with a `[draft]` table) against a frozen target.

Legend: R rows, T tokens per row, m anchors (blocks) per row, S block slots, V vocabulary, X = n taps * D.

Per step: R rows of the data run through the target (eval, no_grad) with forward hooks on the tapped layers
(`kimik3.inference.spec.taps`: the residual stream after each), giving taps [R, T, X] and logits [R, T, V].
In each row m anchors a are drawn; block b reads the taps of the positions < a_b and the slots
[x_a, mask, ..., mask] at positions a..a+S-1, and slot j learns the token at a + j: the target's argmax there
(`draft.labels = "target"`, what greedy verification accepts) or the data's token (`"data"`). All blocks of a
row run in one pass under a mask (each sees its own context prefix and its own slots). The loss is the mean CE
over the draft slots plus `confidence_weight` times the confidence head's BCE against "the draft's argmax is
the label". The Markov head is teacher-forced: slot j's previous token is the label of slot j-1 (the anchor for
j = 1). The drafter is written to `out_dir/draft/` (docs/speculative.md); a [draft] run does not resume.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from kimik3.checkpoint import load
from kimik3.distributed.env import resolve_device
from kimik3.inference.spec.drafter import DSparkDrafter
from kimik3.inference.spec.dspark import save_drafter
from kimik3.inference.spec.taps import stack_taps, tapped
from kimik3.train.config import TrainConfig, shape_of
from kimik3.train.data import RowSampler, open_stream
from kimik3.train.metrics import MetricsLog, Progress
from kimik3.train.optim import build_optimizer, lr_factor


@dataclass
class _Env:
    """What the CLI reads of a trainer's environment (a drafter run is one process)."""

    is_main: bool = True


def block_batch(ids_RT: Tensor, labels_RT: Tensor, anchors_Rm: Tensor, S: int, mask_id: int
                ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(block ids [R, m*S], block positions [R, m*S], attention mask [R, m*S, T + m*S], labels [R, m*S],
    previous tokens [R, m*S]) for blocks at the given anchors (labels_RT[:, p] = the token to predict at p)."""
    R, T = ids_RT.shape
    m = anchors_Rm.shape[1]
    offs = torch.arange(S, device=ids_RT.device)
    pos = (anchors_Rm[:, :, None] + offs).reshape(R, m * S)
    block = torch.full((R, m, S), mask_id, device=ids_RT.device)
    block[:, :, 0] = ids_RT.gather(1, anchors_Rm)
    labels = labels_RT.gather(1, pos)
    prev = torch.cat([block[:, :, :1], labels.view(R, m, S)[:, :, 1:-1]], dim=2)  # slot j: the token at a + j - 1
    prev = torch.cat([block[:, :, :1], prev], dim=2).reshape(R, m * S)
    which = torch.arange(m, device=ids_RT.device).repeat_interleave(S)  # the block of each slot
    ctx_ok = torch.arange(T, device=ids_RT.device)[None, None, :] < anchors_Rm.repeat_interleave(S, 1)[:, :, None]
    own = (which[:, None] == which[None, :]).expand(R, -1, -1)
    return block.reshape(R, m * S), pos, torch.cat([ctx_ok, own], dim=2), labels, prev


class DraftTrainer:
    """Builds the target (frozen), the drafter, the optimizer and the row sampler from a TrainConfig with [draft]."""

    def __init__(self, cfg: TrainConfig, *, progress: bool = True):
        assert cfg.draft is not None
        self.cfg, t, d = cfg, cfg.train, cfg.draft
        self.env, self.device = _Env(), resolve_device(t.device, 0)
        torch.manual_seed(t.seed)
        self.target = load(Path(d.target), dtype=torch.float32, device=self.device, text_only=True,
                           quiet=True).language_model.eval().requires_grad_(False)
        tc = self.target.config
        self.drafter = DSparkDrafter(shape_of(d, tc)).to(self.device)
        o = cfg.optim
        self.optim = build_optimizer(self.drafter, o.name, o.lr, o.weight_decay, tuple(o.betas), o.eps,
                                     o.muon_momentum)
        if cfg.data.seq_len < d.block_size + 1:
            raise ValueError(f"data.seq_len ({cfg.data.seq_len}) must exceed draft.block_size ({d.block_size})")
        stream = lambda key, files: open_stream(files, key, cfg.data.tokenizer, cfg.data.eos_id)  # noqa: E731
        self.rows = RowSampler(stream("data.train", cfg.data.train), cfg.data.seq_len, tc.vocab_size,
                               cfg.data.shuffle, cfg.data.seed)
        self.valid = (RowSampler(stream("data.valid", cfg.data.valid), cfg.data.seq_len, tc.vocab_size, False)
                      if cfg.data.valid else None)
        self.root = Path(cfg.out_dir) / "draft"
        self.step = 0
        self.metrics = MetricsLog(Path(cfg.out_dir) / "metrics.jsonl", True, None)
        self.progress_mode = "bar" if progress and cfg.log.progress else "lines"

    def _rows(self, sampler: RowSampler, first: int, count: int) -> Tensor:
        return torch.stack([torch.from_numpy(sampler.row(first + i)[:-1].astype("int64")) for i in range(count)])

    def losses(self, ids_RT: Tensor, seed: int) -> dict[str, Tensor]:
        """The step's losses and metrics for rows ids_RT (the drafter's graph attached to 'loss')."""
        d, S = self.cfg.draft, self.cfg.draft.block_size
        R, T = ids_RT.shape
        with torch.no_grad(), tapped(self.target, tuple(d.target_layer_ids)) as found:
            logits = self.target(ids_RT)
            taps = stack_taps(found)
        labels = ids_RT.clone()
        if d.labels == "target":  # the token at p is the target's argmax after p - 1
            labels[:, 1:] = logits[:, :-1].argmax(-1)
        g = torch.Generator().manual_seed(seed)
        anchors = torch.stack([torch.randperm(T - S, generator=g)[:d.anchors] + 1 for _ in range(R)]).sort(1).values
        anchors = anchors.clamp(max=T - S).to(ids_RT.device)
        block, pos, mask, lab, prev = block_batch(ids_RT, labels, anchors, S, self.drafter.config.mask_token_id)
        ctx = self.drafter.context(taps)
        h = self.drafter.backbone(ctx, block, self.target.model.embed_tokens,
                                  torch.arange(T, device=ids_RT.device).expand(R, T), pos, mask,
                                  anchors.repeat_interleave(S, 1) - 1)
        draft = (torch.arange(block.shape[1], device=ids_RT.device) % S) != 0  # slot 0 is the anchor
        out, conf = self.drafter.heads(h[:, draft], prev[:, draft], self.target.lm_head)
        target = lab[:, draft]
        ce = F.cross_entropy(out.flatten(0, 1), target.flatten())
        hit = (out.argmax(-1) == target).float()
        loss = ce
        if conf is not None:
            loss = loss + d.confidence_weight * F.binary_cross_entropy_with_logits(conf, hit)
        # teacher-forced acceptance: leading hits per block (a greedy-verification estimate)
        lead = hit.view(R, -1, S - 1).cumprod(-1).sum(-1).mean()
        return {"loss": loss, "ce": ce.detach(), "accept_len": 1 + lead}

    def _train_one_step(self) -> dict:
        c, t = self.cfg, self.cfg.train
        rows = t.micro_batch_rows * t.grad_accum
        self.optim.set_lr(lr_factor(self.step + 1, t.steps, c.optim.warmup_steps, c.optim.schedule,
                                    c.optim.min_lr_ratio, c.optim.decay_fraction))
        t0 = time.perf_counter()
        totals: dict[str, float] = {}
        for a in range(t.grad_accum):
            ids = self._rows(self.rows, self.step * rows + a * t.micro_batch_rows, t.micro_batch_rows)
            res = self.losses(ids.to(self.device), seed=t.seed * 1_000_003 + self.step * t.grad_accum + a)
            (res["loss"] / t.grad_accum).backward()
            for k, v in res.items():
                totals[k] = totals.get(k, 0.0) + float(v.detach()) / t.grad_accum
        params = [p for p in self.drafter.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, t.clip_grad_norm if t.clip_grad_norm > 0 else float("inf"))
        self.optim.step()
        self.optim.zero_grad()
        self.step += 1
        seconds = time.perf_counter() - t0
        record = {"step": self.step, **totals, "grad_norm": float(norm), "lr": self.optim.param_groups[0]["lr"],
                  "tokens_per_s": rows * c.data.seq_len / max(seconds, 1e-9)}
        if self.step % c.log.every == 0 or self.step == t.steps:
            self.metrics.write(record)
        return record

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Mean draft CE and teacher-forced accepted length over the first eval.rows validation rows."""
        self.drafter.eval()
        try:
            n = min(self.cfg.eval.rows, self.valid.num_rows)
            res = self.losses(self._rows(self.valid, 0, n).to(self.device), seed=0)
        finally:
            self.drafter.train()
        return {"step": self.step, "eval_ce": float(res["ce"]), "eval_accept_len": float(res["accept_len"])}

    def run(self, stop_at: int | None = None) -> str:
        """Train to train.steps (or stop_at), then write the drafter to out_dir/draft. Returns "done" or "stopped"."""
        c = self.cfg
        end = c.train.steps if stop_at is None else min(stop_at, c.train.steps)
        progress = Progress(self.progress_mode, c.train.steps, self.step, c.log.every)
        try:
            while self.step < end and not progress.closed:  # nobody reads the output any more: stop, save
                record = self._train_one_step()
                progress.update(self.step, record["loss"], record["tokens_per_s"])
                if self.valid is not None and c.eval.every and self.step % c.eval.every == 0:
                    e = self.evaluate()
                    self.metrics.write(e)
                    progress.print(f"step {self.step}: eval ce {e['eval_ce']:.4f}, accepted length "
                                   f"{e['eval_accept_len']:.2f}")
        finally:
            progress.close()
        if self.valid is not None:
            self.metrics.write(self.evaluate())
        save_drafter(self.drafter, self.root)
        return "done" if self.step >= c.train.steps else "stopped"

    def close(self) -> None:
        """Nothing to release (the CLI calls it on every trainer)."""
