"""Engine == full forwards without a cache: greedy tokens (`reference_tokens`) and logprobs (1e-5 relative)."""

from __future__ import annotations

import pytest
import torch

from kimik3.inference import generate
from kimik3.inference.engine import Request
from kimik3.inference.engine.request import accumulate
from tests.helpers import rel_err
from tests.inference.engine.conftest import full_logprobs, greedy, make_engine, random_prompts, reference_tokens


def check_logprobs(model, prompt, seq_out, k):
    ref = full_logprobs(model, prompt, seq_out.token_ids)
    got = torch.tensor([lp.logprob for lp in seq_out.logprobs])
    want = ref.gather(1, torch.tensor(seq_out.token_ids)[:, None])[:, 0]
    assert rel_err(got, want) < 1e-5
    top_got = torch.tensor([[v for _, v in lp.top] for lp in seq_out.logprobs])
    top_ids = torch.tensor([[i for i, _ in lp.top] for lp in seq_out.logprobs])
    assert top_got.shape == (len(seq_out.token_ids), k)
    assert rel_err(top_got, ref.gather(1, top_ids)) < 1e-5
    assert torch.equal(top_ids[:, 0], ref.argmax(-1))


def test_eight_mixed_lengths_chunked(model):
    """8 concurrent prompts of 1..200 tokens, prefill chunked at 128 tokens per step, decodes interleaved."""
    V = model.config.vocab_size
    prompts = random_prompts(V, (1, 5, 63, 64, 65, 130, 200, 33))
    params = greedy(7, logprobs=3)
    ref = reference_tokens(model, prompts, params)
    engine = make_engine(model)
    outs = engine.generate(prompts, params)
    for prompt, want, out in zip(prompts, ref, outs):
        assert out.finished and out.outputs[0].finish_reason == "length"
        assert out.outputs[0].token_ids == want
        check_logprobs(model, prompt, out.outputs[0], 3)
    assert engine.stats["running"] == engine.stats["waiting"] == 0
    assert len(engine.slots) == engine.pool.num_slots  # every slot back


def test_admitted_mid_run(model):
    V = model.config.vocab_size
    prompts = random_prompts(V, (40, 90, 7, 150, 20, 66), generator_seed=1)
    params = greedy(8)
    ref = reference_tokens(model, prompts, params)
    engine = make_engine(model)
    done = {}
    for i in range(3):
        engine.add_request(Request(str(i), prompts[i], params))
    for _ in range(3):
        accumulate(done, engine.step())
    for i in range(3, 6):
        engine.add_request(Request(str(i), prompts[i], params))
    while engine.has_unfinished():
        accumulate(done, engine.step())
    assert [done[str(i)].outputs[0].token_ids for i in range(6)] == ref


def test_streamed_new_tokens_add_up(model):
    prompts = random_prompts(model.config.vocab_size, (30, 70), generator_seed=2)
    engine = make_engine(model)
    for i, p in enumerate(prompts):
        engine.add_request(Request(str(i), p, greedy(5)))
    pieces = {"0": [], "1": []}
    while engine.has_unfinished():
        for out in engine.step():
            pieces[out.request_id] += out.outputs[0].token_ids  # a step's output is its delta
    assert [pieces["0"], pieces["1"]] == reference_tokens(model, prompts, greedy(5))


def test_preemption_recomputes_exactly(model):
    """A pool of 12 blocks of 16 tokens cannot hold four growing sequences: some are preempted and recomputed."""
    V = model.config.vocab_size
    prompts = random_prompts(V, (40, 45, 50, 38), generator_seed=3)
    params = greedy(20)
    ref = reference_tokens(model, prompts, params)
    engine = make_engine(model, num_blocks=12, enable_prefix_cache=False)
    outs = engine.generate(prompts, params)
    assert engine.stats["preemptions"] > 0
    assert [o.outputs[0].token_ids for o in outs] == ref


def test_prompt_logprobs_equal_full_forward(model):
    prompt = random_prompts(model.config.vocab_size, (150,), generator_seed=4)[0]
    engine = make_engine(model)
    out = engine.generate([prompt], greedy(2, prompt_logprobs=2))[0]
    lp = out.prompt_logprobs
    assert lp[0] is None and len(lp) == len(prompt)
    ref = model(torch.tensor([prompt]))[0, :-1].float().log_softmax(-1)
    got = torch.tensor([e.logprob for e in lp[1:]])
    assert rel_err(got, ref.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]) < 1e-5
    assert [e.top[0][0] for e in lp[1:]] == ref.argmax(-1).tolist()
    assert out.cached_tokens == 0


