"""Which tokens of which sequences the next step computes, and where their state lives.

One token budget per step (`max_num_batched_tokens`) over the running sequences (in admission order) and
then the waiting ones (first come, first served). A decode costs one token; a prefill takes what is left of
the budget, in chunks that end on the 64-token grid (all but a prompt's last), so prefix snapshots sit on
the grid and a restored sequence chunks exactly as a cold one. When the MLA block pool runs dry the prefix
cache gives back blocks first; then the most recently admitted running sequence is preempted (its slot and
blocks are freed and it is recomputed later, possibly from the prefix cache).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from kimik3.inference.engine.config import GRID
from kimik3.inference.engine.pools import BlockPool, SlotPool
from kimik3.inference.engine.prefix_cache import PrefixCache, PromptLogprobs, prompt_logprobs_at
from kimik3.inference.engine.request import RequestState, Sequence, Status, TokenLogprob
from kimik3.inference.engine.sampler import token_logprobs


@dataclass
class Chunk:
    seq: Sequence
    num_tokens: int
    exports: list[int] = field(default_factory=list)  # offsets from the chunk start to snapshot after


class Scheduler:
    def __init__(self, slots: SlotPool, blocks: BlockPool, cache: PrefixCache | None, *, max_num_seqs: int,
                 max_num_batched_tokens: int, snapshot_interval: int, interior_snapshots: bool,
                 max_model_len: int, eos_token_ids: tuple[int, ...] = ()):
        self.slots, self.blocks, self.cache = slots, blocks, cache
        self.max_num_seqs, self.budget = max_num_seqs, max_num_batched_tokens
        self.snapshot_interval, self.interior_snapshots = snapshot_interval, interior_snapshots
        self.max_model_len, self.eos = max_model_len, eos_token_ids
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        self.generated = 0  # tokens appended to sequences

    def schedule(self) -> list[Chunk]:
        budget, chunks, preempted = self.budget, [], False
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            n = self._chunk_size(seq, budget)
            if n == 0:
                continue
            while not self._reserve(seq, n):
                victim = self.running[-1]
                self.preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                chunks.append(Chunk(seq, n, self._exports(seq, n)))
                budget -= n
        while self.waiting and budget and not preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            group = seq.group
            need = group.request.params.n if not group.forked else 1
            if len(self.slots) < need or len(self.running) + need > self.max_num_seqs:
                break
            if not self._admit(seq, budget):
                break
            self.waiting.popleft()
            n = self._chunk_size(seq, budget)
            chunks.append(Chunk(seq, n, self._exports(seq, n)))
            budget -= n
        now = time.monotonic()
        for c in chunks:
            c.seq.group.first_scheduled = c.seq.group.first_scheduled or now
        return chunks

    def _chunk_size(self, seq: Sequence, budget: int) -> int:
        """All that is left if the budget allows; else a chunk that ends on the grid. A sequence off the grid
        (restored from an end snapshot, or cut short) first computes up to the next grid point."""
        start, left = seq.num_computed, seq.num_pending
        if left <= budget:
            return left
        if seq.draft is not None:  # a draft is verified whole or not at all
            seq.draft = None
            return self._chunk_size(seq, budget)
        if start % GRID:
            return min(GRID - start % GRID, budget)
        end = (start + budget) // GRID * GRID
        # a budget short of the next grid point cuts off it (never starve); the next chunk returns to the grid
        return end - start if end > start else budget

    def _exports(self, seq: Sequence, n: int) -> list[int]:
        """Offsets in this chunk after which the state is snapshot: the grid points on the snapshot interval,
        and the prompt's last grid point (the one its own retries and identical prompts will hit)."""
        if self.cache is None:
            return []
        start, end = seq.num_computed, seq.num_computed + n
        last = (seq.num_prompt - 1) // GRID * GRID
        want = [p for p in range((start // GRID + 1) * GRID, end + 1, GRID)
                if p % self.snapshot_interval == 0 or p == last]
        # inside a chunk only its own 64-token boundaries hold a state (all of them when it starts on the grid);
        # never past the committed tokens (a draft position's state is not kept)
        want = [p for p in want if (p == end or (self.interior_snapshots and (p - start) % GRID == 0))
                and p <= len(seq.tokens)]
        return [p - start for p in want]

    def _reserve(self, seq: Sequence, n: int) -> bool:
        """Allocate the blocks that positions [num_computed, num_computed + n) need."""
        need = -(-(seq.num_computed + n) // self.blocks.size) - len(seq.blocks)
        if need > len(self.blocks) and self.cache is not None:
            self.cache.evict(need_free_blocks=need)
        if need > len(self.blocks):
            return False
        seq.blocks.extend(self.blocks.allocate() for _ in range(need))
        return True

    def _admit(self, seq: Sequence, budget: int) -> bool:
        """Give a waiting sequence a slot, restore its longest cached prefix, reserve its first chunk."""
        group = seq.group
        hit = None
        use_cache = self.cache is not None
        if use_cache:
            hit = self.cache.lookup(group.root_key, seq.tokens, len(seq.tokens) - 1, seq.params.prompt_logprobs)
        slot = self.slots.allocate()
        if hit is not None:
            self.slots.load(slot, hit.state)
            p = len(hit.tokens)
            blocks = self.blocks.fork(hit.blocks, p)
            if blocks is None:  # the partial last block is copied: room for it first
                self.cache.evict(need_free_blocks=1)
                blocks = self.blocks.fork(hit.blocks, p)
            if blocks is None:
                self._release(seq, slot)
                return False
            seq.blocks, seq.num_computed = blocks, p
            if hit.logprobs is not None and seq.params.prompt_logprobs is not None:
                restore_prompt_logprobs(seq, hit.logprobs)
        seq.slot = slot
        n = self._chunk_size(seq, budget)
        if n == 0 or not self._reserve(seq, n):
            self._release(seq, slot)
            return False
        if not group.forked:  # n > 1: the other choices' slots are taken now, used when the prefill ends
            group.reserved = [self.slots.allocate() for _ in range(group.request.params.n - 1)]
        if use_cache and group.first_scheduled is None:
            self.cache.queries_tokens += seq.num_prompt
            group.cached_tokens = seq.num_computed
            self.cache.hit_tokens += seq.num_computed
        seq.status = Status.RUNNING
        self.running.append(seq)
        return True

    def _release(self, seq: Sequence, slot: int | None) -> None:
        for b in seq.blocks:
            self.blocks.unref(b)
        seq.blocks, seq.num_computed, seq.slot, seq.draft = [], 0, None, None
        if slot is not None:
            self.slots.release(slot)

    def _unreserve(self, group: RequestState) -> None:
        while group.reserved:
            self.slots.release(group.reserved.pop())

    def preempt(self, seq: Sequence, unreserve: bool = True) -> None:
        """Recompute later: free everything; the sequence goes back to the front of the queue."""
        self.running.remove(seq)
        self._release(seq, seq.slot)
        if unreserve:
            self._unreserve(seq.group)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def append(self, commits: list[tuple[Sequence, list[int], list[TokenLogprob | None]]]) -> list[RequestState]:
        """A step's committed tokens, each sequence's through `update` in order (one that finishes drops the rest):
        the requests that advanced, in order."""
        now = time.monotonic()
        advanced: dict[str, RequestState] = {}
        for seq, tokens, logprobs in commits:
            seq.group.first_token = seq.group.first_token or now
            for token, lp in zip(tokens, logprobs):
                self.update(seq, token, lp)
                self.generated += 1
                if seq.status is Status.FINISHED:  # a stop id, string or the length: the rest is dropped
                    break
            advanced[seq.group.request.request_id] = seq.group
        return list(advanced.values())

    def update(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> None:
        """Append a sampled token, then the stop checks in order: a stop id, a finished grammar, a stop string,
        the length. A sequence that stops leaves its end snapshot and gives back its slot and blocks."""
        p = seq.params
        seq.tokens.append(token)
        if p.logprobs is not None:
            seq.logprobs = seq.logprobs if seq.logprobs is not None else []
            seq.logprobs.append(logprob)
        if seq.constraint is not None:
            seq.constraint.accept(token)
        stop_id = token in p.stop_token_ids or (not p.ignore_eos and token in self.eos)
        if seq.text is not None and not stop_id:  # the stop id's own text is never shown
            seq.new_text += seq.text.push([token])
        if stop_id:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif seq.constraint is not None and seq.constraint.is_finished():
            seq.finish_reason = "stop"
        elif seq.text is not None and seq.text.hit is not None:
            seq.finish_reason, seq.stop_reason = "stop", seq.text.hit
        elif len(seq.tokens) - seq.num_prompt >= p.max_new_tokens or len(seq.tokens) >= self.max_model_len:
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            self.stop(seq, seq.finish_reason, seq.stop_reason)

    def stop(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """Finish a sequence that ended normally: snapshot its end state (prompt + output so far; the last
        sampled token is not computed yet) so a follow-up prompt starting with all of it hits, then free it."""
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        if seq.text is not None:
            seq.new_text += seq.text.flush()
        p = seq.num_computed
        # p > len(tokens): a verified draft ran past the token that stopped it; that state is no prefix's
        if self.cache is not None and 0 < p <= len(seq.tokens):
            blocks = seq.blocks[: -(-p // self.blocks.size)]
            self.cache.insert(seq.group.root_key, seq.tokens[:p], self.slots.save(seq.slot), blocks,
                              self.blocks.finite(blocks, p), prompt_logprobs_at(seq.group, p, seq.group.prompt_end_row))
        self.finish(seq)

    def fork(self, parent: Sequence, children: list[Sequence]) -> list[Sequence]:
        """n > 1: the other choices start from a copy of the parent's state (its KDA slot copied, its full MLA
        blocks shared, the partial last one copied on write). Those with no room recompute later; the running
        ones are returned."""
        out = []
        for child in children:
            child.slot = parent.group.reserved.pop()
            self.slots.copy(parent.slot, child.slot)
            parent.group.seqs.append(child)
            self.running.append(child)
            blocks = self.blocks.fork(parent.blocks, parent.num_computed)
            if blocks is None and self.cache is not None:
                self.cache.evict(need_free_blocks=1)
                blocks = self.blocks.fork(parent.blocks, parent.num_computed)
            if blocks is None:  # no room: this choice recomputes its prompt later
                self.preempt(child, unreserve=False)
                continue
            child.blocks = blocks
            out.append(child)
        return out

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq, seq.slot)
        self._unreserve(seq.group)
        seq.counts = None  # the sampler's vocabulary-wide rows: a finished choice of n > 1 waits for the others
        seq.status = Status.FINISHED

    def add(self, group: RequestState) -> None:
        self.waiting.extend(group.seqs)


def restore_prompt_logprobs(seq: Sequence, kept: PromptLogprobs) -> None:
    """A prompt_logprobs request restored from tokens[:p] reports positions 1..p as a cold prefill would: the
    entry's, then token p's from the entry's last row (positions it reported before a preemption stay)."""
    group, p = seq.group, len(kept.positions)
    have = group.prompt_logprobs or [None]
    if len(have) >= min(p + 1, seq.num_prompt):
        return
    token_p = token_logprobs(kept.next_row[None], [seq.tokens[p]], kept.k)
    group.prompt_logprobs = (have + list(kept.positions[len(have):]) + token_p)[: seq.num_prompt]
