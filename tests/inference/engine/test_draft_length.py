"""The engine picking its own k (draft_length.py): the choice against costs and acceptance given by hand, the cost
table's measuring and learning; then in the engine, on the tiny random model with an oracle proposer: the tokens
of the run without speculation whatever it picks, the ceiling where every draft is kept and verification is cheap,
no drafts (but the probes) where none is kept, and seeded samples that do not depend on what it picks."""

from __future__ import annotations

import pytest

from kimik3.inference.engine import SpeculativeConfig
from kimik3.inference.engine.draft_length import (
    PROBE_EVERY,
    PROPOSER_RATE,
    DraftLength,
    Row,
    StepCosts,
    draft_lengths,
)
from kimik3.inference.sampling import SamplingParams
from kimik3.inference.spec.oracle import OracleProposer, expected_accepted_length
from tests.inference.engine.conftest import greedy, make_engine, random_prompts


def test_draft_lengths_are_powers_of_two_rows_up_to_half_the_ceiling_and_the_ceiling():
    assert draft_lengths(1) == (1,)
    assert draft_lengths(2) == (1, 2)
    assert draft_lengths(3) == (1, 3)
    assert draft_lengths(4) == (1, 4)  # the default ceiling: graphs of 2 and 5 tokens a row
    assert draft_lengths(6) == (1, 3, 6)
    assert draft_lengths(7) == (1, 3, 7)
    assert draft_lengths(8) == (1, 3, 8)
    assert draft_lengths(16) == (1, 3, 7, 16)


