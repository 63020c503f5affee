"""Speculation keeps greedy tokens in bf16 on the CPU: the shipped demo model in its checkpoint's bf16, greedy with
suffix decoding and with the shipped drafter at k = 1..7 equals greedy without speculation, token for token, at the
engine's defaults (`kimik3 generate --speculative-method draft` printed other text in bf16: the short conv's decode
op summed its taps in another order than verification rows, and eager verification rows ran the chunked KDA kernel
where decode runs the recurrent one)."""

from __future__ import annotations

import pytest
import torch

import kimik3
from kimik3.inference.engine import Engine, EngineConfig, SpeculativeConfig
from kimik3.inference.sampling import SamplingParams
from kimik3.presets import DEMO_DRAFTER, DEMO_MODEL
from kimik3.quant import relayout_experts
from kimik3.tokenizer import Tokenizer
from tests.helpers import requires_cuda

PROMPTS = ["ROMEO:", "KING HENRY:\nOnce more unto the breach,"]
PARAMS = SamplingParams(temperature=0, max_new_tokens=96, ignore_eos=True)
CONFIG = dict(max_num_seqs=1, max_model_len=512)  # one prompt, as `kimik3 generate` runs it; the rest the defaults


def _demo(device: str):
    lm = kimik3.load(DEMO_MODEL, text_only=True, quiet=True, device=device).language_model.eval()
    assert lm.lm_head.weight.dtype == torch.bfloat16  # the checkpoint's dtype, what a user gets
    relayout_experts(lm)  # as `load_engine` (kimik3 generate) does: Humming's kernels where they run
    prompts = [Tokenizer.from_file(DEMO_MODEL / "tiktoken.model").encode(p) for p in PROMPTS]
    return lm, prompts, tokens(lm, prompts, None)


@pytest.fixture(scope="module")
def demo():
    return _demo("cpu")


@pytest.fixture(scope="module")
def demo_gpu():
    return _demo("cuda")


def spec(method: str | None, k: int, adaptive: bool = False) -> SpeculativeConfig | None:
    """Speculation by `method` (None: off) at k, fixed (the tests at a given k) or (`adaptive`) the ceiling of the
    engine's own choice."""
    if method is None:
        return None
    return SpeculativeConfig(method, str(DEMO_DRAFTER) if method == "draft" else None, k, adaptive=adaptive)


def tokens(lm, prompts, speculative: SpeculativeConfig | None) -> list[list[int]]:
    engine = Engine(lm, EngineConfig(**CONFIG, speculative=speculative))
    return [engine.generate([p], PARAMS)[0].outputs[0].token_ids for p in prompts]


@pytest.mark.parametrize("k", [1, 3, 7, *(pytest.param(k, marks=pytest.mark.slow) for k in (2, 4, 5, 6))])
@pytest.mark.parametrize("method", ["suffix", "draft"])
def test_speculative_greedy_is_plain_greedy_in_bf16(demo, method, k):
    lm, prompts, want = demo
    cfg = spec(method, k)
    assert tokens(lm, prompts, cfg) == want


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("k", range(1, 8))
@pytest.mark.parametrize("method", ["suffix", "draft"])
def test_speculative_greedy_is_plain_greedy_in_bf16_gpu(demo_gpu, method, k):
    """The same on CUDA at the engine's defaults there (CUDA graphs for decode and verification steps). On the H200
    on 2026-12-04 `kimik3 generate --prompt "ROMEO:"` printed one text with and without speculation (suffix k = 7,
    draft k = 3 and 7); this runs both prompts at every k."""
    lm, prompts, want = demo_gpu
    cfg = spec(method, k)
    assert tokens(lm, prompts, cfg) == want


@pytest.mark.parametrize("method", ["suffix", "draft"])
def test_speculative_greedy_with_k_chosen_is_plain_greedy_in_bf16(demo, method):
    """The engine choosing each step's k up to 7 (the default; the verification widths 2, 4 and 8 all met)."""
    lm, prompts, want = demo
    assert tokens(lm, prompts, spec(method, 7, adaptive=True)) == want


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("method", ["suffix", "draft"])
def test_speculative_greedy_with_k_chosen_is_plain_greedy_in_bf16_gpu(demo_gpu, method):
    lm, prompts, want = demo_gpu
    assert tokens(lm, prompts, spec(method, 7, adaptive=True)) == want


