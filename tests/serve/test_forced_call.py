"""A forced tool call (tool_choice required or named): the opening the grammar allows alone (the channel markers, the
call header, the JSON up to its first free value) is written into the prompt and prefilled, not sampled one decode
step at a time; it is output all the same (counted in completion_tokens and max_tokens), and the call it opens is
the one sampling it would have given."""

from __future__ import annotations

import httpx
import pytest
import torch

import kimik3
from kimik3.inference.constraints import GrammarConstraint, GrammarVocab, tool_call_grammar
from kimik3.inference.engine import Engine, EngineConfig
from kimik3.presets import DEMO_MODEL
from kimik3.serve import Server, ServerConfig
from tests.serve.conftest import running

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def served(demo_tok):
    model = kimik3.load(DEMO_MODEL, dtype=torch.float32, text_only=True, quiet=True).eval()
    engine = Engine(model, EngineConfig(max_num_seqs=4, max_num_batched_tokens=256), eos_token_ids=(demo_tok.eos_id,),
                    tokenizer=demo_tok)
    server = Server(ServerConfig(model_name="demo"))
    server.attach(engine, demo_tok, vocab_size=model.config.text.vocab_size)
    with running(server) as url:
        yield url, engine


def _opening(demo_tok) -> list[int]:
    vocab = GrammarVocab(demo_tok)
    return GrammarConstraint(vocab, vocab.compile(tool_call_grammar([("get_weather", CITY)], thinking=True))).forced()


def test_the_opening_is_written_and_counted_but_not_sampled(served, demo_tok):
    url, engine = served
    opening = _opening(demo_tok)
    assert len(opening) >= 40 and demo_tok.decode(opening).endswith('{"city":"')
    before = engine.stats["generation_tokens_total"]
    body = {"messages": [{"role": "user", "content": "Weather in Verona?"}], "tools": [WEATHER],
            "tool_choice": NAMED, "max_tokens": 120, "temperature": 0}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
    sampled = engine.stats["generation_tokens_total"] - before
    assert r["usage"]["completion_tokens"] == len(opening) + sampled  # the opening is output, not engine steps
    choice = r["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["tool_calls"][0]["function"]["name"] == \
        "get_weather", choice
    # the same call with logprobs samples every token of it (each reported): the same tokens come out
    r2 = httpx.post(f"{url}/v1/chat/completions", json={**body, "logprobs": True}, timeout=120).json()
    assert r2["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == \
        choice["message"]["tool_calls"][0]["function"]["arguments"]
    assert engine.stats["generation_tokens_total"] - before - sampled == r2["usage"]["completion_tokens"]


def test_a_budget_inside_the_opening_ends_with_length(served, demo_tok):
    url, _ = served
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER], "tool_choice": NAMED,
            "max_tokens": 10, "temperature": 0}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
    c = r["choices"][0]
    assert c["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 10
    assert [(t["function"]["name"], t["function"]["arguments"]) for t in c["message"]["tool_calls"]] == [
        ("get_weather", "")]
