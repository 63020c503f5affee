"""Speculative decoding inside the engine (docs/speculative.md, steps 1-4): proposals before scheduling,
verification of each drafted row (the runner's `commit` then keeps the committed KDA state exact).

Legend: Lk KDA layers, N sequences verifying a draft this step, k draft tokens, V vocabulary, T packed tokens,
n taps, D hidden.

A sequence with a draft runs `[its pending token, *draft]` as one short chunk, and `verify` picks the committed
tokens. The forward leaves the drafted rows' KDA slots as they were and saves their KDA inputs; once the
committed tokens are known the runner's `commit` runs the delta rule again over just those (`KimiDeltaAttention.
commit`), so the committed KDA state is always the state after committed tokens only: no state copy per draft
token, no rollback, and nothing re-fed. MLA latents of rejected positions are dropped by the sequence length not
advancing over them (the next step overwrites them). Steps whose rows are all short replay a CUDA graph with every
row padded to 1 + k tokens (graphs.py). The step's k, up to `num_speculative_tokens`, is chosen from the measured
acceptance and step costs (draft_length.py).

Structured output speculates where its constraint can roll back (`GrammarConstraint`): before the forward the
draft is walked through the grammar, cut at its first token the grammar refuses, and each verification row keeps
the mask of the grammar advanced by the drafts before it; the grammar is then rolled back, and advances by the
committed tokens only (as without speculation). A constraint without `rollback` decodes a token per step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from kimik3.inference.engine.config import SpeculativeConfig
from kimik3.inference.engine.draft_length import DraftLength, Row
from kimik3.inference.engine.request import Sequence, Status, TokenLogprob
from kimik3.inference.engine.runner import ModelRunner, Verification, take_rows
from kimik3.inference.engine.sampler import processed, raw_logprobs
from kimik3.inference.engine.scheduler import Chunk
from kimik3.inference.spec import Draft, Proposer, SpecStats, SuffixProposer, verify


def build_proposer(cfg: SpeculativeConfig, lm: nn.Module) -> Proposer:
    """The proposer `cfg.method` names: suffix decoding, the drafter at `cfg.model` (checked against the target:
    a ValueError names what differs), or the given Proposer object."""
    if cfg.method == "suffix":
        return SuffixProposer()
    if cfg.method == "draft":
        from kimik3.inference.spec.dspark import DSparkProposer, load_drafter

        drafter = load_drafter(cfg.model, lm.lm_head.weight.device)
        try:
            return DSparkProposer(drafter, lm)
        except ValueError as e:
            raise ValueError(f"speculative model {cfg.model}: {e}") from None
    return cfg.method


@dataclass(eq=False)
class _Track:
    """The proposer's view of one sequence: its id, the tokens it has observed, its taps not yet handed over."""

    id: int
    observed: int = 0
    tapped: int = 0  # positions [0, tapped) have had their taps recorded
    taps: list[Tensor] = field(default_factory=list)
    # a position was never computed here (a prefix-cache hit the proposer holds no record of): a drafter that reads
    # taps can't draft for it
    broken: bool = False


