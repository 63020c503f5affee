"""`kimik3 serve`'s stack on the real engine and the shipped Shakespeare demo model (fp32, CPU): what HTTP returns
equals what the engine computes in-process, concurrency changes nothing, the prefix cache is reported and exact,
structured output holds, a gone client frees its slot."""

from __future__ import annotations

import json
import threading
import time

import httpx
import jsonschema
import openai
import pytest
import torch

import kimik3
from kimik3.inference.engine import Engine, EngineConfig
from kimik3.inference.sampling import SamplingParams
from kimik3.presets import DEMO_MODEL
from kimik3.serve import Server, ServerConfig
from kimik3.tokenizer import encode_chat, parse_response
from tests.serve.conftest import running

MODEL = "k3-shakespeare"
LINES = ["Speak, friend.", "What news on the Rialto?", "Is this a dagger?", "Friends, Romans, countrymen",
         "Now is the winter", "O Romeo, Romeo", "To be, or not to be", "Once more unto the breach"]


@pytest.fixture(scope="module")
def model():
    return kimik3.load(DEMO_MODEL, dtype=torch.float32, text_only=True, quiet=True).eval()


def _engine(model, tok):
    return Engine(model, EngineConfig(max_num_seqs=8, max_num_batched_tokens=512), eos_token_ids=(tok.eos_id,),
                  tokenizer=tok)


@pytest.fixture(scope="module")
def served(model, demo_tok):
    server = Server(ServerConfig(model_name=MODEL))
    engine = _engine(model, demo_tok)
    server.attach(engine, demo_tok, vocab_size=model.config.text.vocab_size)
    with running(server) as url:
        yield url, engine, server


def _client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def _close(a: list[float], b: list[float]) -> bool:
    return torch.allclose(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64), rtol=1e-5,
                          atol=1e-5)


def test_greedy_http_equals_in_process_and_concurrency_8_equals_sequential(served, model, demo_tok):
    url, _, _ = served
    prompts = [encode_chat(demo_tok, [{"role": "user", "content": line}]) for line in LINES]
    ref = _engine(model, demo_tok).generate(prompts, SamplingParams(temperature=0, max_new_tokens=6, logprobs=1))
    client = _client(url)

    def ask(ids):
        r = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0, logprobs=1,
                                      extra_body={"skip_special_tokens": False})
        return r.choices[0]

    sequential = [ask(p) for p in prompts]
    concurrent: list = [None] * len(prompts)
    threads = [threading.Thread(target=lambda k=k: concurrent.__setitem__(k, ask(prompts[k])))
               for k in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for want, got_seq, got_conc in zip(ref, sequential, concurrent):
        ids = want.outputs[0].token_ids
        want_lp = [lp.logprob for lp in want.outputs[0].logprobs]
        for got in (got_seq, got_conc):
            assert got.logprobs.tokens == [demo_tok.decode([t]) for t in ids]
            assert got.text == demo_tok.decode(ids)
            assert _close(got.logprobs.token_logprobs, want_lp)
    # the chat endpoint parses the same ids
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": LINES[0]}], max_tokens=6,
                                       temperature=0)
    parsed = parse_response(demo_tok, ref[0].outputs[0].token_ids)
    assert r.choices[0].message.content == parsed.content
    assert (r.choices[0].message.model_extra.get("reasoning_content") or "") == parsed.reasoning_content
    assert r.usage.prompt_tokens == len(prompts[0]) and r.usage.completion_tokens == 6


def test_repeated_prompt_reports_cached_tokens_and_identical_output(served, demo_tok):
    url, _, _ = served
    text = " ".join(LINES * 4)
    ids = demo_tok.encode(text)
    assert len(ids) > 130  # past two 64-token snapshot grid points
    client = _client(url)
    httpx.post(f"{url}/reset_prefix_cache").raise_for_status()
    runs = [client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0, logprobs=2)
            for _ in range(2)]
    assert runs[0].usage.prompt_tokens_details.cached_tokens == 0
    assert runs[1].usage.prompt_tokens_details.cached_tokens >= 128
    a, b = runs[0].choices[0], runs[1].choices[0]
    assert a.text == b.text and a.logprobs.tokens == b.logprobs.tokens
    assert _close(a.logprobs.token_logprobs, b.logprobs.token_logprobs)


