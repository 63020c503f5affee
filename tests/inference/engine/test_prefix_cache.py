"""Prefix reuse of the hybrid state: exact, and only where the forward wrote the state."""

from __future__ import annotations

import pytest
import torch

from kimik3.inference import SamplingParams
from kimik3.inference.engine import Request
from kimik3.inference.engine.request import accumulate
from tests.helpers import rel_err
from tests.inference.engine.conftest import full_logprobs, greedy, make_engine, random_prompts, reference_tokens


def run_one(engine, rid, prompt, params):
    engine.add_request(Request(rid, prompt, params))
    outs = {}
    while engine.has_unfinished():
        accumulate(outs, engine.step())
    return outs[rid]


@pytest.mark.parametrize("shared", [63, 64, 65, 127, 128, 129])  # the 64-token grid and MLA's 128-token switch
def test_shared_prefix_hits_on_the_grid(model, shared):
    V = model.config.vocab_size
    base, tail_a, tail_b = random_prompts(V, (shared, 9, 11), generator_seed=shared)
    a, b = base + tail_a, base + tail_b
    params = greedy(5, logprobs=1)
    engine = make_engine(model)
    out_a = run_one(engine, "a", a, params)
    out_b = run_one(engine, "b", b, params)
    assert out_a.cached_tokens == 0
    assert out_b.cached_tokens == shared // 64 * 64
    for prompt, out in ((a, out_a), (b, out_b)):
        assert out.outputs[0].token_ids == reference_tokens(model, [prompt], params)[0]
        ref = full_logprobs(model, prompt, out.outputs[0].token_ids)
        got = torch.tensor([lp.logprob for lp in out.outputs[0].logprobs])
        assert rel_err(got, ref.gather(1, torch.tensor(out.outputs[0].token_ids)[:, None])[:, 0]) < 1e-5
    assert engine.stats["prefix_hit_tokens"] == shared // 64 * 64


def test_a_b_a_interleaving_with_a_three_snapshot_budget(model):
    """20 rounds of A then B (a shared 64-token head, then different): eviction churns every round; every
    answer stays the cold one (evicted snapshots and freed rows are NaN, so a stale read would show)."""
    V = model.config.vocab_size
    head, ta, tb = random_prompts(V, (64, 80, 75), generator_seed=7)
    a, b = head + ta, head + tb
    params = greedy(3)
    want = reference_tokens(model, [a, b], params)
    probe = make_engine(model)
    budget = 3 * probe.pool.slot_bytes + 16 * probe.pool.block_bytes
    engine = make_engine(model, prefix_cache_bytes=budget)
    hits = 0
    for r in range(20):
        for name, prompt, ref in (("a", a, want[0]), ("b", b, want[1])):
            out = run_one(engine, f"{name}{r}", prompt, params)
            assert out.outputs[0].token_ids == ref, (r, name)
            hits += out.cached_tokens > 0
            assert engine.prefix.nbytes <= budget
    assert hits >= 20  # the budget still lets most turns hit something
    assert engine.stats["kda_snapshots"] <= 3


def test_eight_concurrent_cold_prefills_of_one_prefix(model):
    V = model.config.vocab_size
    head = random_prompts(V, (150,), generator_seed=8)[0]
    tails = random_prompts(V, [3 + i for i in range(8)], generator_seed=9)
    prompts = [head + t for t in tails]
    params = greedy(4)
    engine = make_engine(model, max_num_batched_tokens=256)
    outs = engine.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == reference_tokens(model, prompts, params)
    again = engine.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]
    assert all(o.cached_tokens == 128 for o in again)


