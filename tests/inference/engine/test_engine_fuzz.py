"""Random scenarios: block sizes, budgets, tight pools (preemption), shared heads (hits), n > 1, small cache
budgets (eviction), requests arriving at random steps. Every choice must be the greedy answer of full forwards
without a cache. One scenario runs by default (hits and preemptions both); the other two under `-m slow`."""

from __future__ import annotations

import random

import pytest

from kimik3.inference import SamplingParams
from kimik3.inference.engine import Engine, EngineConfig, Request
from kimik3.inference.engine.request import accumulate
from tests.inference.engine.conftest import reference_tokens


# measured: hits in 510 and 913, preemptions in 913 and 1010
@pytest.mark.parametrize("seed", [913, pytest.param(510, marks=pytest.mark.slow),
                                  pytest.param(1010, marks=pytest.mark.slow)])
def test_random_scenarios_equal_full_forwards(model, seed):
    rng = random.Random(seed)
    bs, budget, nseq = rng.choice([8, 16, 32, 64]), rng.choice([64, 96, 128, 200]), rng.choice([2, 4, 8])
    heads = [[rng.randrange(300) for _ in range(rng.randint(60, 200))] for _ in range(2)]
    reqs = [(rng.choice(heads)[: rng.randint(1, 200)] + [rng.randrange(300) for _ in range(rng.randint(0, 30))],
             rng.randint(1, 10), rng.choice([1, 2, 3][:nseq])) for _ in range(8)]
    need = max(-(-(len(p) + n) // bs) for p, n, _ in reqs)
    probe = Engine(model, EngineConfig(max_num_seqs=1, max_model_len=512, block_size=bs, num_blocks=1))
    engine = Engine(model, EngineConfig(max_num_seqs=nseq, max_num_batched_tokens=budget, max_model_len=512,
                                        block_size=bs, num_blocks=max(need + 1, 12 * 16 // bs), snapshot_interval=64,
                                        poison=True,
                                        prefix_cache_bytes=3 * probe.pool.slot_bytes + 24 * probe.pool.block_bytes))
    pending, outs = list(enumerate(reqs)), {}
    while pending or engine.has_unfinished():
        if pending and rng.random() < 0.5:
            i, (p, n, k) = pending.pop(0)
            engine.add_request(Request(str(i), p, SamplingParams(temperature=0, max_new_tokens=n, n=k)))
        accumulate(outs, engine.step())
    for i, (p, n, k) in enumerate(reqs):
        want = reference_tokens(model, [p], SamplingParams(temperature=0, max_new_tokens=n))[0]
        assert [c.token_ids for c in outs[str(i)].outputs] == [want] * k, i
    assert len(engine.slots) == engine.pool.num_slots
    assert engine.prefix.nbytes <= engine.prefix.budget