# a shared prefix of several snapshot-grid blocks: the second request restores the first's state from the prefix
# cache and computes only what follows it
SHARED = ("KING HENRY:\nOnce more unto the breach, dear friends, once more;\nOr close the wall up with our English "
          "dead.\nIn peace there's nothing so becomes a man\nAs modest stillness and humility:\nBut when the blast "
          "of war blows in our ears,\nThen imitate the action of the tiger;\nStiffen the sinews, summon up the "
          "blood,\nDisguise fair nature with hard-favour'd rage;\n")
HIT_PARAMS = SamplingParams(temperature=0, max_new_tokens=48, ignore_eos=True)


def after_a_hit(lm, speculative: SpeculativeConfig | None, **config) -> tuple[list[list[int]], int, int]:
    """Greedy tokens of two requests sharing SHARED, one after the other in one engine, how many prompt tokens the
    second found in the prefix cache, and how many drafts were verified for it."""
    tok = Tokenizer.from_file(DEMO_MODEL / "tiktoken.model")
    engine = Engine(lm, EngineConfig(**{**CONFIG, **config}, speculative=speculative))
    first = engine.generate([tok.encode(SHARED + "EXETER:")], HIT_PARAMS)[0]
    before = engine.speculator.stats.spec_decode_num_drafts if engine.speculator else 0
    second = engine.generate([tok.encode(SHARED + "BEDFORD:")], HIT_PARAMS)[0]
    drafts = (engine.speculator.stats.spec_decode_num_drafts if engine.speculator else 0) - before
    return [first.outputs[0].token_ids, second.outputs[0].token_ids], second.cached_tokens, drafts


@pytest.mark.parametrize("method,k", [("suffix", 7), ("draft", 3),
                                      *(pytest.param(m, k, marks=pytest.mark.slow)
                                        for m, k in (("suffix", 1), ("suffix", 3), ("draft", 1), ("draft", 7)))])
def test_speculative_greedy_after_a_prefix_hit_is_plain_greedy_in_bf16(demo, method, k):
    """After a prefix-cache hit (the second request restores the first's KDA and MLA state at a snapshot), greedy
    with speculation still equals greedy without it in bf16; the drafter resumes from the first request's context
    and drafts for the second (`DSparkProposer.resume`)."""
    lm = demo[0]
    want, hit, _ = after_a_hit(lm, None)
    assert hit >= 64, "the second request should restore the shared prefix from the cache"
    cfg = spec(method, k)
    got, hit_spec, drafts = after_a_hit(lm, cfg)
    assert hit_spec == hit
    assert drafts > 0, "the second request should speculate after its hit"
    assert got == want


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("k", [1, 3, 7])
@pytest.mark.parametrize("method", ["suffix", "draft"])
def test_speculative_greedy_after_a_prefix_hit_is_plain_greedy_in_bf16_gpu(demo_gpu, method, k):
    """The same on CUDA (graphed decode and verification steps). fla's kernels keep their chunk states inside, so
    on CUDA a snapshot is taken only where a prefill chunk ends (`supports_checkpoints`): chunks of 64 tokens end
    on every point of the snapshot grid, the first request's prompt included."""
    lm = demo_gpu[0]
    want, hit, _ = after_a_hit(lm, None, max_num_batched_tokens=64)
    assert hit >= 64
    cfg = spec(method, k)
    got, hit_spec, drafts = after_a_hit(lm, cfg, max_num_batched_tokens=64)
    assert (hit_spec, got) == (hit, want) and drafts > 0


# 16 requests of other lengths and output lengths: in one engine they prefill together, then decode (or verify) in
# steps whose row count falls as they finish apart, down to one
SPEAKERS = ["ROMEO:", "KING HENRY:\nOnce more unto the breach,", "JULIET:\nO Romeo, Romeo!",
            "HAMLET:\nTo be, or not to be", "MACBETH:\nIs this a dagger", "LEAR:\nBlow, winds,",
            "PROSPERO:\nOur revels now are ended.", "PORTIA:\nThe quality of mercy", "OTHELLO:\nIt is the cause",
            "BRUTUS:\nRomans, countrymen,", "ANTONY:\nFriends, Romans", "PUCK:\nIf we shadows have offended",
            "VIOLA:\nI left no ring with her", "RICHARD:\nNow is the winter", "IAGO:\nI am not what I am",
            "CLEOPATRA:\nGive me my robe"]