def test_n3_forks_one_prefilled_state(model):
    prompt = random_prompts(model.config.vocab_size, (90,), generator_seed=10)[0]
    engine = make_engine(model)
    sampled = SamplingParams(temperature=1.0, seed=123, max_new_tokens=6, n=3)
    out = engine.generate([prompt], sampled)[0]
    assert [s.index for s in out.outputs] == [0, 1, 2]
    # choice i samples exactly as a lone request seeded seed + i (its state is a copy of the one prefill)
    for i, choice in enumerate(out.outputs):
        alone = make_engine(model, enable_prefix_cache=False).generate(
            [prompt], SamplingParams(temperature=1.0, seed=123 + i, max_new_tokens=6))[0]
        assert choice.token_ids == alone.outputs[0].token_ids
    assert len({tuple(s.token_ids) for s in out.outputs}) > 1
    g = engine.generate([prompt], greedy(6, n=3))[0]
    assert [s.token_ids for s in g.outputs] == reference_tokens(model, [prompt], greedy(6)) * 3
    assert len(engine.slots) == engine.pool.num_slots


def test_second_turn_hits_the_first_turns_end(model):
    V = model.config.vocab_size
    turn1, user2 = random_prompts(V, (70, 12), generator_seed=11)
    params = greedy(9)
    engine = make_engine(model)
    out1 = run_one(engine, "t1", turn1, params)
    turn2 = turn1 + out1.outputs[0].token_ids + user2
    out2 = run_one(engine, "t2", turn2, params)
    # the end snapshot holds prompt + output but the last sampled token (never fed to the model)
    assert out2.cached_tokens == len(turn1) + len(out1.outputs[0].token_ids) - 1
    assert out2.outputs[0].token_ids == reference_tokens(model, [turn2], params)[0]


def test_restored_then_continued_equals_cold_bitwise(model):
    """A warm request (restored on the grid, chunked on the same grid) computes exactly the cold one's numbers."""
    prompt = random_prompts(model.config.vocab_size, (150,), generator_seed=12)[0]
    params = greedy(6, logprobs=4)
    engine = make_engine(model, max_num_batched_tokens=64)
    cold = run_one(engine, "cold", prompt, params)
    warm = run_one(engine, "warm", prompt, params)
    assert cold.cached_tokens == 0 and warm.cached_tokens == 128
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    assert [(lp.logprob, lp.top) for lp in warm.outputs[0].logprobs] == \
        [(lp.logprob, lp.top) for lp in cold.outputs[0].logprobs]


def test_non_finite_state_is_refused(model):
    V = model.config.vocab_size
    prompt = random_prompts(V, (100,), generator_seed=13)[0]
    engine = make_engine(model)
    engine.add_request(Request("bad", prompt, greedy(4)))
    outs = {}
    accumulate(outs, engine.step())  # the prefill: its grid snapshot at 64 is taken (finite)
    seq = engine.requests["bad"].seqs[0]
    engine.pool.recurrent[0, seq.slot].fill_(float("inf"))  # poison the running state on purpose
    while engine.has_unfinished():
        accumulate(outs, engine.step())
    assert engine.stats["nonfinite_refused"] >= 1
    full = prompt + outs["bad"].outputs[0].token_ids
    follow = run_one(engine, "next", full + [1, 2], greedy(3))
    assert follow.cached_tokens == 64  # the clean grid snapshot, never the poisoned end state
    assert follow.outputs[0].token_ids == reference_tokens(model, [full + [1, 2]], greedy(3))[0]


def test_salt_and_flush_isolate(model):
    prompt = random_prompts(model.config.vocab_size, (100,), generator_seed=14)[0]
    engine = make_engine(model)
    engine.generate([prompt], greedy(2))
    salted = Request("s", prompt, greedy(2), cache_salt="tenant-b")
    engine.add_request(salted)
    while engine.has_unfinished():
        out = engine.step()
    assert out[0].cached_tokens == 0
    assert engine.generate([prompt], greedy(2))[0].cached_tokens == 64
    engine.reset_prefix_cache()
    assert engine.stats["kda_snapshots"] == 0 and engine.prefix.nbytes == 0
    assert engine.generate([prompt], greedy(2))[0].cached_tokens == 0


