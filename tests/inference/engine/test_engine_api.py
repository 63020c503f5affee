"""The engine's surface: abort, refusals, limits, per-request sampling features, the constraint hook."""

from __future__ import annotations

import pytest
import torch

from kimik3.inference import SamplingParams
from kimik3.inference.engine import Request
from kimik3.inference.engine.request import accumulate
from kimik3.tokenizer.stops import StopDecoder
from tests.inference.engine.conftest import greedy, make_engine, random_prompts, reference_tokens


def drain(engine, outs: dict | None = None) -> dict:
    """Every request's whole output (the steps' deltas accumulated, into `outs` if given)."""
    outs = {} if outs is None else outs
    while engine.has_unfinished():
        accumulate(outs, engine.step())
    return outs


def test_abort_frees_before_the_next_forward(model):
    prompts = random_prompts(model.config.vocab_size, (40, 90), generator_seed=20)
    engine = make_engine(model)
    engine.add_request(Request("keep", prompts[0], greedy(6)))
    engine.add_request(Request("drop", prompts[1], greedy(50)))
    outs = {}
    accumulate(outs, engine.step())
    engine.abort("drop")
    engine.abort("never-seen")  # ignored
    assert engine.stats["running"] == 1 and engine.stats["aborts"] == 1
    first = engine.step()
    dropped = next(o for o in first if o.request_id == "drop")
    assert dropped.finished and dropped.outputs[0].finish_reason == "abort"
    accumulate(outs, first)
    drain(engine, outs)
    assert outs["keep"].outputs[0].token_ids == reference_tokens(model, prompts[:1], greedy(6))[0]
    assert len(engine.slots) == engine.pool.num_slots and len(engine.blocks) + sum(
        1 for r in engine.blocks.refs if r) == engine.pool.num_blocks


