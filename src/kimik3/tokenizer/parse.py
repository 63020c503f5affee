"""Parse K3 model output (after the generation prompt) into reasoning, content and tool calls.

The model continues the prompt `<|open|>message role="assistant"<|sep|><|open|>think<|sep|>` with

    reasoning <|close|>think<|sep|> <|open|>response<|sep|> content <|close|>response<|sep|>
    [<|open|>tools<|sep|> (<|open|>call tool="f" index="1"<|sep|>
        (<|open|>argument key="k" type="number"<|sep|>42<|close|>argument<|sep|>)*
        | <|open|>json type="object"<|sep|>{...}<|close|>json<|sep|>
     <|close|>call<|sep|>)* <|close|>tools<|sep|>]
    <|close|>message<|sep|><|end_of_msg|>

(`start_in="response"` when thinking is off: the prompt opened `response`). Markers are special token ids, so
parsing works on ids; `feed_text` accepts decoded text with markers written literally, for engines that stream
strings. Text that merely *spells* a marker with ordinary tokens is text (the user may have asked about the
format); only the special ids are structure.

Recovery rules, for the shapes real K3 output takes and other servers get wrong:

1. A later channel ends the think channel: `<|open|>response`, `<|open|>tools`, an orphan `<|close|>response`
   or `<|close|>message` while thinking is an inferred think close (vllm#53246, vllm#54273). The text before it
   stays reasoning: it was already streamed as reasoning, and relabelling it afterwards would make the stream
   and the final response disagree.
2. No think channel at all: output that opens `response` (or `tools`) right away has empty reasoning and its text
   is content (sglang#33995).
3. `<|close|>message` (or `<|open|>tools`) in the response channel closes the response (vllm#51412); text after
   the think close with no `<|open|>response` opens it implicitly.
4. A tag that makes no sense inside reasoning or content (a misplaced tag, a header cut by another marker, a
   stray `<|sep|>`) is dropped to `remainder`; the channel goes on. `<|end_of_msg|>` anywhere ends the message.
5. Generation stopped in the middle of a tag, a call or a character: the unfinished part goes to `remainder`,
   never to content.
6. A tools block when the request declared no tools (`tools=False`): it is parsed and consumed, its calls are
   counted in `dropped_tool_calls` and not reported (sglang#39583: raw XTML must never reach content, and a client
   that declared no tools cannot act on a call).

Contract: the parser never raises on model output. Structural errors in the tools block put everything from
the error on into `remainder`. Reasoning, content and tool calls only ever grow, and what `feed` returns
concatenates to what `finish` reports, however the ids are split: a streamed response equals the whole one by
construction.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .bpe import StreamDecoder, Tokenizer

__all__ = ["Delta", "ParsedResponse", "ResponseParser", "parse_response", "parse_text"]

_MARKERS = ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")
_MARKER_RE = re.compile("|".join(re.escape(m) for m in _MARKERS))
_HEADER_RE = re.compile(r'\s*([A-Za-z_][\w-]*)((?:\s+[\w-]+="[^"]*")*)\s*')
_ATTR_RE = re.compile(r'([\w-]+)="([^"]*)"')
_JSON_TYPES = ("number", "boolean", "null", "object", "array")
_TEXT_STATES = ("think", "response")


@dataclass
class Delta:
    """What one `feed` added: reasoning and content text, and tool calls completed in that feed."""

    reasoning_content: str = ""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)


@dataclass
class ParsedResponse:
    """A whole parsed response.

    Attributes:
        tool_calls: [{"id": f"{id_prefix}{k}", "name": str, "arguments": dict}] for completed calls, k 1-based in
            order; `arguments` is the raw string when a json block does not parse.
        remainder: raw text (markers written literally) that was not parsed: dropped tags, an unfinished structure
            at the end, all output from a structural error in a tools block on, anything after `<|end_of_msg|>`.
        complete: the message was closed (`<|close|>message<|sep|><|end_of_msg|>`).
        dropped_tool_calls: calls parsed but not reported because the request declared no tools.
    """

    reasoning_content: str
    content: str
    tool_calls: list[dict]
    remainder: str
    complete: bool
    dropped_tool_calls: int = 0


def _unescape(value: str) -> str:
    return value.replace("&quot;", '"').replace("&amp;", "&")


def _typed(value: str, kind: str) -> Any:
    if kind in _JSON_TYPES:
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            pass  # keep the model's text: better a string the caller can inspect than a lost argument
    return value


class ResponseParser:
    """Incremental parser: `feed(ids)` (or `feed_text(text)`) returns a `Delta`; `finish()` the `ParsedResponse`.

    Args:
        tokenizer: needed by `feed` (ids); `feed_text` works without one.
        start_in: the channel the generation prompt opened: "think" (thinking on) or "response".
        id_prefix: tool call ids are f"{id_prefix}{k}" with k the 1-based call position.
        tools: whether the request declared tools; without, tool calls are consumed and dropped (rule 6).
    """

    def __init__(self, tokenizer: Tokenizer | None = None, *, start_in: str = "think", id_prefix: str = "call_",
                 tools: bool = True):
        if start_in not in ("think", "response"):
            raise ValueError(f"parse: start_in must be 'think' or 'response', got {start_in!r}")
        self._tok = tokenizer
        self._decoder = StreamDecoder(tokenizer) if tokenizer is not None else None
        self._markers = {tokenizer.encode_special(m): m for m in _MARKERS} if tokenizer is not None else {}
        self._id_prefix, self._tools = id_prefix, tools
        # state: think | response | between | tools | call | argument | json | closed | done | failed
        self._state = start_in
        self._start_in = start_in
        self._seen_response = start_in == "response"
        self._header: tuple[str, list[str]] | None = None  # (marker, header text pieces) while reading a tag
        self._pending_raw: list[str] = []  # raw text of the structure being parsed, not yet committed
        self._dropped_raw: list[str] = []  # dropped tags (rule 4) and everything after a structural error
        self._held_text = ""  # feed_text only: a possible partial marker at the end of the last chunk
        self._call: dict | None = None
        self._arg: tuple[str, str, list[str]] | None = None  # (key, type, value pieces) of the open argument/json
        self.reasoning_content, self.content = "", ""
        self.tool_calls: list[dict] = []
        self.dropped_tool_calls = 0
        self.complete = False
        self._delta = Delta()

    @property
    def channel(self) -> str:
        """Where the next id lands: think, response, between, tools, call, argument, json, closed, done, failed."""
        return self._state

    @property
    def ended(self) -> bool:
        """`<|end_of_msg|>` was seen: nothing after it is part of the response."""
        return self._state == "done"

    def feed(self, ids: Sequence[int]) -> Delta:
        """Consume model output token ids; returns what they added."""
        if self._tok is None:
            raise ValueError("parse: feed(ids) needs a tokenizer; use feed_text for decoded text")
        run: list[int] = []
        for i in ids:
            if i in self._markers:
                self._on_text(self._decoder.feed(run) + self._decoder.flush())  # a marker ends any partial char
                run = []
                self._on_marker(self._markers[i])
            else:
                run.append(i)
        self._on_text(self._decoder.feed(run))
        return self._take_delta()

    def feed_text(self, text: str) -> Delta:
        """Consume decoded output with markers written literally (`<|open|>` ...)."""
        text, self._held_text = self._held_text + text, ""
        pos = 0
        for m in _MARKER_RE.finditer(text):
            self._on_text(text[pos:m.start()])
            self._on_marker(m.group())
            pos = m.end()
        tail = text[pos:]
        # hold back a suffix that could be the start of a marker completed by the next chunk
        keep = max((k for m in _MARKERS for k in range(1, len(m)) if tail.endswith(m[:k])), default=0)
        self._on_text(tail[:len(tail) - keep])
        self._held_text = tail[len(tail) - keep:]
        return self._take_delta()

    def finish(self) -> ParsedResponse:
        """End of output: the whole parse. Held-back partial characters, markers and structures go to remainder."""
        tail = self._held_text + (self._decoder.flush() if self._decoder is not None else "")
        self._held_text = ""
        remainder = "".join(self._dropped_raw) + "".join(self._pending_raw) + tail
        return ParsedResponse(self.reasoning_content, self.content, list(self.tool_calls), remainder, self.complete,
                              self.dropped_tool_calls)

    def partial_call(self) -> dict | None:
        """The call the output stopped inside, {"name", "arguments": str}, else None (no call open, or tools=False).

        It is never one of `tool_calls` (an unfinished call is not a call); a server reports it when generation
        ran out of tokens, as OpenAI streams a call cut by max_tokens: the name and the arguments as far as they
        were generated. `arguments` is a json block's text as written so far, or the completed `argument` blocks
        as a JSON object ("" when none was written).
        """
        if self._call is None or not self._tools:
            return None
        if self._state == "json":
            return {"name": self._call["name"], "arguments": "".join(self._arg[2])}
        args = self._call["arguments"]
        text = args if isinstance(args, str) else (json.dumps(args, ensure_ascii=False) if args else "")
        return {"name": self._call["name"], "arguments": text}

    def _take_delta(self) -> Delta:
        delta, self._delta = self._delta, Delta()
        return delta

    def _fail(self, raw: str) -> None:
        self._state = "failed"
        self._dropped_raw += [*self._pending_raw, raw]
        self._pending_raw, self._header, self._call, self._arg = [], None, None, None

    def _drop_header(self) -> None:
        """Rule 4: a tag that cannot be read inside reasoning or content is dropped; the channel goes on."""
        self._dropped_raw += self._pending_raw
        self._pending_raw, self._header = [], None

    def _on_text(self, text: str) -> None:
        if not text:
            return
        if self._state in ("failed", "done"):
            self._dropped_raw.append(text)
        elif self._header is not None:
            self._header[1].append(text)
            self._pending_raw.append(text)
        elif self._state == "between" and not self._seen_response and not text.isspace():
            self._state, self._seen_response = "response", True  # rule 3: prose after the think close
            self._on_text(text)
        elif self._state == "think":
            self.reasoning_content += text
            self._delta.reasoning_content += text
        elif self._state == "response":
            self.content += text
            self._delta.content += text
        elif self._state in ("argument", "json"):
            self._arg[2].append(text)
            self._pending_raw.append(text)
        elif text.isspace():  # stray whitespace between tags carries nothing; tolerate it
            if self._state == "call":
                self._pending_raw.append(text)
        else:
            self._fail(text)

    def _on_marker(self, marker: str) -> None:
        if self._state in ("failed", "done"):
            self._dropped_raw.append(marker)
            return
        if self._header is not None and marker != "<|sep|>":
            if self._header_state_is_text():
                self._drop_header()  # a header cut short by another marker: drop it, then read this marker
            else:
                self._fail(marker)
                return
        if self._header is not None:
            kind, pieces = self._header
            self._header = None
            self._pending_raw.append(marker)
            m = _HEADER_RE.fullmatch("".join(pieces))
            if m is None:
                if self._header_state_is_text():
                    self._drop_header()
                else:
                    self._fail("")
                return
            attrs = {k: _unescape(v) for k, v in _ATTR_RE.findall(m.group(2))}
            self._on_tag(kind, m.group(1), attrs)
        elif marker in ("<|open|>", "<|close|>"):
            self._header = (marker, [])
            self._pending_raw.append(marker)
        elif marker == "<|end_of_msg|>":
            if self._state in ("call", "argument", "json", "tools"):
                self._dropped_raw += self._pending_raw  # an unfinished call is not a call
                self._pending_raw, self._call, self._arg = [], None, None
            self.complete = self._state == "closed"
            self._state = "done"
        elif self._state in _TEXT_STATES:
            self._dropped_raw.append(marker)  # a stray <|sep|> inside text
        else:
            self._fail(marker)

    def _header_state_is_text(self) -> bool:
        return self._state in (*_TEXT_STATES, "between")

    def _on_tag(self, kind: str, tag: str, attrs: dict[str, str]) -> None:
        """A complete `<|open|>tag attrs<|sep|>` (kind "<|open|>") or `<|close|>tag<|sep|>` in the current state."""
        state, opening = self._state, kind == "<|open|>"
        if state in _TEXT_STATES and not opening and tag == state:
            self._state = "between"
        elif state == "think" and not opening and tag == "response":
            self._state, self._seen_response = "between", True  # rule 1: an orphan response close
        elif state in (*_TEXT_STATES, "between") and not opening and tag == "message":
            self._state = "closed"  # rules 1 and 3
        elif state in (*_TEXT_STATES, "between") and opening and tag == "tools":
            self._state = "tools"  # rules 1 and 3
        elif state in ("think", "between") and opening and tag == "response" and not self._seen_response:
            self._state, self._seen_response = "response", True  # rules 1 and 2
        elif (state == "response" and not opening and tag == "think" and self._start_in == "response"
              and not self.content.strip()):
            self._state, self._seen_response = "between", False  # thinking off, yet the model thought first
        elif state in _TEXT_STATES or (state == "between" and not opening and tag == "response"):
            self._drop_header()  # rule 4 (a repeated response close included)
            return
        elif state == "tools" and opening and tag == "call" and attrs.get("tool"):
            self._state, self._call = "call", {"name": attrs["tool"], "arguments": {}}
            return  # the call stays pending until it closes
        elif state == "tools" and not opening and tag == "tools":
            self._state = "between"
        elif state == "tools" and not opening and tag == "message":
            self._state = "closed"
        elif state == "call" and opening and tag == "argument" and "key" in attrs:
            self._state, self._arg = "argument", (attrs["key"], attrs.get("type", "string"), [])
            return
        elif state == "call" and opening and tag == "json" and not self._call["arguments"]:
            self._state, self._arg = "json", ("", "object", [])
            return
        elif state in ("argument", "json") and not opening and tag == state:
            key, kind_, pieces = self._arg
            value = _typed("".join(pieces), kind_)
            if state == "json":  # a block that is not a JSON object stays the raw string
                self._call["arguments"] = value if isinstance(value, dict) else "".join(pieces)
            else:
                self._call["arguments"][key] = value
            self._state, self._arg = "call", None
            return
        elif state == "call" and not opening and tag == "call":
            self._end_call()
        else:
            self._fail("")
            return
        self._pending_raw = []

    def _end_call(self) -> None:
        self._state, call, self._call = "tools", self._call, None
        if not self._tools:
            self.dropped_tool_calls += 1
            return
        call = {"id": f"{self._id_prefix}{len(self.tool_calls) + 1}", **call}
        self.tool_calls.append(call)
        self._delta.tool_calls.append(call)


def parse_response(tokenizer: Tokenizer, ids: Sequence[int], *, start_in: str = "think",
                   tools: bool = True) -> ParsedResponse:
    """Parse complete (or truncated) model output ids; never raises on the output's content."""
    parser = ResponseParser(tokenizer, start_in=start_in, tools=tools)
    parser.feed(ids)
    return parser.finish()


def parse_text(text: str, *, start_in: str = "think", tools: bool = True) -> ParsedResponse:
    """`parse_response` for decoded text with markers written literally."""
    parser = ResponseParser(start_in=start_in, tools=tools)
    parser.feed_text(text)
    return parser.finish()
