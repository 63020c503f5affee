"""The demo model with its shipped drafter and with suffix decoding, in the engine: greedy == no speculation, token
for token, at batch 1 and 3; the drafter is accepted; after a prefix-cache hit (no taps for the restored prefix) the
drafter resumes from its record of an earlier or a running sequence, and without one drafts from the context after
the restored prefix."""

import pytest
import torch

import kimik3
from kimik3.inference.engine import Engine, EngineConfig, SpeculativeConfig
from kimik3.inference.sampling import SamplingParams
from kimik3.presets import DEMO_DRAFTER, DEMO_MODEL
from kimik3.tokenizer import Tokenizer
from tests.helpers import rel_err

PROMPTS = ["ROMEO:\nO, she doth teach the torches to burn bright!", "KING HENRY:\nOnce more unto the breach,",
           "HAMLET:\nTo be, or not to be, that is the question:\nHAMLET:\nTo be, or not to be,"]
METHODS = {"draft": SpeculativeConfig("draft", str(DEMO_DRAFTER), 7, adaptive=False),
           "suffix": SpeculativeConfig("suffix", None, 5, adaptive=False)}


@pytest.fixture(scope="module")
def demo():
    lm = kimik3.load(DEMO_MODEL, dtype=torch.float32, text_only=True, quiet=True).language_model.eval()
    tok = Tokenizer.from_file(DEMO_MODEL / "tiktoken.model")
    return lm, [tok.encode(p) for p in PROMPTS]


def _engine(lm, **kw):
    return Engine(lm, EngineConfig(max_num_seqs=4, max_num_batched_tokens=128, max_model_len=256, poison=True, **kw))


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def _contexts(drafter) -> dict:
    """The drafter's context of each sequence it has seen, running or finished, by its tokens."""
    running = {tuple(drafter.ids[i][: len(c)]): c for i, c in drafter.ctx.items()}
    return {**drafter.kept, **running}


@pytest.mark.parametrize("method,graphs", [("draft", False), ("draft", True), ("suffix", False)])
def test_demo_greedy_equals_non_speculative(demo, method, graphs):
    """graphs=True: the graphs' static steps (run eagerly on the CPU) hand the drafter the taps they recorded."""
    lm, prompts = demo
    params = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
    ref = _ids(_engine(lm).generate(prompts, params))
    together = _engine(lm, speculative=METHODS[method], use_cuda_graphs=graphs)
    assert _ids(together.generate(prompts, params)) == ref  # batch 3
    if method == "draft" and graphs:  # the drafter read the same taps as from eager steps, rows of every length
        runs = [_engine(lm, speculative=METHODS[method], use_cuda_graphs=g) for g in (True, False)]
        for e in runs:
            e.speculator.proposer.min_confidence = 0.6  # drafts of every length: padded graph rows
            assert _ids(e.generate(prompts, params)) == ref
        together, eager = runs
        got, want = (_contexts(e.speculator.proposer) for e in (together, eager))
        assert got.keys() == want.keys() and len(want) == 3
        for key in want:
            assert rel_err(got[key], want[key]) < 1e-5
    alone = _engine(lm, speculative=METHODS[method], use_cuda_graphs=graphs)
    assert [_ids(alone.generate([p], params))[0] for p in prompts] == ref  # batch 1
    if method == "draft":
        assert alone.speculator.stats.mean_accepted_length > 1.5
    assert any(L > 1 for _, _, L in alone.runner.graphs) == graphs


