"""A proposer that knows the answer: for tests and benchmarks of the verification path on random weights, where no
real proposer would ever be accepted.

It holds reference sequences (prompt + the target's greedy continuation). Each draft token is the reference's next
token with probability p and a wrong one otherwise, so with k drafts the expected accepted length (the bonus
token included) is (1 - p^(k+1)) / (1 - p): a knob for acceptance. A sequence that has left every reference
(sampling) gets no draft.

Whether the draft for a position is right is drawn once per (seed, sequence, position), not from a stream: a run
then drafts the same as any other run of the same references, whatever ran before it (a warm-up) and whichever
reference of several it follows. A step's outcome reads only the marks up to its first wrong draft, and the next
step starts after that, so the steps' accepted lengths are still independent draws of the law above.
"""

from __future__ import annotations

import random
import zlib

from torch import Tensor

from kimik3.inference.spec.proposer import Draft


def expected_accepted_length(p: float, k: int) -> float:
    """Mean tokens committed per verification step when each draft token is right with probability p."""
    return float(k + 1) if p >= 1 else (1 - p ** (k + 1)) / (1 - p)


def p_for_accepted_length(length: float, k: int) -> float:
    """The p at which k drafts give `length` expected tokens per verification step (bisection: the length rises
    with p from 1 to k + 1)."""
    if not 1 <= length <= k + 1:
        raise ValueError(f"an accepted length with {k} drafts lies in [1, {k + 1}], got {length}")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_accepted_length(mid, k) < length else (lo, mid)
    return (lo + hi) / 2


class OracleProposer:
    """Drafts from `references` (full token lists): right with probability `p`, drawn per position from `seed`.

    Args:
        references: prompt + greedy continuation of each request the proposer may meet.
        p: the chance each draft token is the reference's.
        vocab_size: wrong tokens are the reference's + 1 modulo it.
        seed: the marks' seed.
    """

    needs_taps: tuple[int, ...] = ()

    def __init__(self, references: list[list[int]], p: float, vocab_size: int, seed: int = 0):
        if not 0 <= p <= 1:
            raise ValueError(f"p must be in [0, 1], got {p}")
        self.references, self.p, self.vocab_size = [list(r) for r in references], p, vocab_size
        self.seed = seed

    def observe(self, seq_id: int, tokens: list[int]) -> None:
        """Nothing to keep: `propose` matches the whole context against the references."""

    def finish(self, seq_id: int) -> None:
        """Nothing to free."""

    def propose(self, seq_id: int, ids: list[int], k: int, taps: Tensor | None = None) -> Draft:
        n = len(ids)
        ref = next((r for r in self.references if len(r) > n and r[:n] == ids), None)
        if ref is None:
            return Draft()
        # the sequence is named by its first tokens (the prompt's), so every reference it may follow shares the marks
        name = zlib.crc32(repr(ids[:32]).encode())
        out = []
        for pos, t in enumerate(ref[n: n + k], start=n):
            right = random.Random((self.seed << 64) | (name << 32) | pos).random() < self.p
            out.append(t if right else (t + 1) % self.vocab_size)
        return Draft(tuple(out))