class Speculator:
    """Drafts for the running sequences, verifies them, rolls back the rejected ones. `stats` holds the counters,
    `lengths` chooses each step's k."""

    def __init__(self, cfg: SpeculativeConfig, lm: nn.Module):
        self.k = cfg.num_speculative_tokens  # the ceiling; `lengths` picks each step's k up to it
        self.lengths = DraftLength(self.k, cfg.adaptive)
        self.proposer = build_proposer(cfg, lm)
        self.needs_taps = tuple(self.proposer.needs_taps)
        self.stats = SpecStats()
        self.tracks: dict[Sequence, _Track] = {}
        self.masks: dict[Sequence, list[Tensor | None]] = {}  # a constrained draft's row masks, until verified
        self._next_id = 0

    def _track(self, seq: Sequence) -> _Track:
        t = self.tracks.get(seq)
        if t is None:
            t = self.tracks[seq] = _Track(self._next_id)
            self._next_id += 1
        return t

    def propose(self, running: list[Sequence], max_model_len: int) -> None:
        """Set `seq.draft` for each running sequence that decodes (None where nothing is proposed)."""
        for seq, t in list(self.tracks.items()):
            if seq.status is Status.FINISHED:
                self.proposer.finish(t.id)
                self.lengths.finish(t.id)
                del self.tracks[seq]
        self.masks.clear()
        rows, asking = [], []  # each sequence that can draft (`draft_length.Row`), and those sequences
        batch = 0  # the rows the step will carry, drafting or not
        for seq in running:
            seq.draft = None
            if seq.status is not Status.RUNNING:
                continue
            batch += 1
            if len(seq.tokens) <= seq.num_prompt:
                continue
            if seq.constraint is not None and not hasattr(seq.constraint, "rollback"):
                continue
            t = self._track(seq)
            if self.needs_taps and (t.broken or t.tapped != len(seq.tokens) - 1):
                continue
            # the bonus token comes on top of the drafts: at most what the length limits leave, minus one
            left = min(seq.params.max_new_tokens - (len(seq.tokens) - seq.num_prompt),
                       max_model_len - len(seq.tokens)) - 1
            if left < 1:
                continue
            p = seq.params
            rows.append(Row(t.id, min(self.k, left), fixed=p.seed is not None and p.temperature > 0))
            asking.append((seq, t))
        k = self.lengths.choose(rows, batch)
        if k == 0:  # drafting loses this step: it decodes (and a drafter skips its pass)
            return
        items = []  # the proposer's arguments per drafting sequence
        for row, (seq, t) in zip(rows, asking):
            if t.observed == 0:
                self.proposer.observe(t.id, seq.tokens[: seq.num_prompt])
                t.observed = seq.num_prompt
            if t.observed < len(seq.tokens):
                self.proposer.observe(t.id, seq.tokens[t.observed:])
                t.observed = len(seq.tokens)
            taps = None
            if self.needs_taps:
                taps = torch.cat(t.taps) if t.taps else None
                t.taps = []
            items.append((t.id, list(seq.tokens), row.cap if row.fixed else min(k, row.cap), taps))
        together = getattr(self.proposer, "propose_batch", None)  # a drafter drafts for every sequence in one pass
        t0 = time.perf_counter()
        drafts = together(items) if together is not None else [self.proposer.propose(*it) for it in items]
        if self.lengths.costs is not None:  # a drafter reads its drafts back: its pass has ended
            self.lengths.costs.proposed(batch, time.perf_counter() - t0)
        for (seq, t), draft in zip(asking, drafts):
            if draft.tokens and seq.constraint is not None:
                draft = self._constrain(seq, draft)
            seq.draft = draft if draft.tokens else None
            if seq.draft is None:  # asked, nothing proposed: the sequence's draft rate falls
                self.lengths.record(t.id, 0, 0)

    def _constrain(self, seq: Sequence, draft: Draft) -> Draft:
        """The draft up to its first token the grammar refuses; each row's mask kept in `masks` (the last row's,
        after every kept draft, too); the grammar left as it was."""
        c, masks, kept = seq.constraint, [], 0
        for token in draft.tokens:
            allowed = c.allowed()
            if allowed is not None and not bool(allowed[token]):
                break
            masks.append(allowed)
            c.accept(token)
            kept += 1
            if c.is_finished():  # the grammar ends here: nothing after this token is committed
                break
        masks.append(None if c.is_finished() else c.allowed())
        c.rollback(kept)
        if kept == 0:
            return Draft()
        self.masks[seq] = masks
        return Draft(draft.tokens[:kept], None if draft.probs is None else draft.probs[:kept],
                     None if draft.confidence is None else draft.confidence[:kept])

    def verify(self, logits_MV: Tensor, items: list[tuple[Sequence, int]]
               ) -> list[tuple[Sequence, list[int], list[TokenLogprob | None]]]:
        """Each drafted sequence's committed tokens and their logprobs. `items`: (seq, its first row of logits_MV);
        row j of a sequence is the target after its last committed token and draft[:j]."""
        rows, seqs, before, masks = [], [], [], []
        for seq, r in items:
            d = list(seq.draft_tokens)
            # a constrained draft always has its masks (`_constrain`); an unconstrained row has none
            row_masks = self.masks.get(seq, [None] * (len(d) + 1))
            for j in range(len(d) + 1):
                rows.append(r + j)
                seqs.append(seq)
                before.append(d[:j])
                masks.append(row_masks[j])
        raw = take_rows(logits_MV, rows)
        # logit bias, the penalties counting the drafts before each row, each row's grammar mask
        x = processed(raw, seqs, before, masks)
        out, i = [], 0
        for seq, _ in items:
            k = len(seq.draft_tokens)
            committed = verify(seq.draft_tokens, seq.draft.probs, x[i: i + k + 1], seq.params, seq.generator)
            self.stats.record(k, len(committed) - 1)
            self.lengths.record(self.tracks[seq].id, k, len(committed) - 1)
            out.append((seq, committed, raw_logprobs(raw[i: i + len(committed)], committed,
                                                     [seq.params] * len(committed))))
            i += k + 1
        return out

    def verify_and_commit(self, logits_MV: Tensor, samplers: list[tuple[Sequence, int]], v: Verification,
                          runner: ModelRunner) -> list[tuple[Sequence, list[int], list[TokenLogprob | None]]]:
        """After a step whose rows verified drafts (`samplers`: each sampling sequence's first row of logits_MV):
        the drafted sequences' committed tokens (`verify`), their KDA slots written for just those
        (`ModelRunner.commit`), and their computed positions cut back to them (the latents past them no longer
        count). Returns (seq, tokens, logprobs) per drafted sequence."""
        out = self.verify(logits_MV, [(s, r) for s, r in samplers if s.draft is not None])
        rejected = {seq: len(seq.draft_tokens) + 1 - len(tokens) for seq, tokens, _ in out}
        runner.commit(v, rejected)
        for seq, n in rejected.items():
            seq.num_computed -= n
            seq.draft = None
        return out

    def observe(self, chunks: list[Chunk], starts: list[int], hidden: Tensor | None,
                forks: list[tuple[Sequence, Sequence]]) -> None:
        """After a step's tokens were appended: the taps of the positions it computed (`starts`: each chunk's first
        position; `hidden`: the step's taps, a drafter's input), and the choices it forked."""
        if not self.needs_taps:
            return
        self.record_taps(chunks, starts, hidden)
        for parent, child in forks:
            self.fork(parent, child)

    def record_taps(self, chunks: list[Chunk], starts: list[int], hidden: Tensor) -> None:
        """Keep the taps [T, n*D] of the positions this step computed and committed (never a rejected draft's)."""
        row = 0
        for c, start in zip(chunks, starts):
            seq = c.seq
            t = self._track(seq)
            lo, hi = max(start, t.tapped), min(start + c.num_tokens, len(seq.tokens) - 1)
            if start > t.tapped and not t.broken:  # restored from the prefix cache: the proposer's own record?
                resume = getattr(self.proposer, "resume", None)
                if resume is not None and t.tapped == 0 and resume(t.id, seq.tokens[:start]) == start:
                    t.tapped = start
                else:
                    t.broken = True
            if not t.broken and hi > lo:
                t.taps.append(hidden[row + lo - start: row + hi - start])
                t.tapped = hi
            row += c.num_tokens

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """n > 1: a choice forked at the prompt's end starts with the parent's prompt taps."""
        p, c = self._track(parent), self._track(child)
        c.tapped, c.taps, c.broken = p.tapped, list(p.taps), p.broken