MIXED = [SamplingParams(temperature=0, max_new_tokens=12 + 2 * i, ignore_eos=True) for i in range(16)]


@pytest.fixture(scope="module")
def alone(demo):
    """The 16 prompts and each one's greedy tokens in an engine of its own (batch 1, no speculation)."""
    tok = Tokenizer.from_file(DEMO_MODEL / "tiktoken.model")
    prompts = [tok.encode(t) for t in SPEAKERS]
    return prompts, [Engine(demo[0], EngineConfig(**CONFIG)).generate([p], q)[0].outputs[0].token_ids
                     for p, q in zip(prompts, MIXED)]


@pytest.mark.parametrize("method,k,adaptive", [(None, 0, False), ("draft", 3, False), ("draft", 7, True),
                                               *(pytest.param(m, k, a, marks=pytest.mark.slow)
                                                 for m, k, a in (("suffix", 7, False), ("draft", 1, False),
                                                                 ("draft", 7, False), ("suffix", 3, False),
                                                                 ("suffix", 7, True)))])
def test_greedy_in_a_batch_of_16_is_greedy_alone_in_bf16(demo, alone, method, k, adaptive):
    """Batch invariance on the CPU in bf16: each of 16 mixed requests run together, without speculation and with it
    (at a fixed k, and with the engine choosing k each step up to it), gets the greedy tokens it gets alone (before
    the references summed each row alike in any batch, `kimik3.ops.rows`, the KDA step's matmul and the MLA value
    sum, every case here failed)."""
    prompts, want = alone
    cfg = spec(method, k, adaptive)
    engine = Engine(demo[0], EngineConfig(max_num_seqs=16, max_model_len=512, speculative=cfg))
    assert [o.outputs[0].token_ids for o in engine.generate(prompts, MIXED)] == want


def test_seeded_samples_in_a_batch_are_the_solo_samples_in_bf16(demo):
    """A seeded request's draws depend only on its own logits, and those no longer on its batch: four seeded
    requests sampled together give their solo tokens (before the references summed each row alike in any batch,
    three of these four parted from their solo runs)."""
    tok = Tokenizer.from_file(DEMO_MODEL / "tiktoken.model")
    prompts = [tok.encode(t) for t in ("ROMEO:", "JULIET:\nO Romeo,", "HAMLET:\nTo be", SPEAKERS[1])]
    params = [SamplingParams(temperature=1.0, seed=100 + i, max_new_tokens=48) for i in range(4)]
    solo = [Engine(demo[0], EngineConfig(**CONFIG)).generate([p], q)[0].outputs[0].token_ids
            for p, q in zip(prompts, params)]
    together = Engine(demo[0], EngineConfig(max_num_seqs=4, max_model_len=512)).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in together] == solo


@pytest.mark.parametrize("budget,beside", [(64, 0), (128, 0), (200, 0), (128, 1), (100, 1)])
def test_a_prompt_computes_the_same_bits_however_it_is_chunked_in_bf16(demo, budget, beside):
    """A 263-token prompt prefilled in one chunk, or cut by a smaller token budget (and by a request beside it),
    gives the same greedy tokens and the same logprobs bit for bit: MLA's path for a prompt position depends on the
    position (`prompt_expanded_until`), not on the chunk (by chunk length, the split prompt's tail took the latent
    path and logprobs parted by up to 7e-3)."""
    tok = Tokenizer.from_file(DEMO_MODEL / "tiktoken.model")
    prompt = tok.encode(SHARED * 3 + "EXETER:")
    assert len(prompt) > 256
    params = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True, logprobs=0)

    def run(budget: int, others: list[str]):
        engine = Engine(demo[0], EngineConfig(max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=1024,
                                              enable_prefix_cache=False))
        out = engine.generate([prompt] + [tok.encode(o) for o in others], params)[0].outputs[0]
        return out.token_ids, [lp.logprob for lp in out.logprobs]

    assert run(budget, SPEAKERS[3: 3 + beside]) == run(2048, [])


