"""The DSpark drafter as a `Proposer`, and its folder: config.json + model.safetensors (docs/speculative.md).

Legend: C context positions, S block slots, D hidden, V vocabulary, n tapped layers.

Per sequence the proposer keeps the drafter's context features [C, D] (fc + hidden_norm of the taps), one row per
committed position: the engine passes the taps of the positions it committed since the last call, so a step
costs the new rows' projection plus one backbone pass over S slots, never a pass over the whole context taps.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from kimik3.checkpoint.safetensors_header import read_tensors
from kimik3.inference.spec.drafter import DraftConfig, DSparkDrafter
from kimik3.inference.spec.proposer import Draft

CONFIG, WEIGHTS = "config.json", "model.safetensors"


def save_drafter(drafter: DSparkDrafter, folder: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write `config.json` and `model.safetensors` (weights in `dtype`; the target's embedding and head are not
    stored). Returns the folder."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG).write_text(json.dumps(drafter.config.to_dict(), indent=2) + "\n")
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in drafter.state_dict().items()}
    save_file(state, str(out / WEIGHTS), metadata={"format": "pt"})
    return out


def load_drafter(folder: str | Path, device: str | torch.device = "cpu") -> DSparkDrafter:
    """A drafter from its folder, fp32, in eval mode. Missing, unexpected or misshapen tensors raise ValueError
    naming the tensor and the file."""
    folder = Path(folder)
    for name in (CONFIG, WEIGHTS):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"no drafter {name} in {folder}")
    try:
        raw = json.loads((folder / CONFIG).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{folder / CONFIG}: not valid JSON ({e})") from None
    drafter = DSparkDrafter(DraftConfig.from_dict(raw))
    state = read_tensors(folder / WEIGHTS)
    want = drafter.state_dict()
    missing, unexpected = sorted(set(want) - set(state)), sorted(set(state) - set(want))
    if missing or unexpected:
        raise ValueError(f"{folder / WEIGHTS}: missing tensors {missing[:5]}, unexpected {unexpected[:5]}")
    for k, v in state.items():
        if v.shape != want[k].shape:
            raise ValueError(f"{folder / WEIGHTS}: tensor {k} has shape {tuple(v.shape)}, the config gives "
                             f"{tuple(want[k].shape)}")
    drafter.load_state_dict({k: v.float() for k, v in state.items()})
    return drafter.to(device).eval()


def check_target(cfg: DraftConfig, target_cfg) -> None:
    """Raise ValueError unless the drafter was made for a target of this shape (a TextConfig)."""
    for mine, theirs in (("target_hidden_size", "hidden_size"), ("target_num_hidden_layers", "num_layers"),
                         ("vocab_size", "vocab_size")):
        if getattr(cfg, mine) != getattr(target_cfg, theirs):
            raise ValueError(f"the drafter's {mine} is {getattr(cfg, mine)}, the target's {theirs} is "
                             f"{getattr(target_cfg, theirs)}")


class DSparkProposer:
    """Drafts with a `DSparkDrafter` over a target `K3ForCausalLM`'s embedding and LM head.

    Args:
        drafter, target: the draft model and the (frozen) target whose `model.embed_tokens` and `lm_head` it uses.
        sample: draw drafts from q = softmax(logits / temperature) with `generator` (the Draft then carries q);
            False drafts the argmax (q one-hot, `Draft.probs` None): the choice for greedy targets.
        min_confidence: stop drafting once the product of the confidence head's probabilities falls below it
            (0: always draft k; the first draft token is always proposed).
        keep_bytes: how much context of finished sequences is kept (least recently used first out), so that a
            sequence restored from the prefix cache, whose prefix the target never computed again, drafts with
            its whole context (`resume`; a running sequence's context serves as well); without a record it drafts
            from the context after the restored prefix.
    """

    def __init__(self, drafter: DSparkDrafter, target: nn.Module, *, sample: bool = False, temperature: float = 1.0,
                 min_confidence: float = 0.0, generator: torch.Generator | None = None, keep_bytes: int = 256 << 20):
        check_target(drafter.config, target.config)
        self.drafter, self.embed, self.lm_head = drafter, target.model.embed_tokens, target.lm_head
        self.needs_taps = drafter.config.target_layer_ids
        self.sample, self.temperature, self.min_confidence = sample, temperature, min_confidence
        self.generator = generator
        self.ctx: dict[int, Tensor] = {}
        self.ids: dict[int, list[int]] = {}  # each sequence's tokens at its last `propose`
        self.start: dict[int, int] = {}  # the first position a sequence's context holds (0 unless `resume` found none)
        self.keep_bytes = keep_bytes
        self.kept: OrderedDict[tuple[int, ...], Tensor] = OrderedDict()  # finished sequences' [C, D] contexts

    def observe(self, seq_id: int, tokens: list[int]) -> None:
        """Nothing to do: the context grows through the taps given to `propose`."""

    def finish(self, seq_id: int) -> None:
        ctx, ids, start = self.ctx.pop(seq_id, None), self.ids.pop(seq_id, None), self.start.pop(seq_id, 0)
        if ctx is None or not len(ctx) or ctx.nbytes > self.keep_bytes or start:
            return
        self.kept[tuple(ids[: len(ctx)])] = ctx
        while sum(c.nbytes for c in self.kept.values()) > self.keep_bytes:
            self.kept.popitem(last=False)

    def resume(self, seq_id: int, ids: list[int]) -> int:
        """A sequence restored from the prefix cache at `ids` (its target never computed those positions here):
        its context is that of a kept or running sequence that began with them (requests sharing a prompt run
        side by side), else none before len(ids): it drafts from the context after them. Returns len(ids): every
        restored position is accounted for."""
        n, key = len(ids), tuple(ids)
        running = ((tuple(self.ids[i][:n]), c) for i, c in self.ctx.items()
                   if i in self.ids and not self.start.get(i, 0))
        for tokens, ctx in [*running, *reversed(self.kept.items())]:
            if len(ctx) >= n and tokens[:n] == key:
                if tokens in self.kept:
                    self.kept.move_to_end(tokens)
                self.ctx[seq_id] = ctx[:n].clone()
                return n
        self.start[seq_id] = n
        return n

    def propose(self, seq_id: int, ids: list[int], k: int, taps: Tensor | None = None) -> Draft:
        """Draft up to min(k, num_drafts) tokens after `ids` (`propose_batch` of one sequence).

        Args:
            taps: [T, n*D_target] the taps of the T positions committed since the last call (the whole prompt
                at the first); afterwards the sequence holds len(ids) - 1 context positions.
        """
        return self.propose_batch([(seq_id, ids, k, taps)])[0]

    @torch.no_grad()
    def propose_batch(self, items: list[tuple[int, list[int], int, Tensor | None]]) -> list[Draft]:
        """`propose` for several sequences, (seq_id, ids, k, taps) each, in one backbone pass: contexts padded on
        the left to the longest (masked), every block k + 1 slots for the largest k. Each drafted token is chosen
        on the device; tokens and confidences come to the host once, after the last (no sync per token)."""
        cfg, dev = self.drafter.config, self.lm_head.weight.device
        rows = []  # (seq_id, ids, k, ctx, start) of the sequences that draft
        drafts = [Draft()] * len(items)
        for i, (seq_id, ids, k, taps) in enumerate(items):
            self.ids[seq_id] = ids
            if taps is not None and len(taps):
                new = self.drafter.context(taps.to(dev)[None])[0]
                self.ctx[seq_id] = torch.cat([self.ctx[seq_id], new]) if seq_id in self.ctx else new
            ctx, start = self.ctx.get(seq_id), self.start.get(seq_id, 0)
            C = 0 if ctx is None else ctx.shape[0]
            if start + C != len(ids) - 1:
                after = f" from position {start}" if start else ""
                raise ValueError(f"sequence {seq_id}: the drafter holds taps of {C} positions{after} but ids has "
                                 f"{len(ids)} tokens (want the taps of every position before the newest token)")
            k = min(k, cfg.num_drafts)
            if k > 0 and ctx is not None:
                rows.append((i, ids, k, ctx, start))
        if not rows:
            return drafts
        B, S, Cm = len(rows), 1 + max(r[2] for r in rows), max(len(r[3]) for r in rows)
        ctx_BCD = torch.zeros(B, Cm, rows[0][3].shape[1], device=dev)
        ctx_pos, block_pos = torch.zeros(B, Cm, dtype=torch.long), torch.zeros(B, S, dtype=torch.long)
        mask_BSN = torch.ones(B, S, Cm + S, dtype=torch.bool)
        block = torch.full((B, S), cfg.mask_token_id, dtype=torch.long)
        for b, (_, ids, _, ctx, start) in enumerate(rows):
            C, at = len(ctx), start + len(ctx)  # at: the anchor's position
            ctx_BCD[b, Cm - C:] = ctx
            ctx_pos[b, Cm - C:] = torch.arange(start, at)
            block_pos[b] = torch.arange(at, at + S)
            mask_BSN[b, :, : Cm - C] = False  # the left padding
            block[b, 0] = ids[-1]
        padded = any(len(r[3]) < Cm for r in rows)  # else no mask: every slot sees every position
        h = self.drafter.backbone(ctx_BCD, block.to(dev), self.embed, ctx_pos.to(dev), block_pos.to(dev),
                                  mask_BSN.to(dev) if padded else None)
        # the target head over every slot at once (one read of its [V, D] weight); the Markov bias and the
        # confidence follow each drafted token in turn, for all sequences together
        base = self.lm_head(h[:, 1:].to(self.lm_head.weight.dtype)).float()
        prev, tokens, probs, confs = block[:, 0].to(dev), [], [], []
        for j in range(1, S):
            logits, conf = self.drafter.finish_heads(base[:, j - 1], h[:, j], prev)
            confs.append(torch.sigmoid(conf) if conf is not None else torch.ones(B, device=dev))
            if self.sample:
                q = (logits / max(self.temperature, 1e-6)).softmax(-1)
                prev = torch.multinomial(q, 1, generator=self.generator)[:, 0]
                probs.append(q)
            else:
                prev = logits.argmax(-1)
            tokens.append(prev)
        tokens_BK, confs_BK = torch.stack(tokens, 1).tolist(), torch.stack(confs, 1).float().tolist()
        for b, (i, _, k, _, _) in enumerate(rows):
            n, survive = 0, 1.0  # the first draft token is always proposed; then while the confidence holds
            while n < k and (n == 0 or survive * confs_BK[b][n] >= self.min_confidence):
                survive *= confs_BK[b][n]
                n += 1
            drafts[i] = Draft(tuple(tokens_BK[b][:n]), torch.stack([q[b] for q in probs[:n]]) if probs else None,
                              tuple(confs_BK[b][:n]))
        return drafts
