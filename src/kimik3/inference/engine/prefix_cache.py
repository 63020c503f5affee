"""Prefix cache of hybrid-state snapshots, exact by construction.

An entry is the complete state after a token prefix: every KDA layer's recurrent state and conv tails (a
copy) and the MLA blocks holding the prefix's latents (shared, ref-counted). Entries exist only where the
forward produced the state: on the GRID (multiples of 64 tokens from the sequence start, the KDA chunk, so
a restore continues chunking on the cold run's grid) and at the end of a finished request (prompt + output,
so a chat's next turn hits all of the previous one). The rules that every peer has broken at least once:

- an entry is inserted only after its state was written, and only if it is finite (else it is counted);
- keys chain over the token ids from a root that hashes the model identity, dtype, the request's
  cache_salt, its media hashes and its LoRA adapter (under another adapter a prefix is another state); a
  hit also compares the stored tokens (no trust in the hash alone);
- a restore copies the snapshot into the sequence's own slot; a recurrent state is never rewound;
- one byte budget over snapshots and the MLA blocks they hold; LRU over entries that no deeper entry of
  the same chain extends (leaf first), so a long prefix's shallow parts go last.

A request for prompt logprobs hits only an entry that kept them (`PromptLogprobs`, the same top-k): a hit must
report the cached positions' logprobs too, and the first restored token's comes from the logits row before it.
"""

from __future__ import annotations

import hashlib
import itertools
import struct
from dataclasses import dataclass

import torch

from kimik3.inference.engine.config import GRID
from kimik3.inference.engine.pools import BlockPool
from kimik3.inference.engine.request import RequestState, TokenLogprob
from kimik3.model.state import SlotState


def root_key(model_id: str, dtype: torch.dtype, cache_salt: str | None, mm_hashes: tuple[str, ...],
             adapter: str = "") -> bytes:
    """Everything besides the token ids that changes the state (all media hashes go in the root: two
    prompts with different images share nothing, which is conservative and exact); `adapter` names the
    request's LoRA adapter ("" for the base)."""
    h = hashlib.sha256()
    for part in (model_id, str(dtype), "salt:" + (cache_salt or ""), "lora:" + adapter,
                 *("mm:" + m for m in mm_hashes)):
        h.update(part.encode() + b"\0")
    return h.digest()


def chain(parent: bytes, tokens: list[int] | tuple[int, ...], tag: bytes = b"") -> bytes:
    return hashlib.sha256(parent + tag + struct.pack(f"<{len(tokens)}q", *tokens)).digest()


