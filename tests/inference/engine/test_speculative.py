"""Speculative decoding in the engine == the engine without it: greedy tokens over prompts, batch sizes, k and
acceptance rates (an oracle proposer on the tiny random model); the committed KDA state and MLA latents after
every step; logprobs; penalties; n > 1; stop ids; structured output; prefix-cache rounds; and the sampled output
distribution (chi-square, with a wrong acceptance rule as the negative control)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from kimik3.inference.engine import Engine, EngineConfig, Request, SpeculativeConfig
from kimik3.inference.engine import speculative as spec_module
from kimik3.inference.engine.request import accumulate
from kimik3.inference.sampling import SamplingParams
from kimik3.inference.spec import Draft, target_probs
from kimik3.inference.spec.oracle import OracleProposer, expected_accepted_length, p_for_accepted_length
from kimik3.model import K3ForCausalLM
from tests.helpers import randomize, rel_err
from tests.inference.engine.conftest import greedy, make_engine, random_prompts

LENGTHS = (1, 5, 63, 64, 65, 130, 33, 7)


def run(engine: Engine, prompts, params) -> list:
    return engine.generate(prompts, params)


def ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def oracle(prompts, outs, p: float, vocab: int, seed: int = 0) -> OracleProposer:
    return OracleProposer([q + r for q, r in zip(prompts, ids(outs))], p, vocab, seed)


def spec(method, k: int = 4, adaptive: bool = False, **kw) -> dict:
    """The speculative config; k fixed unless `adaptive` (these tests are about a given k)."""
    return dict(speculative=SpeculativeConfig(method, num_speculative_tokens=k, adaptive=adaptive), **kw)


@pytest.mark.parametrize("p,k,batch,graphs", [(0.0, 3, 8, False), (0.6, 4, 8, False), (0.6, 4, 8, True),
                                              (0.9, 7, 3, True), (1.0, 2, 1, False), (0.75, 1, 8, True)])
def test_greedy_oracle_equals_non_speculative(model, p, k, batch, graphs):
    V = model.config.vocab_size
    prompts = random_prompts(V, LENGTHS[:batch], generator_seed=batch)
    params = greedy(17, logprobs=2)
    ref = run(make_engine(model), prompts, params)
    engine = make_engine(model, use_cuda_graphs=graphs, **spec(oracle(prompts, ref, p, V), k))
    outs = run(engine, prompts, params)
    assert ids(outs) == ids(ref)
    # graphs=True: drafted steps ran the verification graphs' static form (rows padded to 1 + k)
    assert any(L == k + 1 for _, _, L in engine.runner.graphs) == graphs
    st = engine.stats
    assert st["spec_decode_num_drafts"] > 0
    if p == 0:
        assert st["spec_decode_num_accepted_tokens"] == 0
    if p == 1:
        assert st["spec_decode_num_accepted_tokens"] == st["spec_decode_num_draft_tokens"]
    assert st["generation_tokens_total"] == 17 * batch
    for a, b in zip(outs, ref):  # logprobs of the committed tokens == non-speculative's
        got = torch.tensor([[lp.logprob] + [v for _, v in lp.top] for lp in a.outputs[0].logprobs])
        want = torch.tensor([[lp.logprob] + [v for _, v in lp.top] for lp in b.outputs[0].logprobs])
        assert rel_err(got, want) < 1e-5
        assert [[i for i, _ in lp.top] for lp in a.outputs[0].logprobs] == \
            [[i for i, _ in lp.top] for lp in b.outputs[0].logprobs]
    assert len(engine.slots) == engine.pool.num_slots


def test_p_for_accepted_length_inverts_the_expected_length():
    for k, length in ((7, 3.3), (3, 3.3), (4, 2.0), (1, 1.5)):
        p = p_for_accepted_length(length, k)
        assert abs(expected_accepted_length(p, k) - length) < 1e-9
    assert p_for_accepted_length(3.3, 3) > p_for_accepted_length(3.3, 7)  # fewer drafts need righter ones
    with pytest.raises(ValueError, match=r"\[1, 4\]"):
        p_for_accepted_length(4.5, 3)


def test_oracle_marks_are_per_position_and_keep_the_law():
    ref = list(range(20_000))
    a, b = OracleProposer([ref], 0.72, 10**6, seed=1), OracleProposer([ref], 0.72, 10**6, seed=1)
    a.propose(0, ref[:50], 7)  # a warm-up call: a stream would now be ahead
    assert a.propose(0, ref[:9], 40) == b.propose(0, ref[:9], 40)
    assert OracleProposer([ref], 0.72, 10**6, seed=2).propose(0, ref[:9], 40) != b.propose(0, ref[:9], 40)
    # steps as the engine takes them: accept up to the first wrong draft, then the bonus token
    n, steps = 5, []
    while n < 19_000:
        draft = b.propose(0, ref[:n], 7).tokens
        accepted = next((i for i, t in enumerate(draft) if t != ref[n + i]), len(draft))
        steps.append(accepted + 1)
        n += accepted + 1
    assert abs(sum(steps) / len(steps) - expected_accepted_length(0.72, 7)) < 0.1  # ~5,700 steps: sd ~0.03


def _states(engine: Engine) -> dict[tuple[str, int], tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(request, choice) -> (num_computed, recurrent, conv, latents of positions < num_computed), now."""
    out, pool, Bs = {}, engine.pool, engine.pool.block_size
    for seq in engine.scheduler.running:
        n = seq.num_computed
        rows = (torch.tensor(seq.blocks)[:, None] * Bs + torch.arange(Bs)).flatten()[:n]
        out[seq.group.request.request_id, seq.index] = (n, pool.recurrent[:, seq.slot].clone(),
                                                        pool.conv[:, :, seq.slot].clone(), pool.latent[:, rows].clone())
    return out


