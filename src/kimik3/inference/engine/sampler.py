"""Sampling for the sequences of one engine step: each row with its own request's parameters and generator.

Legend: M sequences sampling this step, V vocabulary.

The order is fixed: logit_bias, repetition penalty (prompt + output), presence and frequency penalties
(output only, OpenAI's definition), the structured-output mask, then `kimik3.inference.sampling.draw`
(greedy or temperature / top-k / top-p / min-p with the row's own generator). Log-probabilities are taken
from the raw logits, before any of that, as vLLM reports them by default.

The penalties read counts that each sequence keeps on the device (`TokenCounts`), brought up to date with only the
tokens added since its last step: a step's cost does not grow with the lengths of its sequences.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from kimik3.inference.engine.request import Sequence, TokenCounts, TokenLogprob
from kimik3.inference.sampling import SamplingParams, draw, repetition_penalty
from kimik3.ops.backend import to_device


def token_logprobs(logprobs_MV: Tensor, tokens: list[int], k: int) -> list[TokenLogprob]:
    """The log-probability of each row's token and the row's top-k: one host copy for all rows."""
    picked = logprobs_MV.gather(1, torch.tensor(tokens, device=logprobs_MV.device)[:, None])[:, 0].tolist()
    if k:
        top_v, top_i = logprobs_MV.topk(k, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(top_i.tolist(), top_v.tolist())]
    else:
        tops = [[] for _ in tokens]
    return [TokenLogprob(t, lp, top) for t, lp, top in zip(tokens, picked, tops)]


def prompt_logprobs(seq: Sequence, logits_nV: Tensor) -> Tensor:
    """The prompt logprobs of a chunk starting at seq.num_computed from its [n, V] logits (row i predicts prompt
    token num_computed+i+1), appended to the request's; positions already reported (a preempted prefill computes
    them again) are skipped. Returns the rows' log-softmax, which the chunk's prefix snapshots keep."""
    group, k, first, n = seq.group, seq.params.prompt_logprobs, seq.num_computed, logits_nV.shape[0]
    if group.prompt_logprobs is None:
        group.prompt_logprobs = [None]
    lp = logits_nV.log_softmax(-1)
    lo = len(group.prompt_logprobs)  # the next prompt position without a logprob
    hi = min(first + n, seq.num_prompt - 1)  # the last position a row of this chunk predicts
    if hi >= lo:
        group.prompt_logprobs.extend(token_logprobs(lp[lo - first - 1: hi - first], seq.tokens[lo: hi + 1], k))
    if first + n == seq.num_prompt:  # the prompt's last row: its end snapshot keeps it
        group.prompt_end_row = lp[-1].clone()
    return lp


def _penalized(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1 or bool(p.presence_penalty or p.frequency_penalty)


def token_counts(seq: Sequence, V: int, device: torch.device) -> TokenCounts:
    """seq's counts over all its tokens now: the first call counts them all, later ones only the new ones."""
    c = seq.counts
    if c is None:
        c = seq.counts = TokenCounts(torch.zeros(V, dtype=torch.bool, device=device), torch.zeros(V, device=device))
    assert c.seen_V.shape[0] == V and c.seen_V.device == device, "the sampler's vocabulary or device changed"
    if c.upto < len(seq.tokens):
        ids = to_device(torch.tensor(seq.tokens[c.upto:], dtype=torch.long), device)
        c.seen_V[ids] = True
        out = ids[max(0, seq.num_prompt - c.upto):]  # the prompt counts for the repetition penalty only
        c.output_V.index_add_(0, out, torch.ones(out.shape[0], device=device))
        c.upto = len(seq.tokens)
    return c


def _with_drafts(c: TokenCounts, drafts: list[int]) -> TokenCounts:
    """c with a row's earlier draft tokens counted too (outputs: a verification row's context includes them)."""
    if not drafts:
        return c
    ids = torch.tensor(drafts, dtype=torch.long, device=c.seen_V.device)
    return TokenCounts(c.seen_V.clone().index_fill_(0, ids, True),
                       c.output_V.index_add(0, ids, torch.ones(len(drafts), device=c.output_V.device)), c.upto)