def test_expected_tokens_is_the_geometric_sum():
    assert expected_accepted_length(0.0, 7) == 1.0
    assert expected_accepted_length(1.0, 3) == 4.0
    assert expected_accepted_length(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    # the simulated law: k drafts, each kept with probability a once those before were
    import random

    rng, a, k, n = random.Random(0), 0.7, 5, 40_000
    total = 0
    for _ in range(n):
        kept = 0
        while kept < k and rng.random() < a:
            kept += 1
        total += kept + 1
    assert total / n == pytest.approx(expected_accepted_length(a, k), rel=0.01)


def costs_of(table: dict[int, float], buckets=(1, 2, 4, 8)) -> StepCosts:
    """A StepCosts whose every bucket costs `table` {k: seconds}, counting its measurements."""
    c = StepCosts(lambda b: (calls.append(b), dict(table))[1], list(buckets))
    calls: list[int] = []
    c.calls = calls
    return c


def policy(ceiling: int, table: dict[int, float], **kw) -> DraftLength:
    p = DraftLength(ceiling, **kw)
    p.costs = costs_of(table)
    return p


def train(p: DraftLength, seq_id: int, drafted: int, accepted: int, times: int) -> None:
    for _ in range(times):
        p.record(seq_id, drafted, accepted)


def test_choice_follows_acceptance_against_cost():
    # slice-12's batch-1 costs (ms): decode 7.9, k=3 12.0, k=7 16.0 (docs/speculative.md); k=1 by interpolation
    table = {0: 7.9, 1: 9.9, 3: 12.0, 7: 16.0}
    every = policy(7, table)
    train(every, 0, 7, 7, 20)  # every draft kept
    assert every.choose([Row(0, 7)], batch=1) == 7
    none = policy(7, table)
    train(none, 0, 7, 0, 20)  # none kept
    assert none.choose([Row(0, 7)], batch=1) == 0
    # a rate of 0.8: 1 + .8 + .64 + .512 = 2.95 tokens in 12 ms beat 3.86 in 16 ms and 1 in 7.9
    mid = policy(7, table)
    train(mid, 0, 3, 3, 4)
    train(mid, 0, 7, 2, 2)
    a, _ = mid.rate(0)
    values = {k: expected_accepted_length(a, k) / table[k] for k in table}
    assert mid.choose([Row(0, 7)], batch=1) == max(values, key=values.get)
    # the length limits cap a row: with 2 drafts left, k = 7 buys nothing over k = 3
    assert every.choose([Row(0, 2)], batch=1) == 3


def test_decoding_rows_beside_count_and_dear_verification_turns_it_off():
    table = {0: 10.0, 1: 11.0, 3: 13.0, 7: 18.0}
    p = policy(7, table)
    train(p, 0, 7, 7, 20)
    assert p.choose([Row(0, 7)], batch=1) == 7
    # 63 rows that cannot draft decode beside it: one sequence's extra tokens no longer pay for the wider step
    assert p.choose([Row(0, 7)], batch=64) == 0
    # a verification that costs more than its tokens
    q = policy(7, {0: 10.0, 1: 30.0, 3: 50.0, 7: 90.0})
    train(q, 0, 7, 7, 20)
    assert q.choose([Row(0, 7)], batch=1) == 0
    # a proposer slower than what its drafts save
    train(p, 0, 7, 7, 20)
    p.costs.proposed(1, 100.0)
    assert p.choose([Row(0, 7)], batch=1) == 0


def test_off_it_probes_and_turns_back_on():
    p = policy(7, {0: 7.9, 1: 9.9, 3: 12.0, 7: 16.0})
    train(p, 0, 7, 0, 20)
    ks = [p.choose([Row(0, 7)], batch=1) for _ in range(3 * PROBE_EVERY)]
    assert ks.count(1) == 3 and set(ks) == {0, 1}  # one cheap probe every PROBE_EVERY steps
    assert ks.index(1) == PROBE_EVERY - 1
    train(p, 0, 7, 7, 30)  # acceptance came back (the probes' drafts are kept): drafting resumes
    assert p.choose([Row(0, 7)], batch=1) == 7


def test_a_sequence_without_history_starts_from_the_engines_rate():
    p = policy(7, {0: 7.9, 1: 9.9, 3: 12.0, 7: 16.0})
    train(p, 0, 7, 7, 20)
    assert p.rate(1)[0] > 0.8  # a new sequence: the engine's rate, not the prior of 0.5
    assert p.choose([Row(1, 7)], batch=1) == 7
    p.finish(0)
    assert 0 not in p.seqs


def test_a_proposer_that_rarely_drafts_counts_as_such():
    table = {0: 10.0, 1: 13.0, 3: 16.0, 7: 20.0}
    p = policy(7, table)
    train(p, 0, 7, 7, 20)
    assert p.choose([Row(0, 7)], batch=1) == 7
    train(p, 0, 0, 0, 60)  # asked, no draft (suffix decoding without a match)
    assert p.rate(0)[0] > 0.8 and p.rate(0)[1] < 0.1  # kept when there, but seldom there
    assert p.choose([Row(0, 7)], batch=1) == 0


def test_seeded_rows_keep_the_ceiling_and_fixed_mode_always_drafts_it():
    p = policy(7, {0: 7.9, 1: 9.9, 3: 12.0, 7: 16.0})
    train(p, 0, 7, 0, 20)
    assert p.choose([Row(0, 7)], batch=2) == 0
    assert p.choose([Row(0, 7), Row(1, 7, fixed=True)], batch=2) == 7
    fixed = DraftLength(5, adaptive=False)
    assert fixed.lengths == (5,)
    train(fixed, 0, 5, 0, 20)
    assert fixed.choose([Row(0, 5)], batch=1) == 5
    assert fixed.choose([], batch=1) == 0  # nothing can draft: a decode step


def test_step_costs_measure_each_bucket_once_and_add_the_proposers_time():
    c = costs_of({0: 10.0, 1: 12.0, 3: 14.0, 7: 20.0})
    assert c(3, 0) == 10.0 and c(4, 7) == 20.0 and c.calls == [4]  # 3 rows run in the 4-row bucket
    assert c(100, 1) == 12.0 and c.calls == [4, 8]  # past the largest bucket: the largest
    c.proposed(3, 4.0)  # a drafter's pass: dearer drafting, decoding unchanged
    assert (c(4, 0), c(4, 1), c(4, 7)) == (10.0, 16.0, 24.0) and c(8, 1) == 12.0
    c.proposed(4, 8.0)
    assert c(4, 3) == pytest.approx(14.0 + 4.0 + PROPOSER_RATE * 4.0)


def oracle_engine(model, prompts, ref, p: float, k: int, adaptive: bool = True, **kw):
    V = model.config.vocab_size
    proposer = OracleProposer([q + r.outputs[0].token_ids for q, r in zip(prompts, ref)], p, V, 0)
    return make_engine(model, speculative=SpeculativeConfig(proposer, None, k, adaptive=adaptive), **kw)


@pytest.mark.parametrize("graphs", [False, True])
def test_engine_picks_the_ceiling_when_every_draft_is_kept(model, graphs):
    """With steps priced alike at every k (so drafting always pays) and an oracle right every time, every step
    after the first drafts k = 7; the tokens are the run's without speculation. graphs=True: the steps run the
    verification graphs' static form, rows padded to each draft length's width (2, 4 or 8)."""
    V = model.config.vocab_size
    prompts = random_prompts(V, (5, 40, 9), generator_seed=7)
    params = greedy(30)
    ref = make_engine(model).generate(prompts, params)
    engine = oracle_engine(model, prompts, ref, 1.0, 7, use_cuda_graphs=graphs)
    lengths = engine.speculator.lengths
    assert lengths.lengths == (1, 3, 7)
    lengths.costs = costs_of({0: 1.0, 1: 1.0, 3: 1.0, 7: 1.0}, engine.runner.sizes)
    outs = engine.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in ref]
    st = engine.stats
    # every verification drafted what the length limits left, up to 7
    assert st["spec_decode_num_draft_tokens"] == st["spec_decode_num_accepted_tokens"] > 0
    assert st["spec_decode_num_draft_tokens"] / st["spec_decode_num_drafts"] > 5
    if graphs:
        assert {key[2] for key in engine.runner.graphs} >= {8}