# on CUDA the default kernels pick their sums by the step's size (cuBLAS, MLA's splits, the MoE tiles): batch
# invariance there is the engine's `deterministic` mode (`kimik3.ops.matmul.batch_invariant`)
GPU_DETERMINISTIC = dict(max_model_len=512, deterministic=True)


@pytest.fixture(scope="module")
def alone_gpu(demo_gpu):
    """The 16 prompts and each one's greedy tokens alone on CUDA (batch 1, no speculation, deterministic)."""
    tok = Tokenizer.from_file(DEMO_MODEL / "tiktoken.model")
    prompts = [tok.encode(t) for t in SPEAKERS]
    return prompts, [Engine(demo_gpu[0], EngineConfig(max_num_seqs=1, **GPU_DETERMINISTIC)).generate([p], q)[0]
                     .outputs[0].token_ids for p, q in zip(prompts, MIXED)]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("method,k,adaptive", [(None, 0, False), ("suffix", 1, False), ("suffix", 3, False),
                                               ("suffix", 7, False), ("draft", 1, False), ("draft", 3, False),
                                               ("draft", 7, False), ("suffix", 7, True), ("draft", 7, True)])
def test_greedy_in_a_batch_of_16_is_greedy_alone_in_bf16_gpu(demo_gpu, alone_gpu, method, k, adaptive):
    """Batch invariance on CUDA in bf16 (`deterministic`): each of 16 mixed requests run together, without
    speculation and with it (fixed k, and k chosen by the engine each step up to 7: verification graphs of widths
    2, 4 and 8), gets the greedy tokens it gets alone; the steps' row counts fall from 16 (or 16 x (1 + k)
    verification rows) to 1 as the requests finish apart, through graphed and eager steps."""
    prompts, want = alone_gpu
    cfg = spec(method, k, adaptive)
    engine = Engine(demo_gpu[0], EngineConfig(max_num_seqs=16, **GPU_DETERMINISTIC, speculative=cfg))
    got = [o.outputs[0].token_ids for o in engine.generate(prompts, MIXED)]
    assert [i for i in range(16) if got[i] != want[i]] == []


@pytest.mark.gpu
@requires_cuda
def test_seeded_samples_in_a_batch_are_the_solo_samples_in_bf16_gpu(demo_gpu):
    """Seeded draws in a batch equal the solo draws on CUDA (`deterministic`)."""
    tok = Tokenizer.from_file(DEMO_MODEL / "tiktoken.model")
    prompts = [tok.encode(t) for t in ("ROMEO:", "JULIET:\nO Romeo,", "HAMLET:\nTo be", SPEAKERS[1])]
    params = [SamplingParams(temperature=1.0, seed=100 + i, max_new_tokens=48) for i in range(4)]
    solo = [Engine(demo_gpu[0], EngineConfig(max_num_seqs=1, **GPU_DETERMINISTIC)).generate([p], q)[0]
            .outputs[0].token_ids for p, q in zip(prompts, params)]
    together = Engine(demo_gpu[0], EngineConfig(max_num_seqs=4, **GPU_DETERMINISTIC)).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in together] == solo


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("method,k", [("suffix", 7), ("draft", 3)])
def test_verification_graphs_past_16_rows_gpu(demo_gpu, method, k):
    """32 requests at once (`deterministic`): verification steps of up to 32 rows replay graphs of 32 (the buckets
    whose saved KDA inputs fit `graphs.VERIFY_BUFFER_BYTES`), and greedy with speculation equals greedy without it."""
    tok = Tokenizer.from_file(DEMO_MODEL / "tiktoken.model")
    prompts = [tok.encode(t) for t in SPEAKERS * 2]
    params = MIXED + [SamplingParams(temperature=0, max_new_tokens=20 + i, ignore_eos=True) for i in range(16)]
    want = Engine(demo_gpu[0], EngineConfig(max_num_seqs=32, **GPU_DETERMINISTIC)).generate(prompts, params)
    cfg = spec(method, k)
    engine = Engine(demo_gpu[0], EngineConfig(max_num_seqs=32, **GPU_DETERMINISTIC, speculative=cfg))
    assert 32 in engine.runner.verify_sizes  # a 32-row verification graph
    got = engine.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