def penalize(x_MV: Tensor, seqs: list[Sequence], drafts: list[list[int]] | None = None) -> Tensor:
    """fp32 logits after the repetition penalty (prompt + output) and the presence and frequency penalties
    (output only). Rows without a penalty of their own get zero counts: the batch's per-row factors (1 and 0)
    then leave them bit for bit as they are, as if their tokens had been counted. `drafts[i]`: draft tokens
    that precede row i (speculative verification), counted as output."""
    params = [s.params for s in seqs]
    rep = any(p.repetition_penalty != 1 for p in params)
    freq = any(p.presence_penalty or p.frequency_penalty for p in params)
    if not (rep or freq):
        return x_MV
    device, V = x_MV.device, x_MV.shape[1]
    f = lambda xs: to_device(torch.tensor(xs, dtype=torch.float32), device)  # noqa: E731
    counts = [token_counts(s, V, device) if _penalized(s.params) else None for s in seqs]
    if drafts is not None:
        counts = [c if c is None else _with_drafts(c, d) for c, d in zip(counts, drafts)]
    if rep:
        no = torch.zeros(V, dtype=torch.bool, device=device)
        seen = torch.stack([c.seen_V if c is not None else no for c in counts])
        x_MV = repetition_penalty(x_MV, seen, f([p.repetition_penalty for p in params]))
    if freq:
        zero = torch.zeros(V, device=device)
        out = torch.stack([c.output_V if c is not None else zero for c in counts])
        x_MV = x_MV - f([p.frequency_penalty for p in params])[:, None] * out
        x_MV = x_MV - f([p.presence_penalty for p in params])[:, None] * (out > 0)
    return x_MV


def processed(logits_MV: Tensor, seqs: list[Sequence], drafts: list[list[int]] | None = None,
              masks: list[Tensor | None] | None = None) -> Tensor:
    """fp32 logits after logit_bias, the penalties and the structured-output mask: what `draw` (or the
    speculative acceptance rule) samples from. Row i belongs to seqs[i] (after drafts[i], see `penalize`);
    `masks[i]` (bool [V] allowed, None: none) replaces its constraint's mask (a row after drafts, whose grammar
    state is not the sequence's)."""
    device, (M, V) = logits_MV.device, logits_MV.shape
    x = logits_MV.float()
    params = [s.params for s in seqs]
    if any(p.logit_bias for p in params):
        bias = torch.zeros(M, V, device=device)
        for i, p in enumerate(params):
            for t, b in p.logit_bias:
                if t < V:
                    bias[i, t] += b
        x = x + bias
    x = penalize(x, seqs, drafts)
    if masks is None:
        masks = [s.constraint.allowed() if s.constraint is not None else None for s in seqs]
    allowed = {i: a for i, a in enumerate(masks) if a is not None}
    if allowed:
        banned = torch.zeros(M, V, dtype=torch.bool, device=device)
        for i, a in allowed.items():
            banned[i] = ~a.to(device=device, dtype=torch.bool)[:V]
        # out of place: with fp32 logits and nothing above applied, x is logits_MV itself (the runner's buffer),
        # whose raw values `raw_logprobs` reports
        x = x.masked_fill(banned, float("-inf"))
    return x


def sample(logits_MV: Tensor, seqs: list[Sequence], sync: Callable[[Tensor], object] | None = None
           ) -> tuple[list[int], list[TokenLogprob | None]]:
    """One token per row of logits_MV (row i belongs to seqs[i]); with their logprobs where requested.
    `sync` is called in place on the sampled ids [M] before they are read (ranks generating together)."""
    device, V = logits_MV.device, logits_MV.shape[1]
    params = [s.params for s in seqs]
    f = lambda xs, dtype=torch.float32: to_device(torch.tensor(xs, dtype=dtype), device)  # noqa: E731
    x = processed(logits_MV, seqs)
    if all(p.temperature == 0 for p in params):  # what draw returns for these rows, without its vocabulary sort
        picked = x.argmax(-1)
    else:
        picked = draw(x, f([p.temperature for p in params]), f([p.top_k or V for p in params], torch.long),
                      f([p.top_p for p in params]), f([p.min_p for p in params]), [s.generator for s in seqs])
    if sync is not None:
        sync(picked)
    tokens = picked.tolist()
    return tokens, raw_logprobs(logits_MV, tokens, params)


def raw_logprobs(logits_MV: Tensor, tokens: list[int], params: list[SamplingParams]) -> list[TokenLogprob | None]:
    """Row i's logprob of tokens[i] and its top params[i].logprobs, from the raw logits (None where not asked)."""
    logprobs: list[TokenLogprob | None] = [None] * len(tokens)
    wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
    if wanted:
        lp = logits_MV[wanted].float().log_softmax(-1)
        k = max(params[i].logprobs for i in wanted)
        for i, entry in zip(wanted, token_logprobs(lp, [tokens[i] for i in wanted], k)):
            entry.top = entry.top[: params[i].logprobs]
            logprobs[i] = entry
    return logprobs
