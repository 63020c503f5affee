"""Speculative decoding, exact: proposers (suffix decoding, a DSpark-style drafter), the acceptance rule, stats.

The engine calls a `Proposer` per running sequence, verifies the `Draft` in one forward of the target (the
last committed token + the k drafts as one short prefill row), and commits `verify(...)`'s tokens.
"""

from kimik3.inference.spec.proposer import Draft, Proposer, SpecStats
from kimik3.inference.spec.suffix import SuffixConfig, SuffixProposer, SuffixTrie
from kimik3.inference.spec.verify import target_probs, verify

__all__ = ["Draft", "Proposer", "SpecStats", "SuffixConfig", "SuffixProposer", "SuffixTrie", "target_probs",
           "verify"]
