"""Suffix decoding (model-free, after Arctic Inference's SuffixDecoding): draft by copying what followed the
current context's suffix earlier in the same sequence, or in earlier requests' outputs.

Legend: n tokens indexed so far, D the trie depth, k draft tokens.

`SuffixTrie` indexes every substring of length <= D of the tokens it is fed (a suffix tree cut at depth D,
stored as a trie with an occurrence count per node). Appending a token extends the <= D-1 open suffixes
ending at the previous token by one node each: O(D) per token, never a rebuild. To draft, the longest suffix
of the context (at most `max_match` tokens) whose node has children is matched, then the most frequent
child is followed while its probability (count / sum of sibling counts) stays >= `min_prob`, for at most
k tokens and at most `max_spec_factor * match_length` tokens. The per-sequence trie holds the prompt and the
output; the proposer's global trie holds the outputs of finished requests, and the draft with the higher
score (the product of the child probabilities along it, times its length) wins.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from kimik3.inference.spec.proposer import Draft


class _Node:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.count = 0


class SuffixTrie:
    """Every substring of length <= `depth` of the fed tokens, with its number of occurrences."""

    def __init__(self, depth: int):
        if depth < 2:
            raise ValueError(f"SuffixTrie depth must be >= 2, got {depth}")
        self.depth = depth
        self.root = _Node()
        self.num_nodes = 1
        self._open: list[_Node] = []  # nodes of the suffixes (lengths 1..depth-1) ending at the last token

    def extend(self, tokens: list[int]) -> None:
        """Append tokens to the indexed text (amortized O(depth) per token)."""
        for t in tokens:
            grown = []
            for node in [self.root, *self._open]:
                child = node.children.get(t)
                if child is None:
                    child = node.children[t] = _Node()
                    self.num_nodes += 1
                child.count += 1
                grown.append(child)
            # the longest suffix reached `depth` and cannot grow further: it leaves the open list
            self._open = grown[: self.depth - 1]

    def break_text(self) -> None:
        """End the current text: the next token starts a new one (earlier requests do not run into each other)."""
        self._open = []

    def lookup(self, context: list[int], max_match: int, min_match: int) -> tuple[_Node, int] | None:
        """The node of the longest suffix of `context` (min_match..max_match tokens) that has a continuation."""
        for length in range(min(max_match, len(context), self.depth - 1), min_match - 1, -1):
            node = self.root
            for t in context[len(context) - length:]:
                node = node.children.get(t)
                if node is None:
                    break
            if node is not None and node.children:
                return node, length
        return None


def _walk(node: _Node, k: int, min_prob: float) -> tuple[list[int], float]:
    """Follow the most frequent child while its probability is >= min_prob; (tokens, product of probabilities)."""
    tokens, score = [], 1.0
    while len(tokens) < k and node.children:
        total = sum(c.count for c in node.children.values())
        token, child = max(node.children.items(), key=lambda kv: kv[1].count)
        prob = child.count / total
        if prob < min_prob:
            break
        tokens.append(token)
        score *= prob
        node = child
    return tokens, score


@dataclass(frozen=True)
class SuffixConfig:
    """Knobs of suffix decoding.

    Attributes:
        depth: trie depth D (the longest indexed substring): max_match + the longest useful draft.
        max_match: the longest context suffix matched.
        min_match: the shortest (1 proposes after any repeated token; 2-3 avoid noise on fresh text).
        min_prob: stop drafting at a continuation less likely than this (its share of its siblings' counts).
        max_spec_factor: at most this many draft tokens per matched token (short matches draft little).
        global_outputs: also index finished requests' outputs in one trie shared by all sequences.
    """

    depth: int = 32
    max_match: int = 16
    min_match: int = 2
    min_prob: float = 0.1
    max_spec_factor: float = 2.0
    global_outputs: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.min_match <= self.max_match < self.depth:
            raise ValueError(f"SuffixConfig needs 1 <= min_match <= max_match < depth, got min_match="
                             f"{self.min_match}, max_match={self.max_match}, depth={self.depth}")
        if not 0 <= self.min_prob <= 1:
            raise ValueError(f"SuffixConfig.min_prob must be in [0, 1], got {self.min_prob}")
        if self.max_spec_factor <= 0:
            raise ValueError(f"SuffixConfig.max_spec_factor must be > 0, got {self.max_spec_factor}")


class SuffixProposer:
    """The `Proposer` of suffix decoding: one trie per running sequence (prompt + output) and a global one.

    The engine feeds each sequence through `observe` (its prompt at admission, then each step's committed
    tokens); `propose` reads only the trie, so the `ids` it is given are used for their last max_match tokens.
    """

    needs_taps: tuple[int, ...] = ()

    def __init__(self, cfg: SuffixConfig | None = None):
        self.cfg = cfg or SuffixConfig()
        self.tries: dict[int, SuffixTrie] = {}
        self.outputs: dict[int, list[int]] = {}  # each sequence's tokens since admission, for the global trie
        self.global_trie = SuffixTrie(self.cfg.depth) if self.cfg.global_outputs else None

    def observe(self, seq_id: int, tokens: list[int]) -> None:
        trie = self.tries.get(seq_id)
        if trie is None:
            trie = self.tries[seq_id] = SuffixTrie(self.cfg.depth)
            self.outputs[seq_id] = []
        else:
            self.outputs[seq_id].extend(tokens)  # the first call brings the prompt, which is not an output
        trie.extend(tokens)

    def finish(self, seq_id: int) -> None:
        self.tries.pop(seq_id, None)
        out = self.outputs.pop(seq_id, [])
        if self.global_trie is not None and out:
            self.global_trie.extend(out)
            self.global_trie.break_text()

    def propose(self, seq_id: int, ids: list[int], k: int, taps: Tensor | None = None) -> Draft:
        """Up to k tokens that followed the longest matching suffix of `ids` before (see the module docstring)."""
        c = self.cfg
        context = ids[-c.max_match:]
        if seq_id not in self.tries:  # a caller that never observed: index the context now
            self.observe(seq_id, list(ids))
        best: tuple[list[int], float] = ([], 0.0)
        for trie in (self.tries[seq_id], self.global_trie):
            found = trie.lookup(context, c.max_match, c.min_match) if trie is not None else None
            if found is None:
                continue
            node, length = found
            tokens, score = _walk(node, min(k, int(c.max_spec_factor * length)), c.min_prob)
            if tokens and score * len(tokens) > best[1] * len(best[0]):
                best = (tokens, score)
        return Draft(tuple(best[0]))
