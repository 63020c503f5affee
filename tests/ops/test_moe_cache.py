"""The expert cache's policy (`kimik3.ops.moe.cache`): counting, admission, victims, warm starts, and its hit rate on
skewed (Zipf) routing against the best static placement."""

from __future__ import annotations

import numpy as np
import pytest

from kimik3.ops.moe.cache import ExpertCache


def _step(cache: ExpertCache, idx: np.ndarray) -> tuple[int, int]:
    """One step as a tiered layer runs it with every miss copied: count, then admit what qualifies."""
    experts, counts = np.unique(idx, return_counts=True)
    hits, misses = cache.observe(experts, counts)
    for e, s in cache.admissions(experts[cache.slot_of[experts] < 0], busy=experts):
        cache.place(e, s)
    return hits, misses


def zipf_trace(E: int, steps: int, k: int, s: float, phase: int, seed: int) -> list[np.ndarray]:
    """Per step one token's k distinct experts drawn from a Zipf(s) popularity over a random ranking of the E
    experts; the ranking is redrawn every `phase` steps (0: never)."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, E + 1) ** s
    p /= p.sum()
    perm, out = rng.permutation(E), []
    for t in range(steps):
        if phase and t % phase == 0:
            perm = rng.permutation(E)
        out.append(perm[rng.choice(E, k, replace=False, p=p)][None])
    return out


def best_static(trace: list[np.ndarray], E: int, S: int) -> float:
    """The hit rate of the S experts the trace used most, placed for its whole length (chosen in hindsight)."""
    counts = np.bincount(np.concatenate([x.ravel() for x in trace]), minlength=E)
    return counts[np.argsort(-counts)[:S]].sum() / counts.sum()


def hit_rate(cache: ExpertCache, trace: list[np.ndarray]) -> float:
    h = m = 0
    for idx in trace:
        a, b = _step(cache, idx)
        h, m = h + a, m + b
    return h / (h + m)


def test_counts_hits_and_misses_and_fills_empty_slots_first():
    c = ExpertCache(8, 2)
    assert _step(c, np.array([[3, 5], [3, 1]])) == (0, 4)
    assert c.expert_in.tolist() == [3, 1]  # the most used first, then ties by id
    assert c.freq[3] == 2 and c.last[3] == 0 and c.step == 1


def test_admission_needs_ratio_and_margin_and_spares_the_step_s_own_experts():
    c = ExpertCache(6, 1, decay=1.0, ratio=2.0, margin=1.0)
    c.place(0, 0)
    c.freq[:] = [3, 7, 7.5, 0, 0, 0]
    assert c.admissions(np.array([1]), busy=np.array([1])) == []  # 7 <= 2 * 3 + 1
    assert c.admissions(np.array([2]), busy=np.array([2])) == [(2, 0)]  # 7.5 > 7
    assert c.admissions(np.array([2]), busy=np.array([0, 2])) == []  # expert 0 is read by this step


def test_victim_is_the_coldest_then_least_recently_used():
    c = ExpertCache(5, 2, decay=1.0, ratio=1.0, margin=0.0)
    c.place(0, 0), c.place(1, 1)
    c.freq[:] = [2, 2, 9, 0, 0]
    c.last[:] = [5, 3, 0, 0, 0]
    assert c.admissions(np.array([2]), busy=np.array([2])) == [(2, 1)]  # tie at 2: expert 1 was used earlier
    c.place(2, 1)
    assert c.slot_of[1] == -1 and c.expert_in.tolist() == [0, 2]


def test_state_round_trip_and_warm_start():
    c = ExpertCache(16, 4)
    for idx in zipf_trace(16, 50, 3, 1.2, 0, seed=1):
        _step(c, idx)
    warm = ExpertCache(16, 4)
    warm.load_state(c.state())
    assert np.array_equal(warm.freq, c.freq) and np.array_equal(warm.last, c.last) and warm.step == c.step
    assert set(warm.hottest().tolist()) == set(np.argsort(-c.freq, kind="stable")[:4].tolist())
    with pytest.raises(ValueError, match="15 experts in the trace, the layer has 16"):
        warm.load_state({"freq": [0.0] * 15})


def test_bad_slot_counts_are_refused():
    with pytest.raises(ValueError, match="9 slots for 8 experts"):
        ExpertCache(8, 9)


@pytest.mark.parametrize("seed", range(3))
def test_zipf_routing_keeps_the_best_static_hit_rate(seed):
    """Stationary Zipf routing, warm start from a first run's counts: the cache's hit rate on the second run is that
    of the S most used experts chosen in hindsight (within 1%; it measured 0.998-1.0 of it)."""
    E, S = 64, 8
    trace = zipf_trace(E, 2000, 4, 1.1, 0, seed)
    c = ExpertCache(E, S)
    hit_rate(c, trace[:1000])
    warm = ExpertCache(E, S)
    warm.load_state(c.state())
    for s, e in enumerate(warm.hottest()):
        warm.place(int(e), s)
    second = trace[1000:]
    assert hit_rate(warm, second) >= 0.99 * best_static(second, E, S)


@pytest.mark.parametrize("seed", range(3))
def test_zipf_routing_that_drifts_beats_every_static_placement(seed):
    """The popular experts change every 200 steps: counted routing follows them, from a cold start, and beats the
    best static placement (chosen in hindsight) by more than 10%."""
    E, S = 64, 8
    trace = zipf_trace(E, 1000, 4, 1.1, 200, seed)
    assert hit_rate(ExpertCache(E, S), trace) > 1.1 * best_static(trace, E, S)