def test_drafter_after_a_prefix_hit_stays_exact_and_drafts(demo):
    lm, prompts = demo
    params = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
    long = prompts[2] * 3  # past the 64-token grid: its second run restores a snapshot
    ref = _ids(_engine(lm).generate([long], params))
    engine = _engine(lm, speculative=METHODS["draft"])
    first = _ids(engine.generate([long], params))
    drafts = engine.stats["spec_decode_num_drafts"]
    again = engine.generate([long], params)
    assert again[0].cached_tokens > 0 and first == _ids(again) == ref
    # the drafter resumes from its context of the first run (the target never computed the restored prefix)
    assert engine.stats["spec_decode_num_drafts"] > drafts
    # a restored prefix it holds no record of: exact, and it drafts from the context after the prefix
    warm = _engine(lm, speculative=METHODS["draft"])
    warm.speculator.proposer.keep_bytes = 0  # keeps no finished sequence's context
    warm.generate([long], params)
    drafts, accepted = warm.stats["spec_decode_num_drafts"], warm.stats["spec_decode_num_accepted_tokens"]
    again = warm.generate([long], params)
    assert again[0].cached_tokens > 0 and _ids(again) == ref
    assert warm.stats["spec_decode_num_drafts"] > drafts
    assert warm.stats["spec_decode_num_accepted_tokens"] > accepted


def test_a_request_restored_from_a_running_ones_prefix_drafts_with_its_context(demo):
    """Requests sharing a prompt side by side: the second, admitted while the first runs, restores the first's
    snapshot and takes the first's drafter context for those positions."""
    from kimik3.inference.engine import Request
    from kimik3.inference.engine.request import accumulate

    lm, prompts = demo
    params = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
    first, second = prompts[2] * 3, prompts[2] * 3 + prompts[0]
    ref = _ids(_engine(lm).generate([first, second], params))
    engine = _engine(lm, speculative=METHODS["draft"])
    proposer = engine.speculator.proposer
    engine.add_request(Request("a", first, params))
    done: dict = {}
    accumulate(done, engine.step())  # the first's prompt, its snapshots in the prefix cache
    assert engine.has_unfinished()
    engine.add_request(Request("b", second, params))
    while engine.has_unfinished():
        accumulate(done, engine.step())
    assert done["b"].cached_tokens > 0 and [done[r].outputs[0].token_ids for r in "ab"] == ref
    (b,) = [t.id for seq, t in engine.speculator.tracks.items() if seq.tokens[: len(second)] == second]
    # a context from position 0 (its first 64 positions the running first's), not one after the restored prefix
    assert proposer.start.get(b, 0) == 0 and len(proposer.ctx[b]) == len(proposer.ids[b]) - 1


def test_json_schema_output_with_speculation_equals_without(demo):
    """Structured output composes with suffix decoding: the grammar's masks per verification row, the grammar
    advanced by committed tokens only; the same schema-valid JSON as without speculation, and drafts accepted."""
    import json

    from kimik3.inference.constraints import GrammarConstraint, GrammarVocab, json_grammar
    from kimik3.inference.engine import Request
    from kimik3.inference.engine.request import accumulate
    from kimik3.tokenizer import parse_response

    lm, _ = demo
    tok = Tokenizer.from_file(DEMO_MODEL / "tiktoken.model")
    vocab = GrammarVocab(tok, vocab_size=lm.config.vocab_size)
    schema = {"type": "object", "properties": {"a": {"enum": ["ROMEO", "JULIET"]}, "b": {"enum": ["ROMEO", "JULIET"]},
                                               "c": {"enum": ["ROMEO", "JULIET"]}},
              "required": ["a", "b", "c"], "additionalProperties": False}
    grammar = vocab.compile(json_grammar(schema, thinking=False))
    prompt = tok.encode('{"a": "ROMEO", "b": "ROMEO", "c": "ROMEO"}\n{"a": "ROMEO", "b": "ROMEO", "c": "ROMEO"}\n')
    params = SamplingParams(temperature=0, max_new_tokens=60)

    def go(engine):
        engine.add_request(Request("r", prompt, params, constraint=GrammarConstraint(vocab, grammar)))
        done: dict = {}
        while engine.has_unfinished():
            accumulate(done, engine.step())
        return done["r"].outputs[0]

    off = go(_engine(lm))
    engine = _engine(lm, speculative=METHODS["suffix"])
    on = go(engine)
    assert on.token_ids == off.token_ids and on.finish_reason == off.finish_reason == "stop"
    parsed = parse_response(tok, on.token_ids, start_in="response")
    assert set(json.loads(parsed.content)) == {"a", "b", "c"}
    assert engine.stats["spec_decode_num_accepted_tokens"] > 0