def test_refusals_name_the_problem(model):
    engine = make_engine(model, max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len 64"):
        engine.add_request(Request("long", [1] * 64, greedy()))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request(Request("empty", [], greedy()))
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request(Request("oov", [model.config.vocab_size], greedy()))
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine.add_request(Request("wide", [1, 2], greedy(n=9)))
    engine.add_request(Request("x", [1, 2], greedy()))
    with pytest.raises(ValueError, match="already running"):
        engine.add_request(Request("x", [1, 2], greedy()))
    with pytest.raises(ValueError, match="can never fit the MLA pool"):
        make_engine(model, num_blocks=4).add_request(Request("big", [1] * 40, greedy(30)))
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make_engine(model, max_num_batched_tokens=32)
    with pytest.raises(ValueError, match="block_size"):
        make_engine(model, block_size=24)


def test_length_stops_at_max_model_len(model):
    engine = make_engine(model, max_model_len=40)
    out = engine.generate([[3] * 36], greedy(50))[0]
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"


def test_stop_ids_eos_and_ignore_eos(model):
    prompt = random_prompts(model.config.vocab_size, (30,), generator_seed=21)[0]
    free = reference_tokens(model, [prompt], greedy(8))[0]
    stop = free[3]
    cut = free.index(stop) + 1
    out = make_engine(model, eos_token_ids=(stop,)).generate([prompt], greedy(8))[0].outputs[0]
    assert out.token_ids == free[:cut] and out.finish_reason == "stop" and out.stop_reason == stop
    out = make_engine(model, eos_token_ids=(stop,)).generate([prompt], greedy(8, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == free and out.finish_reason == "length"
    out = make_engine(model).generate([prompt], greedy(8, stop_token_ids=(stop,)))[0].outputs[0]
    assert out.token_ids == free[:cut]


def test_stop_strings_with_a_tokenizer(model):
    class Digits:
        def decode_bytes(self, ids):
            return "".join(f" {i}" for i in ids).encode()

    prompt = random_prompts(model.config.vocab_size, (30,), generator_seed=22)[0]
    free = reference_tokens(model, [prompt], greedy(8))[0]
    text = f" {free[2]} "
    out = make_engine(model, tokenizer=Digits()).generate([prompt], greedy(8, stop=(text,)))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == text and len(out.token_ids) <= 4


def test_logit_bias_and_penalties(model):
    prompt = random_prompts(model.config.vocab_size, (20,), generator_seed=23)[0]
    out = make_engine(model).generate([prompt], greedy(5, logit_bias=((7, 100.0),)))[0].outputs[0]
    assert out.token_ids == [7] * 5
    # a frequency penalty of 2 against a bias of 5: token 7 wins until its count outweighs the bias
    out = make_engine(model).generate([prompt], greedy(6, logit_bias={7: 5.0}, frequency_penalty=2.0))[0]
    toks = out.outputs[0].token_ids
    assert toks[0] == 7 and toks.count(7) < 6
    pres = make_engine(model).generate([prompt], greedy(6, logit_bias={7: 5.0}, presence_penalty=2.0))[0]
    assert pres.outputs[0].token_ids[0] == 7


def test_seeded_request_ignores_its_batch(model):
    V = model.config.vocab_size
    prompts = random_prompts(V, (25, 60, 9, 100), generator_seed=24)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_new_tokens=6)
    alone = make_engine(model).generate(prompts[:1], seeded)[0].outputs[0].token_ids
    mixed = make_engine(model).generate(prompts, [seeded] + [SamplingParams(temperature=1.2, max_new_tokens=9)] * 3)
    assert mixed[0].outputs[0].token_ids == alone


def test_token_constraint_masks_and_finishes(model):
    class EvenThenDone:
        """Only even ids, and complete after three tokens."""

        def __init__(self):
            self.seen = []

        def allowed(self):
            mask = torch.zeros(model.config.vocab_size, dtype=torch.bool)
            mask[::2] = True
            return mask

        def accept(self, token_id):
            self.seen.append(token_id)

        def is_finished(self):
            return len(self.seen) == 3

    prompt = random_prompts(model.config.vocab_size, (20,), generator_seed=25)[0]
    engine = make_engine(model)
    engine.add_request(Request("c", prompt, SamplingParams(temperature=1.0, max_new_tokens=10, n=2),
                               constraint_factory=EvenThenDone))
    out = drain(engine)["c"]
    for choice in out.outputs:
        assert len(choice.token_ids) == 3 and all(t % 2 == 0 for t in choice.token_ids)
        assert choice.finish_reason == "stop"


def test_metrics_and_stats(model):
    engine = make_engine(model)
    out = engine.generate(random_prompts(model.config.vocab_size, (80,), generator_seed=26), greedy(3))[0]
    m = out.metrics
    assert m["arrival"] <= m["first_token"] <= m["finished"] and m["queue_time"] >= 0
    s = engine.stats
    assert s["prompt_tokens_total"] == 80 and s["generation_tokens_total"] == 3
    assert s["kda_snapshots"] >= 1 and s["kda_snapshot_bytes"] > 0 and 0 <= s["cache_usage"] <= 1


class _Bytes:
    """A byte-level tokenizer: token = one byte of UTF-8 text, `decode` replaces incomplete characters (as the real
    one does); counts the tokens it decodes."""

    def __init__(self):
        self.decoded = 0

    def decode(self, ids):
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def decode_bytes(self, ids):
        self.decoded += len(ids)
        return bytes(ids)


def _first_stop_by_full_decode(decode, tokens, start, stops):
    """What the engine did before: decode the whole output after each token."""
    for end in range(start + 1, len(tokens) + 1):
        text = decode(tokens[start:end])
        hits = [(text.find(s), s) for s in stops if s in text]
        if hits:
            return end, min(hits)[1]
    return None


@pytest.mark.parametrize("seed", range(30))
def test_stop_decoder_equals_decoding_the_whole_output(seed):
    """The incremental matcher finds the same stop at the same token as decoding the whole output after each
    token, and shows exactly the text before it, over multi-byte text split into bytes, several stops, and
    stops that repeat earlier text."""
    gen = torch.Generator().manual_seed(seed)
    alphabet = ["a", "b", " ", "é", "漢", "🙂", "\n"]
    text = "".join(alphabet[i] for i in torch.randint(0, len(alphabet), (300,), generator=gen).tolist())
    tokens = [0, 1, 2] + list(text.encode())  # three prompt tokens, then the output's bytes
    pick = torch.randint(0, len(text) - 8, (3,), generator=gen).tolist()
    stops = [text[i: i + 1 + (i % 7)] for i in pick] + ["never"]
    tok = _Bytes()
    expected = _first_stop_by_full_decode(tok.decode, tokens, 3, stops)
    matcher, shown, found = StopDecoder(tok, stops), "", None
    for end in range(4, len(tokens) + 1):
        shown += matcher.push(tokens[end - 1: end])
        if matcher.hit is not None:
            found = (end, matcher.hit)
            break
    assert found == expected
    full = tok.decode(tokens[3: found[0]])
    assert shown == full[: full.find(found[1])]


def test_stop_decoder_cost_does_not_grow_with_the_output():
    """A 20,000-token output with a stop that never comes: each token is decoded once (decoding the whole output
    after each token would be 200 million)."""
    tok, tokens = _Bytes(), list(b"ab" * 10_000)
    matcher = StopDecoder(tok, ["zz", "a b"])
    shown = "".join(matcher.push([t]) for t in tokens) + matcher.flush()
    assert matcher.hit is None and shown == "ab" * 10_000
    assert tok.decoded == len(tokens)


def test_a_warming_engine_captures_its_graphs_first(model, monkeypatch):
    """warmup=True captures every bucket's graphs before the warm-up's steps (`kimik3 serve`); without it none is
    captured at the start (`ModelRunner.capture_graphs`; on the CPU it captures nothing, on CUDA the GPU test
    checks the graphs)."""
    from kimik3.inference.engine.runner import ModelRunner

    calls = []
    monkeypatch.setattr(ModelRunner, "capture_graphs", lambda self: calls.append("capture"))
    monkeypatch.setattr(ModelRunner, "warmup", lambda self, n: calls.append("warmup"))
    make_engine(model)
    assert calls == []
    make_engine(model, warmup=True)
    assert calls == ["capture", "warmup"]