def grid_keys(root: bytes, tokens: list[int], upto: int) -> list[bytes]:
    """keys[j] = the key of tokens[:GRID*j], for every grid position <= upto (keys[0] = root)."""
    keys = [root]
    for j in range(1, upto // GRID + 1):
        keys.append(chain(keys[-1], tokens[GRID * (j - 1): GRID * j]))
    return keys


@dataclass(frozen=True, eq=False)
class PromptLogprobs:
    """What an entry for prompt[:p] keeps of a prompt_logprobs request's output (V vocabulary)."""

    k: int  # the request's top-k per position
    positions: tuple[TokenLogprob | None, ...]  # positions 0..p-1 (the first None)
    next_row: torch.Tensor  # [V] fp32 log-softmax at position p-1: it scores a hitting prompt's token p


def prompt_logprobs_at(group: RequestState, p: int, row: torch.Tensor | None) -> PromptLogprobs | None:
    """The prompt logprobs an entry for group's tokens[:p] keeps, given `row` (the log-softmax at p-1); None
    when the request has none there (no prompt_logprobs, or p past the prompt)."""
    k, have = group.request.params.prompt_logprobs, group.prompt_logprobs
    if k is None or row is None or have is None or len(have) < p or p > len(group.request.prompt_ids):
        return None
    return PromptLogprobs(k, tuple(have[:p]), row.clone())


@dataclass(eq=False)
class Entry:
    key: bytes
    tokens: tuple[int, ...]  # the prefix itself: a hit compares it
    state: SlotState  # every KDA layer's recurrent state and conv tails, a copy
    blocks: list[int]  # MLA blocks of positions [0, len(tokens)), ref-held
    ancestors: list[bytes]  # grid keys of the shorter prefixes of this chain
    under: bytes | None  # an end entry: the grid key it hangs under
    nbytes: int
    last_used: int = 0
    children: int = 0  # deeper entries of the same chain (an entry with children is not evicted first)
    logprobs: PromptLogprobs | None = None


class PrefixCache:
    """Snapshots over `blocks`' pool within `budget_bytes` (None: 16 KDA snapshots plus a quarter of the MLA blocks)."""

    def __init__(self, blocks: BlockPool, budget_bytes: int | None = None, poison: bool = False):
        pool = blocks.pool
        if budget_bytes is None:
            budget_bytes = 16 * pool.slot_bytes + pool.num_blocks * pool.block_bytes // 4
        self.blocks, self.budget, self.block_bytes, self.poison = blocks, budget_bytes, pool.block_bytes, poison
        self.entries: dict[bytes, Entry] = {}
        self.ends: dict[bytes, list[bytes]] = {}  # grid key -> keys of end entries a little past it
        self.block_holds: dict[int, int] = {}  # block -> entries holding it
        self.snapshot_bytes = 0
        self.clock = itertools.count(1)
        self.nonfinite_refused = 0
        self.queries_tokens = 0
        self.hit_tokens = 0

    @property
    def nbytes(self) -> int:
        return self.snapshot_bytes + len(self.block_holds) * self.block_bytes

    def __contains__(self, key: bytes) -> bool:
        return key in self.entries

    def lookup(self, root: bytes, tokens: list[int], limit: int, logprobs_k: int | None = None) -> Entry | None:
        """The longest entry whose prefix is tokens[:p] with p <= limit (a hit leaves a token to compute); with
        `logprobs_k`, only among entries that kept prompt logprobs of that top-k."""
        def usable(e: Entry) -> bool:
            return logprobs_k is None or (e.logprobs is not None and e.logprobs.k == logprobs_k)

        keys = grid_keys(root, tokens, limit)
        for j in range(len(keys) - 1, -1, -1):
            ends = [self.entries[k] for k in self.ends.get(keys[j], ())]
            for e in sorted(ends, key=lambda e: -len(e.tokens)):
                if len(e.tokens) <= limit and e.tokens == tuple(tokens[: len(e.tokens)]) and usable(e):
                    return self._touch(e)
            e = self.entries.get(keys[j]) if j else None
            if e is not None and e.tokens == tuple(tokens[: GRID * j]) and usable(e):
                return self._touch(e)
        return None

    def _touch(self, e: Entry) -> Entry:
        e.last_used = next(self.clock)
        for k in e.ancestors:  # the shallower parts of a used chain are as recent
            if k in self.entries:
                self.entries[k].last_used = e.last_used
        return e

    def end_key(self, root: bytes, tokens: list[int]) -> tuple[bytes, bytes]:
        """(key, the grid key it hangs under) of an end entry for tokens (off the grid)."""
        keys = grid_keys(root, tokens, len(tokens))
        return chain(keys[-1], tokens[GRID * (len(keys) - 1):], b"end"), keys[-1]

    def insert(self, root: bytes, tokens: list[int], state: SlotState, blocks: list[int],
               finite_latents: torch.Tensor, logprobs: PromptLogprobs | None = None) -> bool:
        """Add the state after `tokens` (a copy the caller made; `blocks` get one more reference each), with
        the prompt logprobs of `tokens` when the request computed them. Refused (False) if it is not finite
        (counted: one host sync over the snapshot and the latents of `blocks`, given as a device bool), already
        present (an entry without prompt logprobs takes these: the same tokens, the same state), or larger
        than the whole budget."""
        p = len(tokens)
        keys = grid_keys(root, tokens, p)
        if p % GRID == 0:
            key, under = keys[-1], None
        else:
            key, under = self.end_key(root, tokens)
        if key in self.entries:
            old = self._touch(self.entries[key])
            if logprobs is not None and old.logprobs is None:
                old.logprobs = logprobs
                old.nbytes += logprobs.next_row.nbytes
                self.snapshot_bytes += logprobs.next_row.nbytes
                self.evict(0, keep=old)
            return False
        if not bool(finite_latents & state.finite()):
            self.nonfinite_refused += 1
            return False
        nbytes = state.nbytes + (logprobs.next_row.nbytes if logprobs is not None else 0)
        new_blocks = sum(1 for b in blocks if b not in self.block_holds)
        if nbytes + new_blocks * self.block_bytes > self.budget:
            return False
        ancestors = [k for k in keys[1:] if k != key]
        e = Entry(key, tuple(tokens), state, list(blocks), ancestors, under, nbytes, next(self.clock),
                  logprobs=logprobs)
        self.entries[key] = e
        if under is not None:
            self.ends.setdefault(under, []).append(key)
        for k in ancestors:
            if k in self.entries:
                self.entries[k].children += 1
        for b in blocks:
            self.blocks.ref(b)
            self.block_holds[b] = self.block_holds.get(b, 0) + 1
        self.snapshot_bytes += nbytes
        self.evict(0, keep=e)
        return True

    def insert_exports(self, chunks: list, exports: list[tuple[torch.Tensor, ...]],
                       prompt_rows: dict[int, torch.Tensor]) -> None:
        """Insert the states a step's forward exported (scheduler `Chunk`s, each with its snapshot offsets; per KDA
        layer (recurrent [E, H, K, V], conv q, k, v [E, W-1, P]), one entry per (chunk, offset) in that order),
        each with the prompt logprobs up to it (`prompt_rows`: by sequence id, the chunk's prompt log-softmax rows).
        Called before the step advances the sequences' num_computed."""
        recurrent = torch.stack([layer[0] for layer in exports])  # [Lk, E, H, K, V]
        conv = torch.stack([torch.stack(layer[1:]) for layer in exports])  # [Lk, 3, E, W-1, P]
        e = 0
        for c in chunks:
            seq = c.seq
            lp = prompt_rows.get(id(seq))
            for off in c.exports:
                p = seq.num_computed + off
                state = SlotState(recurrent[:, e].clone(), conv[:, :, e].clone())
                e += 1
                blocks = seq.blocks[: p // self.blocks.size]
                row = p - 1 - seq.num_computed
                kept = prompt_logprobs_at(seq.group, p, lp[row] if lp is not None and row < lp.shape[0] else None)
                self.insert(seq.group.root_key, seq.tokens[:p], state, blocks, self.blocks.finite(blocks, p), kept)

    def evict(self, need_bytes: int = 0, keep: Entry | None = None, need_free_blocks: int = 0) -> bool:
        """Evict LRU leaf entries until the cache fits its budget less `need_bytes` and the block pool has
        `need_free_blocks` free blocks. Returns whether that was reached."""
        def done() -> bool:
            return self.nbytes + need_bytes <= self.budget and len(self.blocks) >= need_free_blocks

        while not done():
            leaves = [e for e in self.entries.values() if e.children == 0 and e is not keep]
            if not leaves:
                return False
            self._remove(min(leaves, key=lambda e: e.last_used))
        return True

    def _remove(self, e: Entry) -> None:
        del self.entries[e.key]
        if e.under is not None:
            self.ends[e.under].remove(e.key)
            if not self.ends[e.under]:
                del self.ends[e.under]
        for k in e.ancestors:
            if k in self.entries:
                self.entries[k].children -= 1
        for b in e.blocks:
            self.block_holds[b] -= 1
            if not self.block_holds[b]:
                del self.block_holds[b]
            self.blocks.unref(b)
        if self.poison:
            e.state.recurrent.fill_(float("nan"))
            e.state.conv.fill_(float("nan"))
        self.snapshot_bytes -= e.nbytes

    def reset(self) -> None:
        """Flush: drop every entry (the cure for anything suspect; running sequences keep their blocks)."""
        for e in list(self.entries.values()):
            self._remove(e)
