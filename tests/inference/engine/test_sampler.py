"""The engine sampler: its penalties (running per-sequence counts against a recount of every sequence's whole token
list at every step, what the sampler computed before it kept counts) and its logprobs under a constraint."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kimik3.inference import SamplingParams
from kimik3.inference.engine import Request, sampler
from kimik3.inference.engine.request import accumulate
from kimik3.inference.sampling import repetition_penalty
from tests.helpers import requires_cuda
from tests.inference.engine.conftest import greedy, make_engine, random_prompts


def recount(x_MV: torch.Tensor, seqs) -> torch.Tensor:
    """The penalties from whole token lists, every row counted (the oracle)."""
    (M, V), params = x_MV.shape, [s.params for s in seqs]
    if any(p.repetition_penalty != 1 for p in params):
        seen = torch.zeros(M, V, dtype=torch.bool)
        for i, s in enumerate(seqs):
            seen[i, torch.tensor(s.tokens)] = True
        x_MV = repetition_penalty(x_MV, seen, torch.tensor([p.repetition_penalty for p in params]))
    if any(p.presence_penalty or p.frequency_penalty for p in params):
        counts = torch.zeros(M, V)
        for i, s in enumerate(seqs):
            out = torch.tensor(s.tokens[s.num_prompt:], dtype=torch.long)
            counts[i].index_add_(0, out, torch.ones(out.shape[0]))
        x_MV = x_MV - torch.tensor([p.frequency_penalty for p in params])[:, None] * counts
        x_MV = x_MV - torch.tensor([p.presence_penalty for p in params])[:, None] * (counts > 0)
    return x_MV


class Digits:
    def decode_bytes(self, ids):
        return "".join(f" {i}" for i in ids).encode()


def test_running_counts_equal_a_recount_every_step(model, monkeypatch):
    """Bit for bit at every step, over a run with penalized rows beside a plain one, n = 3 forks (sampled, seeded),
    preemption and recomputation (a pool of 9 blocks of 16 tokens for seven sequences), and a stop string; each
    token crosses to the device once, and the streamed pieces add up to the outputs."""
    real, real_counts, real_to_device = sampler.penalize, sampler.token_counts, sampler.to_device
    checks, sent, counting = [], [], []

    def checked(x_MV, seqs, drafts=None):
        assert drafts is None  # no speculative decoding in this run
        got = real(x_MV, seqs)
        assert torch.equal(got, recount(x_MV, seqs))
        checks.append(len(seqs))
        return got

    def token_counts(seq, V, device):
        counting.append(seq)
        try:
            return real_counts(seq, V, device)
        finally:
            counting.pop()

    def to_device(x, device):  # the token ids a sequence's counts take in
        if counting:
            sent.append(x.numel())
        return real_to_device(x, device)

    monkeypatch.setattr(sampler, "penalize", checked)
    monkeypatch.setattr(sampler, "token_counts", token_counts)
    monkeypatch.setattr(sampler, "to_device", to_device)
    V = model.config.vocab_size
    prompts = random_prompts(V, (20, 17, 12, 24, 15), generator_seed=40)
    params = {
        "rep": greedy(12, repetition_penalty=1.8),
        "freq": greedy(12, frequency_penalty=1.5, presence_penalty=0.5, logit_bias={7: 3.0}),
        "plain": greedy(12),
        "fork": SamplingParams(temperature=1.0, seed=3, n=3, max_new_tokens=12, repetition_penalty=1.3,
                               frequency_penalty=-0.5, logit_bias={11: 2.0}),
        "stop": greedy(12, presence_penalty=-1.0, logit_bias={7: 2.0}, stop=(" 7 ",)),
    }
    engine = make_engine(model, num_blocks=9, enable_prefix_cache=False, tokenizer=Digits())
    for (rid, p), prompt in zip(params.items(), prompts):
        engine.add_request(Request(rid, prompt, p))
    final = {}
    while engine.has_unfinished():
        accumulate(final, engine.step())
    assert engine.stats["preemptions"] > 0 and len(checks) > 10
    assert len(final["fork"].outputs) == 3 and final["stop"].outputs[0].finish_reason == "stop"
    assert final["freq"].outputs[0].token_ids.count(7) < 12  # the penalty turned the bias down
    penalized = [(rid, s) for rid, o in final.items() if rid != "plain" for s in o.outputs]
    assert sum(sent) == sum(len(final[rid].prompt_ids) + len(s.token_ids) - 1 for rid, s in penalized)


def test_logprobs_stay_raw_under_a_constraint():
    """fp32 logits, a constraint and nothing else: the mask must not reach the logits it was given (the runner's
    buffer, which the logprobs read): they report the raw distribution, as without a constraint."""

    class Odd:
        def allowed(self):
            return torch.arange(V) % 2 == 1

    V = 50
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(0))
    logits[0, 0] = 10.0  # the raw argmax is even: the constraint changes the token
    before = logits.clone()
    seq = SimpleNamespace(params=SamplingParams(temperature=0, logprobs=3, max_new_tokens=1), constraint=Odd(),
                          generator=None)
    tokens, logprobs = sampler.sample(logits, [seq])
    assert tokens[0] % 2 == 1
    assert torch.equal(logits, before)
    raw = before.log_softmax(-1)[0]
    assert logprobs[0].logprob == raw[tokens[0]].item()
    assert logprobs[0].top[0][0] == 0  # the raw top entry, banned by the constraint


class _Seq:
    """What the sampler's penalties read of a sequence."""

    def __init__(self, params, tokens, num_prompt):
        self.params, self.tokens, self.num_prompt, self.counts = params, tokens, num_prompt, None

    @property
    def output(self):
        return self.tokens[self.num_prompt:]


@pytest.mark.gpu
@requires_cuda
def test_penalties_equal_a_recount_gpu():
    """The counts kept on the GPU, three steps on: the penalized logits equal the CPU recount bit for bit."""
    V, gen = 1000, torch.Generator().manual_seed(1)
    seqs = [_Seq(greedy(8, repetition_penalty=1.5, frequency_penalty=0.7, presence_penalty=0.3),
                 torch.randint(V, (30,), generator=gen).tolist(), 20),
            _Seq(greedy(8), [1, 2, 3], 2)]
    for _ in range(3):
        x = torch.randn(2, V, generator=gen)
        assert torch.equal(sampler.penalize(x.cuda(), seqs).cpu(), recount(x, seqs))
        for s in seqs:
            s.tokens.append(int(torch.randint(V, (1,), generator=gen)))
    assert seqs[0].counts.output_V.is_cuda and seqs[1].counts is None
