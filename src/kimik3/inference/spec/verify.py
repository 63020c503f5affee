"""The acceptance rule of speculative decoding: which draft tokens the target keeps, and the token it adds.

Legend: k draft tokens, V vocabulary.

Greedy (temperature 0): draft token i is kept while it equals the argmax of the target's logits at i; the first
mismatch is replaced by that argmax, and when all k match the argmax of row k is the bonus token. The tokens
are exactly those of non-speculative greedy decoding.

Sampling (Leviathan et al. 2023, Chen et al. 2023): with p_i the target's processed distribution at position i
(temperature, top-k, top-p, min-p through `kimik3.inference.sampling.truncated_probs`, the pieces `draw` uses)
and q_i the distribution the draft token d_i was drawn from, d_i is kept with probability min(1, p_i(d_i) /
q_i(d_i)); the first rejected position draws from norm(max(0, p_i - q_i)) instead and ends the step; when
all k are kept a bonus token is drawn from p_k. A deterministic proposer's q_i is one-hot on d_i, so d_i is
kept with probability p_i(d_i) and a rejection draws from p_i with d_i removed. Each kept or drawn token is
then distributed exactly as p (every random number comes from the row's own generator).

Penalties and biases are the caller's: `target_logits` row i must already carry the logit bias, repetition,
presence and frequency penalties and the structured-output mask for the context ending at draft token i-1.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kimik3.inference.sampling import SamplingParams, truncated_probs


def target_probs(logits_KV: Tensor, params: SamplingParams) -> Tensor:
    """[R, V] processed logits -> [R, V] fp32 probabilities (in vocabulary order) that `draw` samples from."""
    R, V = logits_KV.shape
    full = lambda v, dtype=torch.float32: torch.full((R,), v, dtype=dtype, device=logits_KV.device)  # noqa: E731
    sorted_probs, order = truncated_probs(logits_KV.float(), full(params.temperature),
                                          full(params.top_k or V, torch.long), full(params.top_p),
                                          full(params.min_p))
    return torch.zeros_like(sorted_probs).scatter_(1, order, sorted_probs)


def verify(draft_tokens: list[int] | Tensor, draft_probs: Tensor | None, target_logits: Tensor,
           params: SamplingParams, generator: torch.Generator | None = None) -> list[int]:
    """The tokens one verification step commits: the accepted draft prefix, then one correction/bonus token.

    Args:
        draft_tokens: [k] the proposed ids (k may be 0: then this is plain sampling of one token).
        draft_probs: [k, V] the rows q_i the draft tokens were drawn from, or None for a deterministic proposer.
        target_logits: [k+1, V] the target's logits at the last committed token and at each draft token.
        params: the row's sampling parameters (temperature 0: greedy).
        generator: the row's own generator (sampling only; None: torch's global one).
    Returns:
        1..k+1 token ids: `result[:-1]` are the accepted drafts (== draft_tokens[:len(result)-1]).
    """
    d = [int(t) for t in (draft_tokens.tolist() if isinstance(draft_tokens, Tensor) else draft_tokens)]
    k = len(d)
    if target_logits.dim() != 2 or target_logits.shape[0] != k + 1:
        raise ValueError(f"target_logits must be [k+1={k + 1}, V], got {tuple(target_logits.shape)}")
    if draft_probs is not None and tuple(draft_probs.shape) != (k, target_logits.shape[1]):
        raise ValueError(f"draft_probs must be [k={k}, V={target_logits.shape[1]}], got "
                         f"{tuple(draft_probs.shape)}")
    if params.temperature == 0:
        best = target_logits.argmax(-1).tolist()
        n = 0
        while n < k and d[n] == best[n]:
            n += 1
        return d[:n] + [best[n]]
    p_KV = target_probs(target_logits, params)
    u = torch.rand(k, generator=generator, device=p_KV.device).tolist() if k else []
    for i, t in enumerate(d):
        p = float(p_KV[i, t])
        q = 1.0 if draft_probs is None else float(draft_probs[i, t])
        if q > 0 and u[i] < min(1.0, p / q):
            continue
        if draft_probs is None:
            residual = p_KV[i].clone()
            residual[t] = 0
        else:
            residual = (p_KV[i] - draft_probs[i].to(p_KV)).clamp(min=0)
        if float(residual.sum()) <= 0:  # p == q up to rounding: a rejection then has p's own odds
            residual = p_KV[i]
        return d[:i] + [int(torch.multinomial(residual, 1, generator=generator))]
    return d + [int(torch.multinomial(p_KV[k], 1, generator=generator))]