def test_long_turn_after_an_end_snapshot_returns_to_the_grid(model):
    """Restored off the grid (an end snapshot at 79), a 300-token continuation is chunked back onto the grid:
    its grid snapshots are exported on the way and a third turn hits them."""
    V = model.config.vocab_size
    turn1, user2, user3 = random_prompts(V, (70, 300, 5), generator_seed=15)
    params = greedy(10)
    engine = make_engine(model, max_num_batched_tokens=256)
    out1 = run_one(engine, "t1", turn1, params)
    turn2 = turn1 + out1.outputs[0].token_ids + user2
    out2 = run_one(engine, "t2", turn2, params)
    assert out2.cached_tokens == 79
    assert out2.outputs[0].token_ids == reference_tokens(model, [turn2], params)[0]
    turn3 = turn2[:320] + user3
    out3 = run_one(engine, "t3", turn3, greedy(4))
    assert out3.cached_tokens == 320
    assert out3.outputs[0].token_ids == reference_tokens(model, [turn3], greedy(4))[0]


def prompt_lps(out) -> list:
    return [(e.token_id, e.logprob, e.top) for e in out.prompt_logprobs[1:]]


@torch.no_grad()
def assert_prompt_logprobs_are_a_full_forwards(model, prompt, out, k):
    lp = out.prompt_logprobs
    assert lp[0] is None and len(lp) == len(prompt)
    ref = model(torch.tensor([prompt]))[0, :-1].float().log_softmax(-1)
    got = torch.tensor([e.logprob for e in lp[1:]])
    assert rel_err(got, ref.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]) < 1e-5
    assert [[i for i, _ in e.top] for e in lp[1:]] == ref.topk(k, dim=-1).indices.tolist()


def test_prompt_logprobs_hit_reports_the_cached_positions(model):
    """A prompt_logprobs request hits the entries an earlier one left (a grid point, an end) and still reports
    every prompt position: the cached ones kept with the entry, the first restored token's from its kept row."""
    V = model.config.vocab_size
    base, ta, tb, tc = random_prompts(V, (130, 20, 9, 7), generator_seed=16)
    a, b = base + ta, base + tb
    c = a + tc  # a whole as its context: the end snapshot of a
    params = greedy(1, prompt_logprobs=2)
    engine = make_engine(model)
    outs = [run_one(engine, name, prompt, params) for name, prompt in (("a", a), ("b", b), ("c", c))]
    assert [o.cached_tokens for o in outs] == [0, 128, len(a)]
    for prompt, out in zip((a, b, c), outs):
        assert_prompt_logprobs_are_a_full_forwards(model, prompt, out, 2)
    # restored on the grid, b is chunked as a cold b is: the same numbers bit for bit
    assert prompt_lps(outs[1]) == prompt_lps(run_one(make_engine(model), "cold", b, params))


def test_prompt_logprobs_hit_only_entries_that_kept_them(model):
    """Entries of a request without prompt logprobs (or of another top-k) are misses for one that wants them;
    a prompt_logprobs run over the same prefix gives such an entry its logprobs, and the next one hits."""
    V = model.config.vocab_size
    prompt, tail = random_prompts(V, (100, 5), generator_seed=17)
    k2 = greedy(1, prompt_logprobs=2)
    engine = make_engine(model)
    run_one(engine, "plain", prompt, greedy(2))
    miss = run_one(engine, "miss", prompt + tail, k2)
    assert miss.cached_tokens == 0 and engine.stats["prefix_hit_tokens"] == 0
    hit = run_one(engine, "hit", prompt + tail[:3], k2)
    assert hit.cached_tokens == 64
    assert_prompt_logprobs_are_a_full_forwards(model, prompt + tail[:3], hit, 2)
    assert run_one(engine, "k1", prompt + tail[:3], greedy(1, prompt_logprobs=1)).cached_tokens == 0
    # a request without prompt logprobs hits any entry: here the end of "hit"
    assert run_one(engine, "plain2", prompt + tail, greedy(1)).cached_tokens == 103
