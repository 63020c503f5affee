"""The Jinja chat template renders what `encode_chat` encodes: ids compared under two vocabularies.

Every chat any test encodes is checked too (tests/conftest.py), for any vocabulary; here the ids themselves are
compared, with this folder's trained vocabulary and the demo model's.
"""

from __future__ import annotations

import pytest

from kimik3.presets import DEMO_MODEL
from kimik3.tokenizer import CHAT_TEMPLATE, Tokenizer, encode_chat, image_prompt
from kimik3.tokenizer.chat import build_segments
from tests.chat_template_check import check_segments, render, value_merges

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now, in °C",
                                            "parameters": {"type": "object", "required": ["city"],
                                                           "properties": {"city": {"type": "string"},
                                                                          "Units": {"enum": ["C", "F"]}}}}}
CALLS = [{"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
         {"id": "b", "type": "function", "function": {"name": "get_time", "arguments": {
             "zone": "CET", "n": 3, "ok": True, "x": None, "list": [1, "two"], "obj": {"k": 1.5}}}}]

CASES = {
    "text": ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there", "name": "ann"}],
             {"thinking": False}),
    "thinking, multi-turn with reasoning": (
        [{"role": "user", "content": "2+2?"},
         {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
         {"role": "assistant", "content": "Sure", "reasoning": "  "},
         {"role": "user", "content": "Thanks"}], {"thinking_effort": "high"}),
    "medium effort, no generation prompt": ([{"role": "user", "content": "x"}],
                                            {"thinking_effort": "medium", "add_generation_prompt": False}),
    "no effort message": ([{"role": "user", "content": "x"}], {"thinking_effort": None}),
    "tools, calls and results in call order": (
        [{"role": "user", "content": "Weather and time?"},
         {"role": "assistant", "content": None, "reasoning_content": "Two calls.", "tool_calls": CALLS},
         {"role": "tool", "tool_call_id": "b", "content": "12:00"},
         {"role": "tool", "tool_call_id": "a", "content": "rain"},
         {"role": "assistant", "content": "Rain at noon."}],
        {"tools": [WEATHER], "tool_choice": "required"}),
    "unmatched results by position, string and empty arguments": (
        [{"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "f", "arguments": "not json"}}, {"function": {"name": "g", "arguments": " "}}]},
         {"role": "tool", "content": "one"}, {"role": "tool", "name": "h", "content": "two"}],
        {"thinking": False, "tool_choice": "none"}),
    "mid-conversation tools": ([{"role": "system", "tools": [WEATHER]}, {"role": "user", "content": "go"}], {}),
    "images: sized, placeholder text and parts": (
        [{"role": "user", "content": [{"type": "image", "width": 640, "height": 480},
                                      {"type": "text", "text": "What is this?"}]},
         {"role": "user", "content": [{"type": "image_url"}, {"type": "text", "text": "and"}]}], {}),
    "images with the processor's prompts": (
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Compare"}]},
         {"role": "user", "content": "with <|kimi_image_placeholder|> this"}],
        {"image_prompts": [image_prompt(32, 64), image_prompt(8, 8)]}),
    "json schema response format": ([{"role": "user", "content": "Name one."}],
                                    {"response_format": {"type": "json_schema", "json_schema": {
                                        "name": "n", "schema": {"type": "object", "b": 1, "a": [2, {"z": 0}]}}}}),
    "json object response format": ([{"role": "user", "content": "{}?"}], {"response_format": {"type": "json_object"}}),
    "attribute escaping": ([{"role": "user", "name": 'a "q" & b', "content": "x"}], {"thinking": False}),
}


@pytest.fixture(scope="module", params=["trained", "demo"])
def vocab(request, tok):
    return tok if request.param == "trained" else Tokenizer.from_file(DEMO_MODEL)


@pytest.mark.parametrize("case", CASES)
def test_template_ids_equal_encode_chat(vocab, case):
    messages, kwargs = CASES[case]
    rendered = render(messages, **kwargs)
    assert vocab.encode(rendered, allow_special=True) == encode_chat(vocab, messages, **kwargs)


def test_template_is_the_shipped_file():
    assert "{% generation %}" in CHAT_TEMPLATE  # TRL's assistant_only_loss looks for the marker
    assert CHAT_TEMPLATE.startswith("{#- Kimi K3's XTML chat format")


def test_check_catches_text_the_pre_tokenizer_would_join():
    """Two text parts that BPE sees apart in encode_chat but as one pre-token in a rendered string: the conftest
    check must refuse them (so it is not vacuous), though the rendered text is equal."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "a:"}, {"type": "text", "text": "<b"}]}]
    with pytest.raises(AssertionError, match="pre-tokenizer merges"):
        check_segments(build_segments(messages), messages, {})  # this module's name: the function itself, unchecked


def test_value_merges_names_only_a_value_joined_to_its_quotes():
    """The conftest's second exemption: `name="-1"` pre-tokenizes as `="-` in one string, which no template can
    avoid; plain names, and markup joined to markup, are not exempt."""
    assert value_merges(build_segments([{"role": "user", "name": "-1", "content": "x"}]))
    assert not value_merges(build_segments([{"role": "user", "name": "ada", "content": "x"}]))
    joined_text = [{"role": "user", "content": [{"type": "text", "text": "a:"}, {"type": "text", "text": "<b"}]}]
    assert not value_merges(build_segments(joined_text))


def test_a_name_that_is_not_a_string_is_refused():
    with pytest.raises(ValueError, match=r"messages\[0\]\.name must be a str, got dict"):
        build_segments([{"role": "user", "name": {"a": 1}, "content": "x"}])
