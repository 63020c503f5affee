"""Response parser: round trips through the chat encoder, truncation at every length, streaming, malformed output."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kimik3.tokenizer import ResponseParser, encode_chat, parse_response, parse_text

ARGS = {"city": "北京 \"centre\"", "days": 3, "ratio": 0.25, "metric": True, "extra": None,
        "opts": {"a": [1, 2], "b": "x"}, "tags": ["x", "y"]}
ANSWER = {"role": "assistant", "reasoning_content": "Need the tool 🤔. Two calls.",
          "content": "Let me check… 🦀 天气",
          "tool_calls": [{"id": "x1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}},
                         {"id": "x2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]}
WANT_CALLS = [{"id": "call_1", "name": "get_weather", "arguments": ARGS},
              {"id": "call_2", "name": "get_time", "arguments": {}}]
USER = [{"role": "user", "content": "Weather in 北京?"}]


def _output(tok, thinking=True, answer=ANSWER):
    """The ids a model would generate for `answer`: the full encoding minus the prompt (which must be a prefix)."""
    prompt = encode_chat(tok, USER, thinking=thinking)
    full = encode_chat(tok, USER + [answer], thinking=thinking, add_generation_prompt=False)
    assert full[:len(prompt)] == prompt
    return full[len(prompt):]


def test_round_trip_thinking(tok):
    p = parse_response(tok, _output(tok))
    assert p.reasoning_content == ANSWER["reasoning_content"] and p.content == ANSWER["content"]
    assert p.tool_calls == WANT_CALLS
    assert p.remainder == "" and p.complete


def test_round_trip_no_thinking(tok):
    p = parse_response(tok, _output(tok, thinking=False), start_in="response")
    assert p.reasoning_content == "" and p.content == ANSWER["content"] and p.tool_calls == WANT_CALLS
    assert p.complete and p.remainder == ""


def test_plain_answer_and_text_mode(tok):
    answer = {"role": "assistant", "reasoning_content": "think", "content": "Hello <|open|> world"}
    out = _output(tok, answer=answer)
    p = parse_response(tok, out)
    assert (p.reasoning_content, p.content, p.tool_calls, p.complete) == ("think", "Hello <|open|> world", [], True)
    # in decoded text a literal marker is indistinguishable from a real one: ids are the reliable input
    t = parse_text(tok.decode(_output(tok, answer=ANSWER)))
    assert (t.reasoning_content, t.content, t.tool_calls, t.complete) == (
        ANSWER["reasoning_content"], ANSWER["content"], WANT_CALLS, True)


def test_every_prefix_never_raises_and_grows(tok):
    out = _output(tok)
    prev = parse_response(tok, [])
    assert (prev.reasoning_content, prev.content, prev.tool_calls, prev.complete) == ("", "", [], False)
    for k in range(1, len(out) + 1):
        p = parse_response(tok, out[:k])
        assert p.reasoning_content.startswith(prev.reasoning_content)
        assert p.content.startswith(prev.content)
        assert p.tool_calls[:len(prev.tool_calls)] == prev.tool_calls
        assert "\ufffd" not in p.reasoning_content + p.content  # partial characters wait in the remainder
        assert p.complete == (k == len(out))
        prev = p
    assert prev.tool_calls == WANT_CALLS


def test_truncated_call_goes_to_remainder(tok):
    out = _output(tok)
    close = tok.encode_special("<|close|>")
    calls_closed = [i for i, t in enumerate(out) if t == close and tok.decode(out[i + 1:]).startswith("call<|sep|>")]
    last_call_close = calls_closed[-1]
    p = parse_response(tok, out[:last_call_close])  # stops inside the second call
    assert p.tool_calls == WANT_CALLS[:1] and not p.complete
    assert p.remainder == '<|open|>call tool="get_time" index="2"<|sep|>'


def test_streaming_deltas_equal_whole_parse(tok):
    out = _output(tok)
    parser = ResponseParser(tok)
    reasoning, content, calls = "", "", []
    for i in out:
        d = parser.feed([i])
        reasoning, content, calls = reasoning + d.reasoning_content, content + d.content, calls + d.tool_calls
    final = parser.finish()
    assert (reasoning, content, calls) == (final.reasoning_content, final.content, final.tool_calls)
    assert calls == WANT_CALLS
    text_parser, text = ResponseParser(), tok.decode(out)
    got = "".join(text_parser.feed_text(ch).content for ch in text)
    assert got == ANSWER["content"] and text_parser.finish().tool_calls == WANT_CALLS


def test_partial_marker_held_in_text_mode():
    parser = ResponseParser()
    assert parser.feed_text("abc<|clo").reasoning_content == "abc"
    assert parser.finish().remainder == "<|clo"
    parser = ResponseParser()
    parser.feed_text("abc<|clo")
    d = parser.feed_text("se|>think<|sep|><|open|>response<|sep|>hi")
    assert (d.reasoning_content, d.content) == ("", "hi")


END = "<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
CALL = '<|open|>call tool="f" index="1"<|sep|><|open|>argument key="a" type="{}"<|sep|>{}<|close|>argument<|sep|>'


@pytest.mark.parametrize("text, reasoning, content, remainder", [
    # an orphan response close ends the think channel; prose after it is outside any channel
    ("r<|close|>response<|sep|>x", "r", "", "x"),
    # a tag that makes no sense inside content is dropped, the channel goes on
    ("r<|close|>think<|sep|><|open|>response<|sep|>c<|open|>think<|sep|>more", "r", "cmore", "<|open|>think<|sep|>"),
    # prose right after the think close opens the response implicitly; the late open is then dropped
    ("r<|close|>think<|sep|>junk<|open|>response<|sep|>c", "r", "junkc", "<|open|>response<|sep|>"),
    # a header cut short by another marker is dropped
    ("r<|open|>resp<|close|>think<|sep|>", "r", "", "<|open|>resp"),
    ("r<|close|>think<|sep|><|open|>response<|sep|>c<|end_of_msg|>z", "r", "c", "z"),
    ("r<|close|>think<|sep|><|open|>response<|sep|>c<|sep|>", "r", "c", "<|sep|>"),
    # a tools block that breaks (call never closed) goes to the remainder from the break on
    ("<|close|>think<|sep|><|open|>response<|sep|>c<|close|>response<|sep|><|open|>tools<|sep|>"
     + CALL.format("number", "1") + "<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>", "", "c",
     CALL.format("number", "1") + "<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>"),
])
def test_malformed_nesting(text, reasoning, content, remainder):
    p = parse_text(text)
    assert (p.reasoning_content, p.content, p.tool_calls, p.remainder, p.complete) == (
        reasoning, content, [], remainder, False)


def test_trailing_output_after_end_and_bad_json():
    text = ("<|close|>think<|sep|><|open|>response<|sep|>ok<|close|>response<|sep|><|open|>tools<|sep|>"
            + CALL.format("number", "abc") + '<|close|>call<|sep|><|open|>call tool="g" index="2"<|sep|>'
            '<|open|>json type="object"<|sep|>{oops<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|>'
            "<|close|>message<|sep|><|end_of_msg|>extra")
    p = parse_text(text)
    assert p.complete and p.content == "ok" and p.remainder == "extra"
    assert p.tool_calls == [{"id": "call_1", "name": "f", "arguments": {"a": "abc"}},
                            {"id": "call_2", "name": "g", "arguments": "{oops"}]


def test_json_block_arguments_round_trip(tok):
    answer = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}
    p = parse_response(tok, _output(tok, answer=answer))
    assert p.tool_calls == [{"id": "call_1", "name": "f", "arguments": "{bad"}] and p.complete


def test_fuzz_never_raises(tok):
    rng = random.Random(0)
    out = _output(tok)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 40))]
        parse_response(tok, ids)
        mixed = out[:]
        for _ in range(3):  # shuffle a few structural tokens around
            i, j = rng.randrange(len(mixed)), rng.randrange(len(mixed))
            mixed[i], mixed[j] = mixed[j], mixed[i]
        p = parse_response(tok, mixed)
        assert isinstance(p.remainder, str)
    with pytest.raises(ValueError, match="start_in"):
        ResponseParser(tok, start_in="tools")


# The K3 output shapes other servers get wrong (serving research §2.4), as id streams. Each row: output text with
# markers written literally, start_in, tools declared, (reasoning, content, tool names, complete).
TOOLS = ('<|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|><|open|>argument key="a" type="number"<|sep|>'
         '1<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>')
CLOSE_MSG = "<|close|>message<|sep|><|end_of_msg|>"
SHAPES = {
    "normal": ("r<|close|>think<|sep|><|open|>response<|sep|>Hi<|close|>response<|sep|>" + TOOLS + CLOSE_MSG,
               "think", True, ("r", "Hi", ["f"], True)),
    "think close omitted before response (vllm#53246)": (
        "r<|open|>response<|sep|>Hi<|close|>response<|sep|>" + TOOLS + CLOSE_MSG, "think", True,
        ("r", "Hi", ["f"], True)),
    "orphan response close (vllm#53246 as reported)": (
        "r Hi<|close|>response<|sep|>" + TOOLS + CLOSE_MSG, "think", True, ("r Hi", "", ["f"], True)),
    "message close without response close (vllm#51412)": (
        "r<|close|>think<|sep|><|open|>response<|sep|>Hello" + CLOSE_MSG, "think", True, ("r", "Hello", [], True)),
    "no think channel at all (sglang#33995)": (
        "<|open|>response<|sep|>Hi<|close|>response<|sep|>" + CLOSE_MSG, "think", True, ("", "Hi", [], True)),
    "think followed directly by tools (vllm#54273)": (
        "r<|close|>think<|sep|>" + TOOLS + CLOSE_MSG, "think", True, ("r", "", ["f"], True)),
    "think close omitted before tools": ("r" + TOOLS + CLOSE_MSG, "think", True, ("r", "", ["f"], True)),
    "tools inside an unclosed response": (
        "r<|close|>think<|sep|><|open|>response<|sep|>Hi" + TOOLS + CLOSE_MSG, "think", True,
        ("r", "Hi", ["f"], True)),
    "stopped mid tag (sglang#33183)": (
        "r<|close|>think<|sep|><|open|>response<|sep|>Hi<|close|>respo", "think", True, ("r", "Hi", [], False)),
    "stopped mid call": ("r<|close|>think<|sep|><|open|>response<|sep|>Hi<|close|>response<|sep|>" + TOOLS[:90],
                         "think", True, ("r", "Hi", [], False)),
    "tools block with no tools declared (sglang#39583)": (
        "r<|close|>think<|sep|><|open|>response<|sep|>Hi<|close|>response<|sep|>" + TOOLS + CLOSE_MSG, "think",
        False, ("r", "Hi", [], True)),
    "thinking off": ("Hi<|close|>response<|sep|>" + TOOLS + CLOSE_MSG, "response", True, ("", "Hi", ["f"], True)),
    "thinking off, the model thinks anyway": (
        "<|close|>think<|sep|><|open|>response<|sep|>Hi" + CLOSE_MSG, "response", True, ("", "Hi", [], True)),
    "end of message inside reasoning": ("r<|end_of_msg|>tail", "think", True, ("r", "", [], False)),
}


def _shape_ids(tok, text):
    return tok.encode(text, allow_special=True)


@pytest.mark.parametrize("name", list(SHAPES))
def test_k3_output_shapes(tok, name):
    text, start_in, tools, (reasoning, content, names, complete) = SHAPES[name]
    p = parse_response(tok, _shape_ids(tok, text), start_in=start_in, tools=tools)
    assert (p.reasoning_content, p.content, [c["name"] for c in p.tool_calls], p.complete) == (
        reasoning, content, names, complete)
    for marker in ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "<|"):
        assert marker not in p.reasoning_content + p.content
    assert all(c["arguments"] == {"a": 1} and c["id"] == f"call_{k}" for k, c in enumerate(p.tool_calls, 1))
    assert p.dropped_tool_calls == (0 if tools or "tools<|sep|>" not in text else 1)


def _split_parse(tok, ids, cuts, **kw):
    """Feed ids in the pieces given by `cuts`; returns (concatenated deltas, finish())."""
    parser = ResponseParser(tok, **kw)
    reasoning, content, calls, pos = "", "", [], 0
    for cut in sorted(cuts) + [len(ids)]:
        d = parser.feed(ids[pos:cut])
        reasoning, content, calls, pos = reasoning + d.reasoning_content, content + d.content, calls + d.tool_calls, cut
    return (reasoning, content, calls), parser.finish()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(sorted(SHAPES)), data=st.data())
def test_any_split_of_the_id_stream_parses_the_same(tok, name, data):
    text, start_in, tools, _ = SHAPES[name]
    ids = _shape_ids(tok, text)
    cuts = data.draw(st.lists(st.integers(0, len(ids)), max_size=len(ids)))
    whole = parse_response(tok, ids, start_in=start_in, tools=tools)
    streamed, final = _split_parse(tok, ids, cuts, start_in=start_in, tools=tools)
    assert final == whole
    assert streamed == (whole.reasoning_content, whole.content, whole.tool_calls)


@pytest.mark.parametrize("name", list(SHAPES))
def test_every_split_point_and_prefix(tok, name):
    """Exhaustive over single split points; every prefix parses to a prefix of the whole result."""
    text, start_in, tools, _ = SHAPES[name]
    ids = _shape_ids(tok, text)
    whole = parse_response(tok, ids, start_in=start_in, tools=tools)
    for k in range(len(ids) + 1):
        streamed, final = _split_parse(tok, ids, [k], start_in=start_in, tools=tools)
        assert final == whole and streamed == (whole.reasoning_content, whole.content, whole.tool_calls)
        prefix = parse_response(tok, ids[:k], start_in=start_in, tools=tools)
        assert whole.reasoning_content.startswith(prefix.reasoning_content)
        assert whole.content.startswith(prefix.content)
        assert whole.tool_calls[:len(prefix.tool_calls)] == prefix.tool_calls


PIECES = ["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "think", "response", "tools", "message", "call",
          ' tool="f"', "argument", ' key="a"', ' type="number"', "json", "1", "{}", "Hi", " ", "é"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pieces=st.lists(st.sampled_from(PIECES), max_size=40), start_in=st.sampled_from(["think", "response"]),
       tools=st.booleans(), data=st.data())
def test_random_structure_never_leaks_or_raises(tok, pieces, start_in, tools, data):
    ids = _shape_ids(tok, "".join(pieces))
    whole = parse_response(tok, ids, start_in=start_in, tools=tools)
    assert "<|" not in whole.reasoning_content + whole.content
    cuts = data.draw(st.lists(st.integers(0, len(ids)), max_size=8))
    streamed, final = _split_parse(tok, ids, cuts, start_in=start_in, tools=tools)
    assert final == whole and streamed == (whole.reasoning_content, whole.content, whole.tool_calls)


@pytest.mark.parametrize("text, want", [
    ('<|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|><|open|>json type="object"<|sep|>{"a": 1, "b',
     {"name": "f", "arguments": '{"a": 1, "b'}),
    ('<|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|><|open|>argument key="a" type="number"<|sep|>1'
     '<|close|>argument<|sep|><|open|>argument key="b" type="string"<|sep|>x', {"name": "f", "arguments": '{"a": 1}'}),
    ('<|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>', {"name": "f", "arguments": ""}),
    ('<|open|>tools<|sep|><|open|>call tool="f', None),
    ('<|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|><|close|>call<|sep|>', None),
])
def test_partial_call_is_the_open_call_as_written(text, want):
    parser = ResponseParser(start_in="response")
    parser.feed_text(text)
    p = parser.finish()
    assert parser.partial_call() == want
    assert len(p.tool_calls) == (1 if want is None and text.endswith("<|close|>call<|sep|>") else 0)
    undeclared = ResponseParser(start_in="response", tools=False)
    undeclared.feed_text(text)
    assert undeclared.partial_call() is None