@pytest.mark.parametrize("graphs", [False, True])
def test_committed_state_equals_non_speculative_after_every_step(model, graphs):
    """Eager steps, and (graphs=True) the graphs' static steps run eagerly on the CPU: every row padded to 1 + k,
    the slots written by the commit after verification."""
    V = model.config.vocab_size
    prompts = random_prompts(V, (9, 70, 3), generator_seed=3)
    params = greedy(20)
    ref_engine = make_engine(model)
    reference: dict = {}
    for i, q in enumerate(prompts):
        ref_engine.add_request(Request(str(i), q, params))
    done: dict = {}
    while ref_engine.has_unfinished():
        accumulate(done, ref_engine.step())
        for key, (n, *state) in _states(ref_engine).items():
            reference[key, n] = state
    outs = [done[str(i)] for i in range(len(prompts))]
    engine = make_engine(model, use_cuda_graphs=graphs, **spec(oracle(prompts, outs, 0.6, V), 5))
    for i, q in enumerate(prompts):
        engine.add_request(Request(str(i), q, params))
    checked, partial, st = 0, 0, engine.stats
    while engine.has_unfinished():
        before = st["spec_decode_num_draft_tokens"] - st["spec_decode_num_accepted_tokens"]
        engine.step()
        st = engine.stats
        partial += st["spec_decode_num_draft_tokens"] - st["spec_decode_num_accepted_tokens"] > before
        for key, (n, *state) in _states(engine).items():
            seq = next(s for s in engine.scheduler.running if (s.group.request.request_id, s.index) == key)
            assert len(seq.tokens) - n <= 1 or n < seq.num_prompt  # nothing is re-fed after a rejection
            if (key, n) not in reference:  # mid-prefill lengths the reference never stopped at
                continue
            for got, want in zip(state, reference[key, n]):
                assert rel_err(got, want) < 1e-5
            checked += 1
    assert checked >= 20 and partial > 0
    assert any(L > 1 for _, _, L in engine.runner.graphs) == graphs
    assert engine.stats["spec_decode_num_accepted_tokens"] > 0


