"""What the engine asks of a speculative proposer, and the counters it fills.

Legend: k draft tokens, V vocabulary, T positions, n taps (tapped target layers), D the target's hidden size.

Per running sequence and step the engine calls `propose(ids, k, taps)` and gets a `Draft`: up to k token ids
and, for a proposer that samples (a draft model), the distribution q each was drawn from, which the sampling
acceptance rule needs (`kimik3.inference.spec.verify`). After verification it calls `observe(seq_id, accepted)`
with the tokens now committed to the sequence (accepted drafts + the bonus/correction token) and `finish(seq_id)`
when the sequence ends. A deterministic proposer (suffix decoding, greedy drafting) returns `probs=None`: its
q is one-hot on the proposed token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from torch import Tensor


@dataclass(frozen=True)
class Draft:
    """Up to k proposed tokens for one sequence.

    Attributes:
        tokens: the draft token ids, in order (empty: nothing worth verifying this step).
        probs: [len(tokens), V] fp32 rows q_i the tokens were drawn from, or None (one-hot q: deterministic).
        confidence: per-token estimates of P(token i accepted | tokens < i accepted), or None.
    """

    tokens: tuple[int, ...] = ()
    probs: Tensor | None = None
    confidence: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.probs is not None and (self.probs.dim() != 2 or self.probs.shape[0] != len(self.tokens)):
            raise ValueError(f"Draft.probs must be [len(tokens)={len(self.tokens)}, V], got "
                             f"{tuple(self.probs.shape)}")
        if self.confidence is not None and len(self.confidence) != len(self.tokens):
            raise ValueError(f"Draft.confidence must have one entry per token ({len(self.tokens)}), got "
                             f"{len(self.confidence)}")


@runtime_checkable
class Proposer(Protocol):
    """A speculative proposer (design.md section 1: the engine's "speculative proposers").

    `needs_taps` names the target layers (0-based decoder layer indices) whose hidden states it reads
    (`kimik3.inference.spec.taps`: the residual stream after each). The engine passes them as `taps` [T, n*D]
    (the layers side by side, in needs_taps order) for the T positions the sequence committed since the last
    call: the whole prompt at the first call, then the last committed token and the accepted drafts of each
    verification (never a rejected draft's position). A model-free proposer has `needs_taps == ()` and gets None.
    """

    needs_taps: tuple[int, ...]

    def propose(self, seq_id: int, ids: list[int], k: int, taps: Tensor | None = None) -> Draft:
        """Draft up to k tokens to follow `ids` (the sequence's prompt + output so far)."""
        ...

    def observe(self, seq_id: int, tokens: list[int]) -> None:
        """`tokens` were appended to the sequence (prompt at admission, then each step's committed tokens)."""
        ...

    def finish(self, seq_id: int) -> None:
        """The sequence ended: free its per-sequence state (a proposer may keep its output for later requests)."""
        ...

    # optional: `propose_batch([(seq_id, ids, k, taps), ...]) -> list[Draft]`, every running sequence's draft in
    # one call (the engine uses it where it exists: a drafter then runs one pass and syncs once per step).
    # optional, for a proposer that reads taps: `resume(seq_id, ids) -> int`, called when a sequence starts from a
    # prefix-cache hit at `ids` (positions whose taps the target never computes for it): how many of them the
    # proposer accounts for (len(ids): it goes on from there, from its own record or without one; 0: it drafts
    # nothing for that sequence)


@dataclass
class SpecStats:
    """Speculative-decoding counters under vLLM's Prometheus names (the serving layer exports them as counters).

    `accepted_per_position[i]` counts steps whose draft token i was accepted (vLLM's per-position acceptance).
    """

    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One verified draft: `num_draft_tokens` proposed, the first `num_accepted` of them accepted."""
        assert 0 <= num_accepted <= num_draft_tokens
        if num_draft_tokens == 0:
            return
        self.spec_decode_num_drafts += 1
        self.spec_decode_num_draft_tokens += num_draft_tokens
        self.spec_decode_num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position += [0] * (num_draft_tokens - len(self.accepted_per_position))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per verification step, the bonus token included (1 + accepted / drafts)."""
        return 1.0 + self.spec_decode_num_accepted_tokens / max(self.spec_decode_num_drafts, 1)

    def as_metrics(self) -> dict[str, int]:
        return {"spec_decode_num_drafts": self.spec_decode_num_drafts,
                "spec_decode_num_draft_tokens": self.spec_decode_num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.spec_decode_num_accepted_tokens}