def test_engine_stops_drafting_when_nothing_is_kept(model):
    V = model.config.vocab_size
    prompts = random_prompts(V, (5, 40), generator_seed=8)
    params = greedy(60)
    ref = make_engine(model).generate(prompts, params)
    engine = oracle_engine(model, prompts, ref, 0.0, 7)
    engine.speculator.lengths.costs = costs_of({0: 1.0, 1: 1.2, 3: 1.5, 7: 2.0}, engine.runner.sizes)
    outs = engine.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in ref]
    # ~60 decode steps: a few drafting steps while the rate falls from its prior, then a probe every PROBE_EVERY
    drafting_steps = engine.stats["spec_decode_num_drafts"] / len(prompts)
    assert 1 <= drafting_steps <= 2 + 60 / PROBE_EVERY, engine.stats


def test_engine_measures_its_step_costs_and_keeps_greedy_tokens(model):
    """The real cost table (timed static steps on this CPU) and an oracle kept with p = 0.7: whatever k the
    engine picks, greedy tokens are the plain run's; the batch buckets met were measured for every length."""
    V = model.config.vocab_size
    prompts = random_prompts(V, (5, 40, 9, 17), generator_seed=9)
    params = greedy(24)
    ref = make_engine(model).generate(prompts, params)
    engine = oracle_engine(model, prompts, ref, 0.7, 7, use_cuda_graphs=True)
    outs = engine.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in ref]
    table = engine.speculator.lengths.costs.table
    buckets = {b for b, _ in table}
    assert buckets and all((b, k) in table and table[b, k] > 0 for b in buckets for k in (0, 1, 3, 7))


def test_seeded_samples_do_not_depend_on_the_choice(model):
    """A seeded sampling request drafts the ceiling whatever the engine picks for the rows beside it: its tokens
    are those of the engine with k fixed, whether the table makes drafting look cheap or dear."""
    V = model.config.vocab_size
    prompts = random_prompts(V, (6, 30), generator_seed=10)
    seeded = SamplingParams(temperature=0.8, seed=5, max_new_tokens=20)
    ref = make_engine(model).generate(prompts, greedy(20))
    want = oracle_engine(model, prompts, ref, 0.6, 4, adaptive=False)
    want_ids = [o.outputs[0].token_ids for o in want.generate(prompts, [greedy(20), seeded])]
    for table in ({0: 1.0, 1: 1.0, 3: 1.0, 4: 1.0}, {0: 1.0, 1: 5.0, 3: 9.0, 4: 12.0}):
        engine = oracle_engine(model, prompts, ref, 0.6, 4)
        engine.speculator.lengths.costs = costs_of(table, engine.runner.sizes)
        got = [o.outputs[0].token_ids for o in engine.generate(prompts, [greedy(20), seeded])]
        assert got == want_ids


def test_verification_widths_changing_step_to_step_share_their_buffers(model):
    """k cycling 1, 3, 7 from step to step in the graphs' static form: each width's graph copies its saved KDA
    inputs into the front of the same buffers and the commit reads them back as that width's view; greedy tokens
    stay the plain run's and every width ran."""
    V = model.config.vocab_size
    prompts = random_prompts(V, (5, 40, 9), generator_seed=12)
    params = greedy(30)
    ref = make_engine(model).generate(prompts, params)
    engine = oracle_engine(model, prompts, ref, 0.8, 7, use_cuda_graphs=True)
    cycle = iter([1, 3, 7] * 100)
    engine.speculator.lengths.choose = lambda rows, batch: next(cycle) if rows else 0
    outs = engine.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in ref]
    assert {key[2] for key in engine.runner.graphs} >= {2, 4, 8}
    assert engine.stats["spec_decode_num_accepted_tokens"] > 0
