"""Which routed experts of one MoE layer sit in the device's cache slots: counted routing decides.

Legend: E experts of the layer, S cache slots (S < E), t the step (one call of the layer).

    freq[e]   uses of expert e, each step's count added after the old ones decay by `decay` (an exponential
              moving sum: a burst fades in about 1 / (1 - decay) steps)
    last[e]   the step expert e was last used (ties of freq go to the least recently used: LRU within frequency)
    victim    the resident expert with the lowest (freq, last), never one the current step uses
    admit     an expert that missed enters a slot only when its freq exceeds `ratio` times the victim's plus `margin`
              (a one-off use does not evict a regular, noise does not churn the slots): the cache converges to the
              most-used experts, and follows them as they change

On Zipf-distributed routing (tests/ops/test_moe_cache.py) this keeps the hit rate of the best static placement
(chosen in hindsight) from a warm start, and beats it by ~1.2x when the popular experts change every 200 steps;
ratio 2 and decay 0.99 were picked on those traces (a smaller ratio churns on noise, a slower decay follows
change late).

The state is host-side numpy (E floats a layer), read and written once per step. `state()` / `load_state()` give it
as plain lists, what a routing trace saves so that a restart starts warm (`kimik3.placement.save_trace`).
"""

from __future__ import annotations

import numpy as np

DECAY = 0.99
RATIO = 2.0
MARGIN = 1.0


class ExpertCache:
    def __init__(self, num_experts: int, num_slots: int, decay: float = DECAY, ratio: float = RATIO,
                 margin: float = MARGIN):
        if not 0 <= num_slots <= num_experts:
            raise ValueError(f"expert cache: {num_slots} slots for {num_experts} experts")
        self.num_experts, self.num_slots = num_experts, num_slots
        self.decay, self.ratio, self.margin = decay, ratio, margin
        self.slot_of = np.full(num_experts, -1, dtype=np.int64)  # the slot holding expert e, or -1
        self.expert_in = np.full(num_slots, -1, dtype=np.int64)  # the expert in slot s, or -1 (empty)
        self.freq = np.zeros(num_experts, dtype=np.float64)
        self.last = np.full(num_experts, -1, dtype=np.int64)
        self.step = 0
        self.hits = self.misses = 0  # routed (token, expert) pairs served from a slot / not

    def observe(self, experts: np.ndarray, counts: np.ndarray) -> tuple[int, int]:
        """Count one step's use: `experts` [U] distinct expert ids, `counts` [U] how many routed rows each.
        Returns (hits, misses): the step's routed rows whose expert is / is not in a slot."""
        self.freq *= self.decay
        self.freq[experts] += counts
        self.last[experts] = self.step
        resident = self.slot_of[experts] >= 0
        hits, misses = int(counts[resident].sum()), int(counts[~resident].sum())
        self.hits += hits
        self.misses += misses
        self.step += 1
        return hits, misses

    def _rank(self, experts: np.ndarray) -> np.ndarray:
        """`experts` ordered coldest first: by freq, then least recently used."""
        return experts[np.lexsort((self.last[experts], self.freq[experts]))]

    def admissions(self, missed: np.ndarray, busy: np.ndarray, limit: int | None = None) -> list[tuple[int, int]]:
        """(expert, slot) pairs for the experts of `missed` worth a slot: each takes an empty slot, or the slot of
        the coldest resident expert not in `busy` (experts the current step still reads) when it is hotter by
        `ratio` and `margin`. At most `limit` pairs (None: as many as qualify). The caller copies, then `place`s."""
        if self.num_slots == 0 or len(missed) == 0:
            return []
        hot = missed[np.argsort(-self.freq[missed], kind="stable")]
        empty = list(np.flatnonzero(self.expert_in < 0))
        occupied = self.expert_in[self.expert_in >= 0]
        victims = list(self._rank(occupied[~np.isin(occupied, busy)]))
        out = []
        for e in hot:
            if limit is not None and len(out) >= limit:
                break
            if empty:
                out.append((int(e), int(empty.pop(0))))
            elif victims and self.freq[e] > self.ratio * self.freq[victims[0]] + self.margin:
                out.append((int(e), int(self.slot_of[victims.pop(0)])))
            else:
                break  # the rest are colder still
        return out

    def place(self, expert: int, slot: int) -> None:
        """Expert `expert` now lives in `slot` (whatever was there is out)."""
        old = self.expert_in[slot]
        if old >= 0:
            self.slot_of[old] = -1
        self.expert_in[slot] = expert
        self.slot_of[expert] = slot

    def hottest(self) -> np.ndarray:
        """The experts a warm start puts in the slots: the S most used (ties: lower id first)."""
        return np.argsort(-self.freq, kind="stable")[:self.num_slots]

    def state(self) -> dict:
        return {"freq": self.freq.tolist(), "last": self.last.tolist(), "step": self.step}

    def load_state(self, state: dict) -> None:
        freq = np.asarray(state["freq"], dtype=np.float64)
        if freq.shape != (self.num_experts,):
            raise ValueError(f"expert trace: {freq.shape[0]} experts in the trace, the layer has {self.num_experts}")
        self.freq = freq
        self.last = np.asarray(state.get("last", [-1] * self.num_experts), dtype=np.int64)
        self.step = int(state.get("step", 0))