def test_penalties_bias_and_n3_greedy(model):
    """The penalties count earlier drafts in each verification row; greedy n = 3 choices all equal the reference."""
    V = model.config.vocab_size
    prompts = random_prompts(V, (12, 40, 5), generator_seed=4)
    params = greedy(15, repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=0.4,
                    logit_bias=((3, 2.0), (7, -1.0)), n=3)
    ref = run(make_engine(model), prompts, params)
    assert all(len({tuple(c.token_ids) for c in o.outputs}) == 1 for o in ref)
    engine = make_engine(model, **spec(oracle(prompts, ref, 0.8, V), 4))
    outs = run(engine, prompts, params)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[c.token_ids for c in o.outputs] for o in ref]
    assert engine.stats["spec_decode_num_accepted_tokens"] > 0


def test_stop_id_inside_an_accepted_draft_and_prefix_rounds(model):
    """A stop id met among accepted drafts ends the output there (the state ran past it: no end snapshot of it);
    A -> B -> A rounds through the prefix cache give the same tokens and hits with speculation on and off."""
    V = model.config.vocab_size
    a, b = random_prompts(V, (70, 90), generator_seed=5)
    free = ids(run(make_engine(model), [a], greedy(12)))[0]
    stop = greedy(12, stop_token_ids=(free[6],))

    def rounds(engine):
        got = []
        for prompt, p in ((a, stop), (b, greedy(12)), (a, stop), (a + free[:7] + [5, 6], greedy(9))):
            out = run(engine, [prompt], p)[0]
            got.append((out.outputs[0].token_ids, out.outputs[0].finish_reason, out.cached_tokens))
        return got

    off = rounds(make_engine(model, prefix_cache_bytes=10**9))
    assert off[0][0] == free[: free.index(free[6]) + 1] and off[0][1] == "stop"
    refs = [a + free, b + ids(run(make_engine(model), [b], greedy(12)))[0],
            a + free[:7] + [5, 6] + ids(run(make_engine(model), [a + free[:7] + [5, 6]], greedy(9)))[0]]
    engine = make_engine(model, prefix_cache_bytes=10**9, **spec(OracleProposer(refs, 1.0, V), 7))
    on = rounds(engine)
    assert [r[:2] for r in on] == [r[:2] for r in off] and [r[2] for r in on[:3]] == [r[2] for r in off[:3]]
    assert off[2][2] > 0 and off[3][2] == len(a) + 6  # the rounds hit the cache; off: A's end snapshot
    # on: A's end state was never computed (the draft ran past the stop id): the prompt's grid snapshot instead
    assert on[3][2] == 64


class _EvenTokens:
    """Structured output stand-in: only even ids, finished after 6 tokens."""

    def __init__(self, vocab: int):
        self.mask, self.n = torch.arange(vocab) % 2 == 0, 0

    def allowed(self):
        return self.mask

    def accept(self, token_id: int) -> None:
        assert token_id % 2 == 0
        self.n += 1

    def is_finished(self) -> bool:
        return self.n >= 6


def _constrained_beside_free(engine, prompts, params, constraint) -> dict:
    """Request "c" (prompts[0], under the constraint) and, given a second prompt, "u" beside it, run to the end:
    {request id: (token ids, finish reason)}."""
    engine.add_request(Request("c", prompts[0], params, constraint=constraint))
    if len(prompts) > 1:
        engine.add_request(Request("u", prompts[1], params))
    done: dict = {}
    while engine.has_unfinished():
        accumulate(done, engine.step())
    return {k: (v.outputs[0].token_ids, v.outputs[0].finish_reason) for k, v in done.items()}


def test_constrained_rows_decode_without_drafts_beside_drafted_ones(model):
    V = model.config.vocab_size
    prompts = random_prompts(V, (20, 30), generator_seed=6)
    params = greedy(10)

    def go(engine):
        return _constrained_beside_free(engine, prompts, params, _EvenTokens(V))

    off = go(make_engine(model))
    assert len(off["c"][0]) == 6 and all(t % 2 == 0 for t in off["c"][0])
    refs = [prompts[0] + off["c"][0], prompts[1] + off["u"][0]]
    engine = make_engine(model, **spec(OracleProposer(refs, 1.0, V), 3))
    assert go(engine) == off
    # only the unconstrained request drafted: after its first token, 3 + 1 twice, then its last token alone
    assert engine.stats["spec_decode_num_drafts"] == 2


