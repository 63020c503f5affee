"""Nothing a client sends causes a 5xx: random JSON bodies, and well-formed bodies with random field values,
against a real server (scripted engine). Every 4xx is in OpenAI's error shape."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kimik3.serve import Server, ServerConfig
from tests.serve.conftest import running
from tests.serve.scripted import ScriptedEngine

SCALARS = (st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False)
           | st.text(max_size=12))
JSON = st.recursive(SCALARS,
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                 max_size=4), max_leaves=12)
FIELDS = ["messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "n",
          "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "seed", "stop", "stream",
          "stream_options", "logprobs", "top_logprobs", "tools", "tool_choice", "response_format",
          "reasoning_effort", "chat_template_kwargs", "thinking", "cache_salt", "user", "prompt", "echo"]
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"])},
                                optional={"content": JSON, "tool_calls": JSON, "tool_call_id": JSON, "name": JSON,
                                          "tools": JSON, "reasoning_content": JSON})


@pytest.fixture(scope="module")
def url(demo_tok):
    server = Server(ServerConfig(model_name="demo"))
    server.attach(ScriptedEngine(lambda p, i: demo_tok.encode("Hi"), eos_id=demo_tok.eos_id), demo_tok)
    with running(server) as u:
        yield u


def _check(r: httpx.Response) -> None:
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=6), messages=st.lists(MESSAGE, max_size=3),
       endpoint=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"]))
def test_random_bodies_never_5xx(url, body, messages, endpoint):
    if endpoint == "/v1/chat/completions" and "messages" not in body:
        body["messages"] = messages
    _check(httpx.post(f"{url}{endpoint}", json=body, timeout=30))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=64) | JSON.map(lambda v: httpx.Request("POST", "/", json=v).read()))
def test_random_raw_bodies_never_5xx(url, raw):
    _check(httpx.post(f"{url}/v1/chat/completions", content=raw, timeout=30))
