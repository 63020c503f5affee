"""A forced tool call cut by max_tokens returns the partial call (name, arguments as generated), streamed and
whole alike; an open parameter schema is generated closed, so the model cannot wander into undeclared keys."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.serve.conftest import running
from tests.serve.scripted import continuing
from tests.serve.test_http import MODEL, USER, _client, _collect, _server, _stream_frames

OPEN = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}  # no additionalProperties
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": OPEN}}
OTHER = {"type": "function", "function": {"name": "other", "parameters": {"type": "object"}}}
HEAD = ('<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>'
        '<|open|>call tool="get_weather" index="1"<|sep|><|open|>json type="object"<|sep|>')
ARGS = '{"city":"Mantua and the long road to Verona'


def _body(max_tokens, choice):
    return {"model": MODEL, "messages": USER, "tools": [WEATHER, OTHER], "tool_choice": choice,
            "max_tokens": max_tokens}


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("choice", [NAMED, "required"])
def test_length_inside_the_arguments_returns_the_partial_call(demo_tok, choice):
    head, args = demo_tok.encode(HEAD, allow_special=True), demo_tok.encode(ARGS)
    cut = len(head) + len(args) - 3
    server, _ = _server(demo_tok, continuing(head + args))
    with running(server) as url:
        r = _client(url).chat.completions.create(**_body(cut, choice))
        c = r.choices[0]
        assert c.finish_reason == "length" and c.message.tool_calls, r
        call = c.message.tool_calls[0]
        written = demo_tok.decode(args[: cut - len(head)])
        assert call.function.name == "get_weather" and call.function.arguments == written and call.id
        assert written.startswith('{"city":"Mantua') and not c.message.content
        streamed, _ = _collect(_stream_frames(url, {**_body(cut, choice), "stream": True}))
        assert streamed[0]["finish"] == "length"
        assert [(t["name"], t["arguments"]) for t in streamed[0]["calls"]] == [("get_weather", written)]


def test_length_before_the_call_header_still_names_a_forced_tool(demo_tok):
    head = demo_tok.encode(HEAD, allow_special=True)
    server, _ = _server(demo_tok, continuing(head))
    with running(server) as url:
        msg = httpx.post(f"{url}/v1/chat/completions", json=_body(2, NAMED)).json()["choices"][0]
        assert msg["finish_reason"] == "length"
        assert [(t["function"]["name"], t["function"]["arguments"]) for t in msg["message"]["tool_calls"]] == [
            ("get_weather", "")]
        # required among two tools: nothing names the call yet, and none is invented
        msg = httpx.post(f"{url}/v1/chat/completions", json=_body(2, "required")).json()["choices"][0]
        assert msg["finish_reason"] == "length" and "tool_calls" not in msg["message"]


def test_closed_after_the_declared_keys_a_complete_call_stops(demo_tok):
    """The script tries to add a key after the declared one; the grammar allows only `}` there, so the call
    completes (finish_reason tool_calls) with exactly the declared key."""
    head = demo_tok.encode(HEAD, allow_special=True)
    server, _ = _server(demo_tok, continuing(head + demo_tok.encode('{"city":"Mantua","mood":"sad"}')))
    with running(server) as url:
        r = _client(url).chat.completions.create(**_body(100, NAMED))
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", r
        assert json.loads(c.message.tool_calls[0].function.arguments) == {"city": "Mantua"}