class _EvenTokensRollback(_EvenTokens):
    """The stand-in with the rollback a grammar has: constrained rows speculate."""

    def rollback(self, n: int) -> None:
        self.n -= n


@pytest.mark.parametrize("p", [1.0, 0.6])
def test_constrained_rows_speculate_where_the_constraint_rolls_back(model, p):
    """Drafts are cut at the first token the constraint refuses (the oracle's wrong tokens are odd), each row is
    masked by the constraint advanced by the drafts before it, and the constraint ends advanced by the committed
    tokens only: the same tokens as without speculation."""
    V = model.config.vocab_size
    prompts = random_prompts(V, (20, 30), generator_seed=6)
    params = greedy(10)

    def go(engine, both=True):
        return _constrained_beside_free(engine, prompts if both else prompts[:1], params, _EvenTokensRollback(V))

    off = go(make_engine(model))
    assert len(off["c"][0]) == 6 and off["c"][1] == "stop" and all(t % 2 == 0 for t in off["c"][0])
    # the oracle's wrong token is the right one + 1: odd after an even one, so the constraint cuts it off
    refs = [prompts[0] + off["c"][0], prompts[1] + off["u"][0]]
    engine = make_engine(model, **spec(OracleProposer(refs, p, V, seed=2), 3))
    assert go(engine) == off
    alone = make_engine(model, **spec(OracleProposer(refs, p, V, seed=2), 3))
    assert go(alone, both=False) == {"c": off["c"]}
    assert alone.stats["spec_decode_num_drafts"] > 0 and alone.stats["spec_decode_num_accepted_tokens"] > 0


class _FixedProposer:
    """Always drafts the same token (a deterministic proposer: q one-hot)."""

    needs_taps = ()

    def __init__(self, token: int, k: int):
        self.draft = Draft((token,) * k)

    def observe(self, seq_id, tokens):
        pass

    def finish(self, seq_id):
        pass

    def propose(self, seq_id, ids, k, taps=None):
        return Draft(self.draft.tokens[:k])


def _wrong_verify(d, q, logits, params, generator=None):
    """Accept d_i with probability p(d_i) but redraw from p itself on a rejection (the residual left out)."""
    p = target_probs(logits, params)
    for i, t in enumerate(d):
        if float(torch.rand((), generator=generator)) >= float(p[i, t]):
            return list(d[:i]) + [int(torch.multinomial(p[i], 1, generator=generator))]
    return list(d) + [int(torch.multinomial(p[len(d)], 1, generator=generator))]


SAMPLES, SMALL_V = 1500, 12
CRITICAL = 31.26  # chi-square, 11 degrees of freedom, p = 0.001


@pytest.fixture(scope="module")
def small_vocab(tiny_config):
    cfg = dataclasses.replace(tiny_config.text, vocab_size=SMALL_V, pad_token_id=None)
    return randomize(K3ForCausalLM(cfg, torch.float32), seed=11).eval()


def _second_token_counts(lm, prompt, proposer) -> torch.Tensor:
    engine = Engine(lm, EngineConfig(max_num_seqs=64, max_num_batched_tokens=512, max_model_len=64, block_size=16,
                                     enable_prefix_cache=False, **({} if proposer is None else spec(proposer, 2))))
    params = [SamplingParams(temperature=1.0, max_new_tokens=3, seed=i) for i in range(SAMPLES)]
    outs = engine.generate([prompt] * SAMPLES, params)
    if proposer is not None:
        assert engine.stats["spec_decode_num_drafts"] == SAMPLES
    return torch.bincount(torch.tensor([o.outputs[0].token_ids[1] for o in outs]), minlength=SMALL_V).double()


