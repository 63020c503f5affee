"""Speculative decoding of one sequence with full forwards of the target: the reference loop for tests and for
measuring a proposer's acceptance, outside the serving engine (no cache: every step runs prompt + output + draft).

Legend: L tokens so far, k draft tokens, V vocabulary.
"""

from __future__ import annotations

import torch
from torch import nn

from kimik3.inference.sampling import SamplingParams
from kimik3.inference.spec.proposer import Proposer, SpecStats
from kimik3.inference.spec.taps import stack_taps, tapped
from kimik3.inference.spec.verify import verify


@torch.no_grad()
def greedy_reference(target: nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Non-speculative greedy decoding by full forwards (no cache), on the target's device: the tokens speculative
    greedy must reproduce, and the engine's tests' oracle."""
    ids, device = list(prompt), next(target.parameters()).device
    for _ in range(max_new_tokens):
        ids.append(int(target(torch.tensor([ids], device=device))[0, -1].argmax()))
    return ids[len(prompt):]


@torch.no_grad()
def speculative_generate(target: nn.Module, proposer: Proposer, prompt: list[int], max_new_tokens: int,
                         params: SamplingParams, k: int, *, generator: torch.Generator | None = None,
                         stats: SpecStats | None = None, seq_id: int = 0) -> list[int]:
    """`max_new_tokens` tokens after `prompt`: each step drafts up to k tokens, runs the target over
    prompt + output + draft, and commits `verify`'s tokens. Fills `stats` when given."""
    stats = stats if stats is not None else SpecStats()
    ids, new_taps = list(prompt), None
    with tapped(target, proposer.needs_taps) as found:
        logits = target(torch.tensor([ids]))[0]
        taps = stack_taps(found)[0] if proposer.needs_taps else None
        first = verify([], None, logits[-1:], params, generator)
        new_taps = taps
        proposer.observe(seq_id, ids)
        proposer.observe(seq_id, first)
        ids += first
        while len(ids) - len(prompt) < max_new_tokens:
            draft = proposer.propose(seq_id, ids, min(k, max_new_tokens - (len(ids) - len(prompt))), new_taps)
            d = list(draft.tokens)
            logits = target(torch.tensor([ids + d]))[0]
            start = len(ids) - 1  # the row predicting the token after ids[-1]
            committed = verify(d, draft.probs, logits[start:start + len(d) + 1], params, generator)
            stats.record(len(d), len(committed) - 1)
            if proposer.needs_taps:  # the anchor's and the accepted drafts' positions: now committed context
                new_taps = stack_taps(found)[0, start:start + len(committed)]
            proposer.observe(seq_id, committed)
            ids += committed
    proposer.finish(seq_id)
    return ids[len(prompt):len(prompt) + max_new_tokens]
