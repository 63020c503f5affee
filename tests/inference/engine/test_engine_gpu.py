"""The engine on the GPU (fla varlen KDA from per-slot states, MLA over paged latents, CUDA-graphed decode):
== full forwards without a cache and == the same engine on the CPU reference, prefix hits included."""

import json

import pytest
import torch

from kimik3.config import K3Config
from kimik3.inference import SamplingParams
from kimik3.inference.engine import Engine, EngineConfig, Request
from kimik3.inference.engine.request import accumulate
from kimik3.inference.spec.offline import greedy_reference
from kimik3.model import K3ForCausalLM
from tests.helpers import CONFIGS, randomize, rel_err, requires_cuda

pytestmark = [pytest.mark.gpu, requires_cuda]


@pytest.fixture(scope="module")
def cfg():
    d = json.loads((CONFIGS / "tiny.json").read_text())
    d["text_config"]["linear_attn_config"]["head_dim"] = 64  # fla wants a power-of-two head dim >= 32
    return K3Config.from_hf(d).text


@pytest.fixture(scope="module")
def models(cfg):
    """(CPU fp32, GPU fp32, GPU bf16) with one set of weights. CUDA graphs need the bf16 model: fp32 routed
    experts run the reference loop, which reads expert counts on the host."""
    cpu = randomize(K3ForCausalLM(cfg, torch.float32), seed=61).eval()
    out = [cpu]
    for dtype in (torch.float32, torch.bfloat16):
        m = K3ForCausalLM(cfg, dtype)
        m.load_state_dict(cpu.state_dict())
        out.append(m.cuda().eval())
    return out


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 300, (n,), generator=g).tolist() for n in lengths]


def engine(model, **kw):
    args = dict(max_num_seqs=8, max_num_batched_tokens=128, max_model_len=512, block_size=16, snapshot_interval=64,
                poison=True)
    own = {k: kw.pop(k) for k in ("eos_token_ids", "tokenizer", "sync_tokens", "adapters") if k in kw}
    return Engine(model, EngineConfig(**{**args, **kw}), **own)


@torch.no_grad()
def test_gpu_engine_logprobs_match_cpu_engine(models):
    """Mixed lengths, chunked prefill (fla varlen from per-slot states), MLA over paged latents: the GPU engine
    agrees with the CPU engine on the reference ops (fp32, IEEE dots)."""
    cpu, gpu, _ = models
    ps = prompts((5, 70, 130, 64, 1, 200, 33, 128))
    params = SamplingParams(temperature=0, max_new_tokens=8, logprobs=2)
    ref = engine(cpu).generate(ps, params)
    got = engine(gpu).generate(ps, params)
    same = sum(r.outputs[0].token_ids == g.outputs[0].token_ids for r, g in zip(ref, got))
    assert same >= 7, f"{same} of 8 greedy sequences equal"
    for r, g in zip(ref, got):
        n = next((i for i, (a, b) in enumerate(zip(r.outputs[0].token_ids, g.outputs[0].token_ids)) if a != b), 8)
        a = torch.tensor([lp.logprob for lp in r.outputs[0].logprobs[:n + 1]])
        b = torch.tensor([lp.logprob for lp in g.outputs[0].logprobs[:n + 1]])
        assert rel_err(b, a) < 1e-3


@torch.no_grad()
def test_gpu_engine_equals_full_forwards(models):
    """fp32 on fla's kernels against full forwards without a cache (an oracle independent of the engine, which
    `generate()` is): the two batch differently (GEMM blocking), so a near tie may part a sequence (exact once the
    kernels are batch-invariant, issue 39); up to where they part, logprobs agree."""
    _, gpu, _ = models
    ps = prompts((12, 40, 90, 7), seed=1)
    params = SamplingParams(temperature=0, max_new_tokens=10, logprobs=0)
    want = [greedy_reference(gpu, p, 10) for p in ps]
    got = engine(gpu).generate(ps, params)
    assert sum(w == g.outputs[0].token_ids for w, g in zip(want, got)) >= 3
    for p, w, g in zip(ps, want, got):
        ids = g.outputs[0].token_ids
        n = next((i for i, (a, b) in enumerate(zip(w, ids)) if a != b), 10)
        full = gpu(torch.tensor([p + ids[:-1]], device="cuda"))[0, len(p) - 1:].float().log_softmax(-1).cpu()
        ref = full.gather(1, torch.tensor(ids)[:, None])[:, 0][:n + 1]
        assert rel_err(torch.tensor([lp.logprob for lp in g.outputs[0].logprobs[:n + 1]]), ref) < 1e-3


