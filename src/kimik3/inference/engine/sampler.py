"""Sampling for the sequences of one engine step: each row with its own request's parameters and generator.

Legend: M sequences sampling this step, V vocabulary.

The order is fixed: logit_bias, repetition penalty (prompt + output), presence and frequency penalties
(output only, OpenAI's definition), the structured-output mask, then `kimik3.inference.sampling.draw`
(greedy or temperature / top-k / top-p / min-p with the row's own generator). Log-probabilities are taken
from the raw logits, before any of that, as vLLM reports them by default.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kimik3.inference.engine.request import Sequence, TokenLogprob
from kimik3.inference.sampling import draw, repetition_penalty


def to_device(x: Tensor, device: torch.device) -> Tensor:
    """A small host tensor onto `device` without waiting for the step queued there (a copy from pageable memory
    would first wait for the stream: the sampler's launches would then start only once the forward ends)."""
    if device.type != "cuda":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)


def token_logprobs(logprobs_MV: Tensor, tokens: list[int], k: int) -> list[TokenLogprob]:
    """The log-probability of each row's token and the row's top-k: one host copy for all rows."""
    picked = logprobs_MV.gather(1, torch.tensor(tokens, device=logprobs_MV.device)[:, None])[:, 0].tolist()
    if k:
        top_v, top_i = logprobs_MV.topk(k, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(top_i.tolist(), top_v.tolist())]
    else:
        tops = [[] for _ in tokens]
    return [TokenLogprob(t, lp, top) for t, lp, top in zip(tokens, picked, tops)]


def sample(logits_MV: Tensor, seqs: list[Sequence]) -> tuple[list[int], list[TokenLogprob | None]]:
    """One token per row of logits_MV (row i belongs to seqs[i]); with their logprobs where requested."""
    device, (M, V) = logits_MV.device, logits_MV.shape
    x = logits_MV.float()
    params = [s.params for s in seqs]
    f = lambda xs, dtype=torch.float32: to_device(torch.tensor(xs, dtype=dtype), device)  # noqa: E731
    if any(p.logit_bias for p in params):
        bias = torch.zeros(M, V, device=device)
        for i, p in enumerate(params):
            for t, b in p.logit_bias:
                if t < V:
                    bias[i, t] += b
        x = x + bias
    if any(p.repetition_penalty != 1 for p in params):
        seen = torch.zeros(M, V, dtype=torch.bool, device=device)
        for i, s in enumerate(seqs):
            seen[i, torch.tensor(s.tokens, device=device)] = True
        x = repetition_penalty(x, seen, f([p.repetition_penalty for p in params]))
    if any(p.presence_penalty or p.frequency_penalty for p in params):
        counts = torch.zeros(M, V, device=device)
        for i, s in enumerate(seqs):
            out = torch.tensor(s.output, dtype=torch.long, device=device)
            counts[i].index_add_(0, out, torch.ones(out.shape[0], device=device))
        x = x - f([p.frequency_penalty for p in params])[:, None] * counts
        x = x - f([p.presence_penalty for p in params])[:, None] * (counts > 0)
    for i, s in enumerate(seqs):
        allowed = s.constraint.allowed() if s.constraint is not None else None
        if allowed is not None:
            x[i] = x[i].masked_fill(~allowed.to(device=device, dtype=torch.bool)[:V], float("-inf"))
    if all(p.temperature == 0 for p in params):  # what draw returns for these rows, without its vocabulary sort
        tokens = x.argmax(-1).tolist()
    else:
        tokens = draw(x, f([p.temperature for p in params]), f([p.top_k or V for p in params], torch.long),
                      f([p.top_p for p in params]), f([p.min_p for p in params]),
                      [s.generator for s in seqs]).tolist()
    logprobs: list[TokenLogprob | None] = [None] * M
    wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
    if wanted:
        lp = logits_MV[wanted].float().log_softmax(-1)
        k = max(params[i].logprobs for i in wanted)
        for i, entry in zip(wanted, token_logprobs(lp, [tokens[i] for i in wanted], k)):
            entry.top = entry.top[: params[i].logprobs]
            logprobs[i] = entry
    return tokens, logprobs