def test_demo_model_greedy_equals_full_forwards():
    from kimik3.checkpoint.loader import load
    from kimik3.presets import DEMO_MODEL

    model = load(DEMO_MODEL, dtype=torch.float32, text_only=True, quiet=True).eval()
    eos = (model.config.eos_token_id,)
    prompts = random_prompts(model.config.text.vocab_size, (20, 70, 3), generator_seed=5)
    params = greedy(6)
    outs = make_engine(model, eos_token_ids=eos).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == reference_tokens(model, prompts, params, eos)
    # generate() is the engine too: the same tokens
    assert [c.token_ids for c in generate(model, prompts, params, eos_token_ids=eos)] == \
        [o.outputs[0].token_ids for o in outs]


def test_static_decode_steps_equal_generate(model):
    """The CUDA-graph step's form, run eagerly: padded to a bucket on the scratch slot and block, keys over a span
    bucket of the block table. Mixed with chunked prefills and admissions it still gives generate()'s tokens."""
    from kimik3.inference.engine.graphs import StepGraph

    V = model.config.vocab_size
    prompts = random_prompts(V, (3, 40, 70, 17, 130), generator_seed=6)
    params = [greedy(n, logprobs=0) for n in (12, 3, 9, 5, 10)]  # finishing apart: buckets pad
    engine = make_engine(model, max_num_seqs=5, use_cuda_graphs=True)
    assert engine.runner.sizes == [1, 2, 4, 5]
    used = []
    real = StepGraph.__call__
    StepGraph.__call__ = lambda self, chunks: (used.append((self.rows, len(chunks))), real(self, chunks))[1]
    try:
        outs = engine.generate(prompts, params)
    finally:
        StepGraph.__call__ = real
    assert [o.outputs[0].token_ids for o in outs] == reference_tokens(model, prompts, params)
    assert any(rows > n for rows, n in used) and len(used) >= 5  # static steps ran, some with padding rows
    for prompt, out in zip(prompts, outs):
        ref = full_logprobs(model, prompt, out.outputs[0].token_ids)
        got = torch.tensor([lp.logprob for lp in out.outputs[0].logprobs])
        assert rel_err(got, ref.gather(1, torch.tensor(out.outputs[0].token_ids)[:, None])[:, 0]) < 1e-5


def test_engine_with_decode_graphs_is_freed_without_the_cycle_collector(model):
    """`del engine` releases it at once (on CUDA its captured graphs hold a memory pool: a reference cycle kept
    a benchmark's first engine alive until the collector ran, and the next one ran out of memory)."""
    import gc
    import weakref

    engine = make_engine(model, max_num_seqs=2, use_cuda_graphs=True)
    engine.generate([[5, 6, 7]], greedy(2))
    assert engine.runner.graphs
    gc.collect()
    alive, cache = weakref.ref(engine), weakref.ref(engine.runner.pool)
    gc.disable()
    try:
        del engine
        assert alive() is None and cache() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("graphs", [False, True])
def test_a_steps_work_does_not_depend_on_max_model_len(model, graphs):
    """The same requests with max_model_len 300 and K3's 1,048,576: every step attends over the same key span
    and block-table width (the latent attention's inputs), and gives the same tokens."""
    import kimik3.model.mla as mla_mod

    V = model.config.vocab_size
    prompts = random_prompts(V, (20, 70, 150), generator_seed=9)
    seen = {}
    real = mla_mod.paged_latent_attention

    def spy(q, latent, *a, **kw):
        seen[key].append((kw["max_seq_len"], tuple(kw["block_tables_NM"].shape)))
        return real(q, latent, *a, **kw)

    mla_mod.paged_latent_attention = spy
    try:
        outs = {}
        for key in (300, 1 << 20):
            seen[key] = []
            engine = make_engine(model, max_num_seqs=3, max_model_len=key, num_blocks=64, use_cuda_graphs=graphs)
            outs[key] = [o.outputs[0].token_ids for o in engine.generate(prompts, greedy(8))]
    finally:
        mla_mod.paged_latent_attention = real
    assert seen[300] == seen[1 << 20] and len(seen[300]) > 8
    # keys attended: the cached ones (eager), or their span bucket of 16 blocks of 16 (a graph's static form)
    assert max(span for span, _ in seen[300]) <= (16 * 16 if graphs else 150 + 8)
    assert outs[300] == outs[1 << 20] == reference_tokens(model, prompts, greedy(8))
