"""The HTTP API over a scripted engine (tests/serve/scripted.py): wire shapes, K3 output shapes, errors, metrics,
cancellation. The official `openai` client drives it; httpx sends raw frames and malformed bodies."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kimik3.serve import Server, ServerConfig
from kimik3.tokenizer import encode_chat
from tests.serve.conftest import running
from tests.serve.scripted import ScriptedEngine
from tests.tokenizer.test_parse import SHAPES

MODEL = "demo"
USER = [{"role": "user", "content": "Speak, friend."}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}}, "required": ["a"]}}}


def _server(tok, script, **kw):
    cfg = {k: kw.pop(k) for k in ("api_key", "max_pending") if k in kw}
    server = Server(ServerConfig(model_name=MODEL, **cfg))
    engine = ScriptedEngine(script, eos_id=tok.eos_id, **kw)
    server.attach(engine, tok)
    return server, engine


def _client(url, **kw):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=kw.pop("api_key", "none"), max_retries=0, **kw)


def _stream_frames(url, body, headers=None):
    """Raw SSE `data:` payloads of a streamed request (the [DONE] sentinel included)."""
    frames = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=30) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                frames.append(line[len("data: "):])
    return frames


def _wait(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.005)


def _collect(frames):
    """Concatenate a chat stream: per choice (reasoning, content, tool calls, finish_reason); and the usage."""
    out, usage = {}, None
    assert frames[-1] == "[DONE]"
    for raw in frames[:-1]:
        chunk = json.loads(raw)
        if not chunk["choices"]:
            usage = chunk["usage"]
            continue
        for ch in chunk["choices"]:
            c = out.setdefault(ch["index"], {"reasoning": "", "content": "", "calls": [], "finish": None})
            d = ch["delta"]
            assert None not in d.values(), d  # no null fields in deltas
            c["reasoning"] += d.get("reasoning_content", "")
            c["content"] += d.get("content", "")
            for tc in d.get("tool_calls", []):
                if "id" in tc:  # a slot chunk: id, name, empty arguments
                    assert tc["function"]["arguments"] == "" and tc["type"] == "function"
                    c["calls"].append({"id": tc["id"], "name": tc["function"]["name"], "arguments": ""})
                else:
                    c["calls"][tc["index"]]["arguments"] += tc["function"]["arguments"]
            if ch["finish_reason"] is not None:
                assert c["finish"] is None
                c["finish"] = ch["finish_reason"]
    return out, usage


@pytest.mark.parametrize("name", [n for n in SHAPES if SHAPES[n][1] == "think"])
def test_k3_output_shapes_over_http_stream_equals_whole(demo_tok, name):
    text, _, tools_declared, (reasoning, content, names, _) = SHAPES[name]
    ids = demo_tok.encode(text, allow_special=True)
    server, engine = _server(demo_tok, lambda p, i: ids, tokens_per_step=3)
    body = {"model": MODEL, "messages": USER, "max_tokens": 200}
    if tools_declared:
        body["tools"] = [TOOL]
    with running(server) as url:
        whole = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30).json()
        frames = _stream_frames(url, {**body, "stream": True, "stream_options": {"include_usage": True}})
    msg, choice = whole["choices"][0]["message"], whole["choices"][0]
    assert (msg.get("reasoning_content", ""), msg["content"]) == (reasoning, content)
    assert [t["function"]["name"] for t in msg.get("tool_calls", [])] == names
    assert all(json.loads(t["function"]["arguments"]) == {"a": 1} for t in msg.get("tool_calls", []))
    assert "<|" not in msg["content"] + msg.get("reasoning_content", "")
    want_finish = "tool_calls" if names else ("stop" if demo_tok.eos_id in ids or len(ids) < 200 else "length")
    assert choice["finish_reason"] == want_finish
    streamed, usage = _collect(frames)
    s = streamed[0]
    assert (s["reasoning"], s["content"], s["finish"]) == (reasoning, content, choice["finish_reason"])
    # the same calls; ids are per request (call_<request>_<k>)
    assert [(c["name"], c["arguments"]) for c in s["calls"]] == [
        (t["function"]["name"], t["function"]["arguments"]) for t in msg.get("tool_calls", [])]
    assert all(c["id"].startswith("call_") for c in s["calls"] + msg.get("tool_calls", []))
    cached = usage.pop("prompt_tokens_details")["cached_tokens"]
    assert usage == {k: v for k, v in whole["usage"].items() if k != "prompt_tokens_details"}
    assert (whole["usage"]["prompt_tokens_details"]["cached_tokens"], cached) == (0, usage["prompt_tokens"] - 1)
    prompt = encode_chat(demo_tok, USER, tools=body.get("tools"))
    assert whole["usage"]["prompt_tokens"] == len(prompt) and engine.added[0].prompt_ids == prompt
    eos = demo_tok.eos_id
    assert whole["usage"]["completion_tokens"] == (ids.index(eos) if eos in ids else len(ids)) + 1


def test_openai_client_round_trip_reasoning_tools_logprobs_n(demo_tok):
    text = SHAPES["normal"][0]
    ids = demo_tok.encode(text, allow_special=True)
    server, engine = _server(demo_tok, lambda p, i: ids, tokens_per_step=2)
    with running(server) as url:
        client = _client(url)
        r = client.chat.completions.create(model=MODEL, messages=USER, tools=[TOOL], n=2, logprobs=True,
                                           top_logprobs=3, max_completion_tokens=100, seed=7, temperature=0.5,
                                           presence_penalty=0.5, frequency_penalty=-0.25, logit_bias={"5": 2.5},
                                           top_p=0.9, user="u1",
                                           extra_body={"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1,
                                                       "chat_template_kwargs": {"thinking": True},
                                                       "cache_salt": "s1", "unknown_field": 1})
        assert [c.index for c in r.choices] == [0, 1] and r.id.startswith("chatcmpl-")
        for c in r.choices:
            assert c.finish_reason == "tool_calls" and c.message.content == "Hi"
            assert c.message.model_extra["reasoning_content"] == "r"
            assert c.message.tool_calls[0].function.name == "f" and c.message.tool_calls[0].id
            assert ids[-1] == demo_tok.eos_id and len(c.logprobs.content) == len(ids)  # the EOS too
            assert all(len(e.top_logprobs) == 3 for e in c.logprobs.content)
        assert r.usage.completion_tokens == 2 * len(ids)
        assert r.usage.completion_tokens_details.reasoning_tokens == 2 * len(demo_tok.encode(
            "r<|close|>think<|sep|>", allow_special=True))
        p = engine.added[0].params
        assert (p.n, p.logprobs, p.seed, p.temperature, p.top_k, p.min_p, p.repetition_penalty) == (
            2, 3, 7, 0.5, 5, 0.1, 1.1)
        assert (p.presence_penalty, p.frequency_penalty, p.logit_bias, p.top_p, p.max_new_tokens) == (
            0.5, -0.25, ((5, 2.5),), 0.9, 100)
        assert engine.added[0].cache_salt == "s1"
        stream = client.chat.completions.create(model=MODEL, messages=USER, tools=[TOOL], stream=True,
                                                stream_options={"include_usage": True})
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices == []
        assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens


def test_thinking_off_effort_and_stop_strings(demo_tok):
    ids = demo_tok.encode("All the world's a stage<|close|>response<|sep|><|close|>message<|sep|>",
                          allow_special=True) + [5] * 200
    server, engine = _server(demo_tok, lambda p, i: ids, step_s=0.01)
    with running(server) as url:
        client = _client(url)
        r = client.chat.completions.create(model=MODEL, messages=USER, reasoning_effort="none", stop=["a st"])
        assert r.choices[0].message.content == "All the world's " and r.choices[0].finish_reason == "stop"
        assert engine.added[0].prompt_ids == encode_chat(demo_tok, USER, thinking=False, thinking_effort=None)
        _wait(lambda: engine.stopped)
        # the engine was told to finish it normally (reason "stop", not an abort: its end snapshot is kept)
        assert engine.stopped == [engine.added[0].request_id] and not engine.aborted
        r = client.chat.completions.create(model=MODEL, messages=USER, stream=True, stop="stage",
                                           extra_body={"thinking": {"type": "disabled"}})
        assert "".join(c.choices[0].delta.content or "" for c in r) == "All the world's a "
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=3, reasoning_effort="xhigh")
        assert engine.added[-1].prompt_ids == encode_chat(demo_tok, USER, thinking_effort="max")
        assert engine.added[-1].params.max_new_tokens == 3


def test_completions_text_ids_echo_logprobs(demo_tok):
    server, engine = _server(demo_tok, lambda p, i: demo_tok.encode(" to be"), tokens_per_step=1)
    with running(server) as url:
        client = _client(url)
        r = client.completions.create(model=MODEL, prompt=["To be, or not", "Hark"], max_tokens=2, n=2)
        assert [c.index for c in r.choices] == [0, 1, 2, 3] and {c.text for c in r.choices} == {" to be"}
        assert r.usage.prompt_tokens == len(demo_tok.encode("To be, or not")) + len(demo_tok.encode("Hark"))
        ids = demo_tok.encode("Now is the winter")
        r = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, echo=True, logprobs=1, temperature=0)
        lp = r.choices[0].logprobs
        assert r.choices[0].text == "Now is the winter" + demo_tok.decode(demo_tok.encode(" to be")[:1])
        assert len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[0] is None
        assert lp.tokens[:len(ids)] == [demo_tok.decode([t]) for t in ids]
        assert all(max(top.values()) == v for top, v in zip(lp.top_logprobs[1:], lp.token_logprobs[1:]))
        assert engine.added[-1].params.prompt_logprobs == 1
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model=MODEL, prompt="Hark", stream=True, max_tokens=5))
        assert streamed == " to be"


def test_tokenize_detokenize_models_reset_health(demo_tok):
    server, engine = _server(demo_tok, lambda p, i: [])
    with running(server) as url:
        body = {"model": MODEL, "messages": USER, "tools": [TOOL], "reasoning_effort": "low"}
        t = httpx.post(f"{url}/tokenize", json=body).json()
        r = _client(url).chat.completions.create(model=MODEL, messages=USER, tools=[TOOL], reasoning_effort="low")
        assert t["count"] == len(t["tokens"]) == r.usage.prompt_tokens and t["max_model_len"] == 512
        assert httpx.post(f"{url}/detokenize", json={"tokens": t["tokens"]}).json()["prompt"] == demo_tok.decode(
            t["tokens"])
        assert httpx.post(f"{url}/tokenize", json={"prompt": "Hark"}).json()["tokens"] == demo_tok.encode("Hark")
        # raw prompts (tokenize, /v1/completions) read markers as tokens, as lm-eval's remote tokenizer expects
        eos = httpx.post(f"{url}/tokenize", json={"prompt": "<|end_of_msg|>"}).json()["tokens"]
        assert eos == [demo_tok.eos_id]
        models = _client(url).models.list()
        assert [m.id for m in models.data] == [MODEL]
        assert httpx.post(f"{url}/reset_prefix_cache").status_code == 200 and engine.reset_calls == 1
        assert httpx.get(f"{url}/health").status_code == 200
        assert httpx.get(f"{url}/tokenizer_info").json()["eos_token"] == "<|end_of_msg|>"
    loading = Server(ServerConfig(model_name=MODEL))
    with running(loading) as url:
        r = httpx.get(f"{url}/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"


BAD = [
    ({"messages": USER, "temperature": 3}, "temperature", None),
    ({"messages": USER, "temperature": "hot"}, "temperature", None),
    ({"messages": []}, "messages", None),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages", None),
    ({"messages": USER, "n": 0}, "n", None),
    ({"messages": USER, "max_tokens": 0}, "max_tokens", None),
    ({"messages": USER, "top_logprobs": 2}, "top_logprobs", None),
    ({"messages": USER, "tool_choice": "required"}, "tool_choice", None),
    ({"messages": USER, "tool_choice": "sometimes", "tools": [TOOL]}, "tool_choice", None),
    ({"messages": USER, "tool_choice": {"type": "function", "function": {"name": "g"}}, "tools": [TOOL]},
     "tool_choice", None),
    ({"messages": USER, "response_format": {"type": "yaml"}}, "response_format", None),
    ({"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format.json_schema", None),
    ({"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {},
                                                                                  "strict": "yes"}}},
     "response_format.json_schema.strict", None),
    ({"messages": USER, "reasoning_effort": "extreme"}, "reasoning_effort", None),
    ({"messages": USER, "logit_bias": {"abc": 1}}, "logit_bias", None),
    ({"messages": USER, "logit_bias": {"5": 500}}, "logit_bias", None),
    ({"messages": USER, "stop": [""]}, "stop", None),
    ({"messages": USER, "stream_options": {"include_usage": True}}, "stream_options", None),
    ({"messages": [{"role": "user", "content": "x", "tools": [TOOL]}]}, "messages[0].tools", None),
    ({"messages": USER, "max_tokens": 10_000}, "max_tokens", "context_length_exceeded"),
    ({"messages": [{"role": "user", "content": "word " * 600}]}, "messages", "context_length_exceeded"),
]


@pytest.mark.parametrize("body, param, code", BAD)
def test_bad_requests_are_400_in_openai_shape(demo_tok, body, param, code):
    server, engine = _server(demo_tok, lambda p, i: [])
    with running(server) as url:
        r = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, **body})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
        assert err["param"] == param and err["message"]
        if code:
            assert err["code"] == code
        with pytest.raises(openai.BadRequestError):
            _client(url).chat.completions.create(**{"model": MODEL, **body})
    assert engine.added == []


def test_other_errors_and_client_exceptions(demo_tok):
    server, engine = _server(demo_tok, lambda p, i: [5] * 50, api_key="sekrit", max_pending=1, step_s=0.02)
    with running(server) as url:
        with pytest.raises(openai.AuthenticationError):
            _client(url, api_key="wrong").models.list()
        assert httpx.get(f"{url}/health").status_code == 200  # /health needs no key
        client = _client(url, api_key="sekrit")
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="gpt-5", messages=USER)
        h = {"Authorization": "Bearer sekrit"}
        for raw in (b"{not json", b"[1, 2]", "\xff".encode("latin-1")):
            r = httpx.post(f"{url}/v1/chat/completions", content=raw, headers=h)
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        assert httpx.get(f"{url}/v1/nope", headers=h).status_code == 404
        for bad in ({"prompt": []}, {"prompt": [[1, 2], "x"]}, {"prompt": [10**9]}, {"prompt": "x", "logprobs": 99}):
            r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, **bad}, headers=h)
            assert r.status_code == 400, (bad, r.text)
        # capacity: one request runs, the next is refused with 503
        first = threading.Thread(target=lambda: client.chat.completions.create(model=MODEL, messages=USER,
                                                                               max_tokens=40))
        first.start()
        while not engine.active:
            time.sleep(0.005)
        with pytest.raises(openai.APIStatusError) as e:
            client.chat.completions.create(model=MODEL, messages=USER, max_tokens=5)
        assert e.value.status_code == 503
        first.join()


def test_disconnect_aborts_within_a_step(demo_tok):
    server, engine = _server(demo_tok, lambda p, i: [5] * 400, step_s=0.01)
    with running(server) as url:
        body = {"model": MODEL, "messages": USER, "max_tokens": 300, "stream": True}
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            for _ in zip(range(3), r.iter_lines()):
                pass
        deadline = time.monotonic() + 10
        while engine.active and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not engine.active and len(engine.aborted) == 1
        steps_at_abort = engine.steps
        # a non-streaming client that gives up is noticed by the handler's poll
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": False}, timeout=0.3)
        deadline = time.monotonic() + 10
        while engine.active and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not engine.active and len(engine.aborted) == 2
        assert engine.steps - steps_at_abort < 300  # stopped early, not run to max_tokens
        assert server.runner._pending == 0
    assert threading.main_thread().ident not in engine.thread_ids and len(engine.thread_ids) == 1


def test_metrics_parse_and_equal_reported_usage(demo_tok, caplog):
    caplog.set_level("INFO", logger="kimik3.serve")
    server, engine = _server(demo_tok, lambda p, i: demo_tok.encode("Soft you now"))
    with running(server) as url:
        client = _client(url)
        usages = [client.chat.completions.create(model=MODEL, messages=USER, n=n).usage for n in (1, 2)]
        usages.append(client.completions.create(model=MODEL, prompt="Hark", max_tokens=3).usage)
        text = httpx.get(f"{url}/metrics").text
    lines = [r.getMessage() for r in caplog.records if r.name == "kimik3.serve" and " prompt=" in r.getMessage()]
    assert len(lines) == 3 and all("ttft=" in x and "finish=" in x for x in lines)  # one log line per request
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}
    assert samples["kimik3:prompt_tokens_total"] == sum(u.prompt_tokens for u in usages)
    assert samples["kimik3:generation_tokens_total"] == sum(u.completion_tokens for u in usages)
    assert samples["kimik3:time_to_first_token_seconds_count"] == 3
    assert samples["kimik3:e2e_request_latency_seconds_count"] == 3
    assert samples["kimik3:prefix_cache_queries_total"] == engine.stats["prefix_queries_tokens"]
    assert samples["kimik3:num_requests_running"] == 0
    for name in ("kimik3:kda_snapshots", "kimik3:kda_snapshot_bytes", "kimik3:snapshots_rejected_nonfinite_total",
                 "kimik3:cache_usage_ratio", "kimik3:num_preemptions_total", "kimik3:num_aborted_requests_total",
                 "kimik3:num_requests_waiting", "kimik3:prefix_cache_hits_total",
                 "kimik3:inter_token_latency_seconds_count", "kimik3:request_queue_time_seconds_count"):
        assert name in samples
