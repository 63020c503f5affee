"""Response parser: round trips through the chat encoder, truncation at every length, streaming, malformed output."""

from __future__ import annotations

import random

import pytest

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
    ("r<|close|>response<|sep|>x", "r", "", "<|close|>response<|sep|>x"),
    ("r<|close|>think<|sep|><|open|>response<|sep|>c<|open|>think<|sep|>more", "r", "c", "<|open|>think<|sep|>more"),
    ("r<|close|>think<|sep|>junk<|open|>response<|sep|>c", "r", "", "junk<|open|>response<|sep|>c"),
    ("r<|open|>resp<|close|>think<|sep|>", "r", "", "<|open|>resp<|close|>think<|sep|>"),
    ("r<|close|>think<|sep|><|open|>response<|sep|>c<|end_of_msg|>z", "r", "c", "<|end_of_msg|>z"),
    ("r<|close|>think<|sep|><|open|>response<|sep|>c<|sep|>", "r", "c", "<|sep|>"),
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