@torch.no_grad()
def _exact_second_token(lm, prompt) -> torch.Tensor:
    p1 = lm(torch.tensor([prompt]))[0, -1].float().softmax(-1).double()
    rows = lm(torch.tensor([prompt + [t] for t in range(SMALL_V)]))[:, -1].float().softmax(-1).double()
    return p1 @ rows


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_sampled_distribution_is_the_targets(small_vocab, monkeypatch):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    exact = _exact_second_token(small_vocab, prompt)
    assert exact.min() * SAMPLES > 5  # every bin is big enough for the test
    likely = int(exact.argmax())  # a draft the target often keeps: a wrong residual shows plainly
    assert _chi2(_second_token_counts(small_vocab, prompt, None), exact) < CRITICAL
    assert _chi2(_second_token_counts(small_vocab, prompt, _FixedProposer(likely, 2)), exact) < CRITICAL
    monkeypatch.setattr(spec_module, "verify", _wrong_verify)
    assert _chi2(_second_token_counts(small_vocab, prompt, _FixedProposer(likely, 2)), exact) > CRITICAL


def test_bad_speculative_settings_are_value_errors(model):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig("suffix", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="model is required with method 'draft'"):
        SpeculativeConfig("draft")
    with pytest.raises(FileNotFoundError, match="model /nonexistent: no such folder"):
        SpeculativeConfig("draft", "/nonexistent")
    with pytest.raises(ValueError, match="'suffix' or 'draft'"):
        SpeculativeConfig("ngram")
    from kimik3.presets import DEMO_DRAFTER

    with pytest.raises(ValueError, match=r"speculative model .*target_hidden_size|vocab_size"):
        make_engine(model, speculative=SpeculativeConfig("draft", str(DEMO_DRAFTER)))
    with pytest.raises(ValueError, match="sync_tokens"):
        make_engine(model, speculative=SpeculativeConfig("suffix"), sync_tokens=lambda t: None)


def test_verification_graph_rows_follow_their_buffers_memory():
    """The batch buckets that get verification graphs are those whose saved KDA inputs fit the budget: at K3's
    widths with k = 7, ~97 MB a row over 69 KDA layers, so 8 rows in 1 GiB; slice-12's 9 KDA layers, all 64."""
    from kimik3.inference.engine.graphs import VERIFY_BUFFER_BYTES, verify_graph_rows

    sizes = [1, 2, 4, 8, 16, 32, 64]

    def pool(num_kda):  # a StatePool's KDA tensors at K3's widths, on the meta device
        return SimpleNamespace(recurrent=torch.empty(num_kda, 65, 96, 128, 128, device="meta"),
                               conv=torch.empty(num_kda, 3, 65, 3, 96 * 128, dtype=torch.bfloat16, device="meta"),
                               dtype=torch.bfloat16)

    per_row = 69 * (3 * 8 * 96 * 128 * 2 + 8 * 96 * 4 + 3 * (8 + 3) * 96 * 128 * 2)
    assert per_row == 96_869_376
    assert verify_graph_rows(pool(69), 69, 8, sizes) == [1, 2, 4, 8]  # 11 rows would fit: the bucket below
    assert verify_graph_rows(pool(9), 9, 8, sizes) == sizes
    assert verify_graph_rows(pool(69), 69, 8, sizes, budget=per_row * 4) == [1, 2, 4]
    assert verify_graph_rows(pool(69), 69, 8, sizes, budget=per_row - 1) == []  # none fit: eager verification
    assert VERIFY_BUFFER_BYTES == 1 << 30


def test_verification_without_graph_buckets_runs_eagerly(model, monkeypatch):
    """No bucket fits the budget (`verify_sizes` empty): every verification step runs eagerly, not as a static
    step, and greedy still equals the run without speculation."""
    from kimik3.inference.engine import graphs

    V = model.config.vocab_size
    prompts = random_prompts(V, (9, 30, 17), generator_seed=3)
    params = greedy(8)
    ref = run(make_engine(model), prompts, params)
    engine = make_engine(model, use_cuda_graphs=True, **spec(oracle(prompts, ref, 0.6, V), 3))
    engine.runner.verify_sizes = []  # what `verify_graph_rows` gives on CUDA when not one row fits
    replayed, real = [], graphs.StepGraph.__call__
    monkeypatch.setattr(graphs.StepGraph, "__call__",
                        lambda self, chunks: (replayed.append(self.row_len), real(self, chunks))[1])
    assert ids(run(engine, prompts, params)) == ids(ref)
    assert engine.stats["spec_decode_num_drafts"] > 0
    assert set(replayed) <= {1}  # no verification step ran as a static step
