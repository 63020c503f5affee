"""The Jinja chat template against `encode_chat`: rendered as transformers renders it, compared for any vocabulary.

`render(messages, **kwargs)` renders `kimik3.tokenizer.CHAT_TEMPLATE` in an environment built like transformers'
(`ImmutableSandboxedEnvironment`, trim/lstrip blocks, loop controls, `tojson` as `json.dumps(ensure_ascii=False)`,
`raise_exception`). `check_segments` says whether tokenizing that text with special names read as specials gives
`encode_chat`'s ids under every vocabulary: the text must equal the joined segments, and K3's pre-tokenizer must
split each run of ordinary text between specials exactly where the encoder's separate segments split it (BPE
never crosses a pre-token, so equal pre-tokens give equal ids whatever the merges).
"""

from __future__ import annotations

import copy
import json
from functools import lru_cache

import regex
from jinja2.exceptions import TemplateError
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kimik3.tokenizer import CHAT_TEMPLATE, PATTERN, SPECIAL_OFFSETS
from kimik3.tokenizer.chat import MARKUP, SPECIAL, Segment

_PRETOKEN = regex.compile("(?V1)" + PATTERN)
# the fixed special names, and the reserved ones by shape: what `encode(allow_special=True)` reads as one token
_SPECIAL_NAME = regex.compile("|".join([*map(regex.escape, SPECIAL_OFFSETS), r"<\|reserved_token_\d+\|>"]))


def _raise(message: str):
    raise TemplateError(message)


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}` renders its body (transformers records the span as the assistant
    mask; llama.cpp and llama-cpp-python pass it through)."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


@lru_cache(maxsize=1)
def _template():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols", _Generation])
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = _raise
    return env.from_string(CHAT_TEMPLATE)


def render(messages, **kwargs) -> str:
    kwargs.setdefault("add_generation_prompt", True)  # encode_chat's default (transformers' is False)
    return _template().render(messages=messages, **kwargs)


def with_parsed_arguments(messages):
    """`messages` with each tool call's JSON-object string arguments parsed, as vLLM does before it renders a
    template (Jinja cannot parse JSON; `encode_chat` parses them itself)."""
    messages = copy.deepcopy(list(messages))
    for msg in messages:
        for call in (msg.get("tool_calls") or []) if isinstance(msg, dict) else []:
            fn = call.get("function") if isinstance(call.get("function"), dict) else call
            try:
                parsed = json.loads(fn.get("arguments"))
            except (TypeError, ValueError):
                continue
            if isinstance(parsed, dict):
                fn["arguments"] = parsed
    return messages


def _runs(segments: list[Segment]) -> list[list[str]]:
    """Each run of ordinary text between special tokens, as the list of its pieces encoded separately."""
    runs: list[list[str]] = [[]]
    for text, kind, _ in segments:
        if kind == SPECIAL:
            runs.append([])
            continue
        pieces = _SPECIAL_NAME.split(text) if kind == MARKUP else [text]
        runs[-1].append(pieces[0])
        for piece in pieces[1:]:
            runs.append([piece])
    return runs


def spells_special(segments: list[Segment]) -> bool:
    """Plain text that spells a special token's name: encode_chat keeps it text; a rendered template cannot."""
    return any(kind not in (SPECIAL, MARKUP) and _SPECIAL_NAME.search(text) for text, kind, _ in segments)


def value_merges(segments: list[Segment]) -> bool:
    """An attribute value (a message's `name`, a tool's name) that the pre-tokenizer would join to the `="` or `"`
    around it, e.g. `name="-1"`: `encode_chat` encodes it apart, as the released encoder does, but no text template
    can (docs/gguf.md lists it). True only when the merge is the value's: with every value replaced by a plain word
    the run must split where the segments do, so markup that merges with markup still fails the check."""
    for run in _runs(segments):
        if not _splits_apart(run) and _splits_apart([("x" if k and run[k - 1] == '="' else piece)
                                                     for k, piece in enumerate(run)]):
            return True
    return False


def _splits_apart(run: list[str]) -> bool:
    """Whether K3's pre-tokenizer splits the joined run exactly where its pieces split (then BPE, which never
    crosses a pre-token, gives the joined text the pieces' ids)."""
    return _PRETOKEN.findall("".join(run)) == [t for piece in run for t in _PRETOKEN.findall(piece)]


def check_segments(segments: list[Segment], messages, kwargs) -> None:
    """Assert the template renders `segments` (build_segments' output for messages, kwargs) to the same ids."""
    text = render(with_parsed_arguments(messages), **kwargs)
    joined = "".join(s.text for s in segments)
    assert text == joined, f"the chat template renders\n{text!r}\nbut encode_chat builds\n{joined!r}"
    for run in _runs(segments):
        assert _splits_apart(run), (f"the pre-tokenizer merges across encode_chat's segments {run!r}: rendered text "
                                   "would tokenize differently")