@torch.no_grad()
def test_gpu_prefix_hit_is_exact(models):
    """A warm request restored from a chunk-end snapshot on the grid computes the cold one's tokens."""
    _, gpu, _ = models
    head, t1, t2 = prompts((128, 20, 25), seed=2)
    params = SamplingParams(temperature=0, max_new_tokens=6, logprobs=1)
    eng = engine(gpu)
    cold = eng.generate([head + t2], params)[0]  # its chunk end at 128 is snapshot
    eng.generate([head + t1], params)
    warm = eng.generate([head + t2], params)[0]
    assert warm.cached_tokens == 128 and cold.cached_tokens == 0
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    a = torch.tensor([lp.logprob for lp in cold.outputs[0].logprobs])
    b = torch.tensor([lp.logprob for lp in warm.outputs[0].logprobs])
    assert rel_err(b, a) < 1e-4


@torch.no_grad()
def test_graphed_decode_equals_eager_engine(models):
    """bf16: the replayed decode steps (keys over the whole block table, padding rows on scratch) == eager ones."""
    *_, gpu = models
    ps = prompts((30, 50, 9), seed=3)
    params = SamplingParams(temperature=0, max_new_tokens=12, logprobs=0)
    graphed = engine(gpu, use_cuda_graphs=True, warmup=True)  # every bucket's graph captured at the start
    assert graphed.runner.sizes == [1, 2, 4, 8] and sorted(graphed.runner.graphs) == [(n, 16, 1) for n in (1, 2, 4, 8)]
    a = graphed.generate(ps, params)
    b = engine(gpu, use_cuda_graphs=False).generate(ps, params)
    for x, y in zip(a, b):
        n = next((i for i, (p, q) in enumerate(zip(x.outputs[0].token_ids, y.outputs[0].token_ids)) if p != q), 12)
        assert n >= 6, f"graphed and eager decodes part after {n} tokens"
        assert rel_err(torch.tensor([lp.logprob for lp in x.outputs[0].logprobs[:n + 1]]),
                       torch.tensor([lp.logprob for lp in y.outputs[0].logprobs[:n + 1]])) < 2e-2


@torch.no_grad()
def test_graphs_are_captured_when_first_needed_without_warmup(models):
    """An engine that does not warm up captures no graph at the start (a single prompt's first token does not wait
    for them); its steps capture the bucket they need, and decode as the warmed engine's replays do."""
    *_, gpu = models
    ps = prompts((30, 50, 9), seed=3)
    params = SamplingParams(temperature=0, max_new_tokens=12, logprobs=0)
    lazy = engine(gpu, use_cuda_graphs=True)
    assert lazy.runner.graphs == {}
    a = lazy.generate(ps, params)
    assert sorted(lazy.runner.graphs) == [(4, 16, 1)]  # three decoding rows, the 4-row bucket
    b = engine(gpu, use_cuda_graphs=True, warmup=True).generate(ps, params)
    assert [x.outputs[0].token_ids for x in a] == [y.outputs[0].token_ids for y in b]
    assert [[lp.logprob for lp in x.outputs[0].logprobs] for x in a] == [[lp.logprob for lp in y.outputs[0].logprobs]
                                                                          for y in b]


@torch.no_grad()
def test_abort_under_graphs(models):
    *_, gpu = models
    eng = engine(gpu)
    for i, p in enumerate(prompts((20, 30), seed=4)):
        eng.add_request(Request(str(i), p, SamplingParams(temperature=0, max_new_tokens=30)))
    eng.step()
    eng.step()
    eng.abort("0")
    outs = {}
    while eng.has_unfinished():
        accumulate(outs, eng.step())
    assert outs["1"].outputs[0].finish_reason == "length" and len(eng.slots) == 8


def _logprobs(outs) -> list[list[float]]:
    return [[lp.logprob for lp in o.outputs[0].logprobs] for o in outs]


@torch.no_grad()
def test_graphed_decode_equals_eager_engine_deterministic(models):
    """The test above made exact (issue 39): in the batch-invariant mode graphed and eager decode steps run the same
    sums whatever their padding and span, so tokens and logprobs agree bit for bit."""
    *_, gpu = models
    ps = prompts((30, 50, 9), seed=3)
    params = SamplingParams(temperature=0, max_new_tokens=12, logprobs=0)
    a = engine(gpu, use_cuda_graphs=True, deterministic=True).generate(ps, params)
    b = engine(gpu, use_cuda_graphs=False, deterministic=True).generate(ps, params)
    assert [x.outputs[0].token_ids for x in a] == [y.outputs[0].token_ids for y in b]
    assert _logprobs(a) == _logprobs(b)