def test_echo_prompt_logprobs_equal_a_full_forward(served, model, demo_tok):
    """What lm-eval's loglikelihood reads (echo + logprobs + max_tokens 1) equals log_softmax of one forward."""
    url, _, _ = served
    ids = demo_tok.encode("Now is the winter of our discontent made glorious summer")
    r = _client(url).completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0]  # [T, V]
    want = logits.double().log_softmax(-1)[:-1].gather(1, torch.tensor(ids[1:])[:, None]).flatten().tolist()
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids) + 1
    assert _close(lp.token_logprobs[1:len(ids)], want)
    greedy = logits[:-1].argmax(-1).tolist()
    for k, top in enumerate(lp.top_logprobs[1:len(ids)]):  # the most likely token is in each top dict
        assert demo_tok.decode([greedy[k]]) in top


SCHEMA = {"type": "object", "properties": {"mood": {"enum": ["merry", "sad", "wroth"]}, "act": {
    "type": "integer", "minimum": 1, "maximum": 5}, "verse": {"type": "boolean"}, "word": {"type": "string",
                                                                                           "maxLength": 8}},
          "required": ["mood", "act", "verse", "word"], "additionalProperties": False}


def test_structured_output_from_the_shakespeare_model(served):
    """A json_schema answer (streamed) and a named tool call, both schema-valid from a model that knows no JSON.
    (json_object is covered by tests/serve/test_constraints.py: its free-form keys let this model ramble inside
    a string until max_tokens, valid as far as it goes but unfinished.)"""
    url, _, _ = served
    client = _client(url)
    fmt = {"type": "json_schema", "json_schema": {"name": "scene", "schema": SCHEMA, "strict": True}}
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "Describe the scene."}], "max_tokens": 60,
          "seed": 3}
    chunks = list(client.chat.completions.create(**kw, response_format=fmt, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    jsonschema.validate(json.loads(content), SCHEMA)
    assert finish == ["stop"]
    tool = {"type": "function", "function": {"name": "summon", "parameters": SCHEMA}}
    r = client.chat.completions.create(**{**kw, "max_tokens": 120}, tools=[tool],
                                       tool_choice={"type": "function", "function": {"name": "summon"}})
    assert r.choices[0].message.content in ("", None), r
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "summon" and call.id
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)


def test_disconnect_frees_the_slot(served):
    url, engine, server = served
    aborts = engine.stats["aborts"]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Speak on."}], "max_tokens": 2000,
            "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
        for _ in zip(range(4), r.iter_lines()):
            pass
    deadline = time.monotonic() + 30
    while server.runner.stats.get("running", 1) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.runner.stats["running"] == 0 and server.runner.stats["aborts"] == aborts + 1
    assert server.runner._pending == 0


def _finished_by_reason(url: str, reason: str) -> float:
    lines = httpx.get(f"{url}/metrics").text.splitlines()
    return sum(float(line.split()[-1]) for line in lines
               if line.startswith("kimik3:request_success_total") and f'finish_reason="{reason}"' in line)


def test_stop_string_finishes_counts_once_and_leaves_the_end_snapshot(served, model, demo_tok):
    """A stop string ends the request with reason "stop" (not an abort), counted once in /metrics, and the end
    snapshot it leaves is hit by the next turn's prompt (turn 1's ids + the answer + more)."""
    url, engine, server = served
    client = _client(url)
    prompt = demo_tok.encode(" ".join(LINES[:3]))
    free = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    text = free.choices[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop and stop in text
    httpx.post(f"{url}/reset_prefix_cache").raise_for_status()
    before = (_finished_by_reason(url, "stop"), server.runner.stats["aborts"])
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == text[: text.find(stop)]
    deadline = time.monotonic() + 30
    while server.runner.stats.get("running", 1) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (_finished_by_reason(url, "stop"), server.runner.stats["aborts"]) == (before[0] + 1, before[1])
    # the answer's ids: what an engine of the same model computes in-process, stopping at the same token
    answer = _engine(model, demo_tok).generate([prompt], SamplingParams(temperature=0, max_new_tokens=24,
                                                                        stop=(stop,)))[0].outputs[0].token_ids
    assert demo_tok.decode(answer).startswith(r.choices[0].text)
    nxt = client.completions.create(model=MODEL, prompt=prompt + answer + demo_tok.encode(" More."), max_tokens=2,
                                    temperature=0)
    # the end snapshot holds turn 1's prompt and output except the last sampled token (never fed to the model)
    assert nxt.usage.prompt_tokens_details.cached_tokens >= len(prompt) + len(answer) - 1