def _oracle_run(model, ps, params, p, k, graphs, adaptive=False, **kw):
    """(the run without speculation, the run with an oracle right with probability p at k (`adaptive`: up to k, the
    engine choosing), its engine); `kw` more EngineConfig fields for both."""
    from kimik3.inference.engine import SpeculativeConfig
    from kimik3.inference.spec.oracle import OracleProposer

    ref = engine(model, use_cuda_graphs=graphs, **kw).generate(ps, params)
    oracle = OracleProposer([q + r.outputs[0].token_ids for q, r in zip(ps, ref)], p, 300, seed=2)
    eng = engine(model, use_cuda_graphs=graphs, speculative=SpeculativeConfig(oracle, None, k, adaptive=adaptive),
                 **kw)
    return ref, eng.generate(ps, params), eng


@torch.no_grad()
def test_speculative_eager_fp32_equals_non_speculative(models):
    """fp32 on fla's kernels: drafted rows verified by the chunked kernel, their slots written by `commit`."""
    _, gpu, _ = models
    ps = prompts((30, 50, 9), seed=5)
    params = SamplingParams(temperature=0, max_new_tokens=16, logprobs=0)
    ref, out, eng = _oracle_run(gpu, ps, params, 0.6, 4, graphs=False)
    assert eng.stats["spec_decode_num_accepted_tokens"] > 0
    for x, y in zip(out, ref):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert rel_err(torch.tensor([lp.logprob for lp in x.outputs[0].logprobs]),
                       torch.tensor([lp.logprob for lp in y.outputs[0].logprobs])) < 1e-4


@torch.no_grad()
def test_speculative_verification_graphs_bf16(models):
    """bf16: drafted steps replay the verification graphs (rows padded to 1 + k) and agree with the graphed run
    without speculation as the graphed and eager decodes agree (bf16 sums may part them near a tie)."""
    *_, gpu = models
    ps = prompts((30, 50, 9), seed=3)
    params = SamplingParams(temperature=0, max_new_tokens=16, logprobs=0)
    ref, out, eng = _oracle_run(gpu, ps, params, 0.7, 4, graphs=True, warmup=True)
    assert sorted(k for k in eng.runner.graphs if k[2] > 1) == [(n, 16, 5) for n in (1, 2, 4, 8)]
    assert sorted(eng.runner.commit_graphs) == [(n, 5) for n in (1, 2, 4, 8)]
    assert eng.stats["spec_decode_num_accepted_tokens"] > 0
    for x, y in zip(out, ref):
        n = next((i for i, (p, q) in enumerate(zip(x.outputs[0].token_ids, y.outputs[0].token_ids)) if p != q), 16)
        assert n >= 6, f"speculative and plain decodes part after {n} tokens"
        assert rel_err(torch.tensor([lp.logprob for lp in x.outputs[0].logprobs[:n + 1]]),
                       torch.tensor([lp.logprob for lp in y.outputs[0].logprobs[:n + 1]])) < 2e-2


@pytest.mark.parametrize("adaptive", [False, True])
@torch.no_grad()
def test_speculative_verification_graphs_bf16_deterministic(models, adaptive):
    """The test above made exact (issue 39): in the batch-invariant mode a verification row computes the logits of
    the decode row it replaces, so greedy tokens equal the plain run's, at k = 4 and with the engine choosing k up to
    7 (graphs of 2, 4 and 8 tokens a row)."""
    *_, gpu = models
    ps = prompts((30, 50, 9), seed=3)
    params = SamplingParams(temperature=0, max_new_tokens=16, logprobs=0)
    ref, out, eng = _oracle_run(gpu, ps, params, 0.7, 7 if adaptive else 4, graphs=True, adaptive=adaptive,
                                deterministic=True)
    assert eng.stats["spec_decode_num_accepted_tokens"] > 0
    assert [x.outputs[0].token_ids for x in out] == [y.outputs[0].token_ids for y in ref]
    if adaptive:
        assert eng.speculator.lengths.costs.table, "the engine timed its steps"


@torch.no_grad()
def test_verification_graphs_of_several_k_in_one_process(models):
    """Engines of k = 7, then 3, then 1 and 5 capture their verification graphs one after another in one process
    (bench_spec's k=3 row after its k=7 rows failed with cudaErrorStreamCaptureInvalidated), each with the earlier
    engines dropped; each runs to the end and accepts drafts (the test above compares the tokens)."""
    *_, gpu = models
    ps = prompts((30, 9, 50, 17, 12), seed=11)
    params = SamplingParams(temperature=0, max_new_tokens=12)
    for k in (7, 3, 1, 5):
        ref, out, eng = _oracle_run(gpu, ps, params, 0.7, k, graphs=True)
        assert any(key[2] == 1 + k for key in eng.runner.graphs)
        assert [len(x.outputs[0].token_ids) for x in out] == [12] * len(ps)
        assert eng.stats["spec_decode_num_accepted_tokens"] > 0
        del ref, out, eng
