"""K3's "XTML" chat format (spec §5): OpenAI-style messages -> prompt token ids.

The prompt is built as a list of segments, each a special token (structural marker), ordinary text, or a trusted
image prompt. `encode_chat` maps markers to special ids and encodes every text segment with `allow_special=False`,
so nothing a user, tool or attribute value contains can become a control token; only an image prompt (the
caller's, like the released processor's) is encoded with its `<|media_*|>` names as special ids. `render_chat`
joins the same segments into a readable string (markers shown literally) for debugging.

Segment boundaries follow the released encoder (`encoding_k3.py`, S1 `encoding.py`; Jinja port S3
`Kimi-K3.jinja`): tag names, ` key`, `="`, each attribute value and `"` are encoded as separate pieces, and each
text part of a content list separately. BPE never merges across those boundaries, so the ids match the
released encoder's even where one joined string would tokenize differently.

Layout: [tool-declare system msg] [thinking-effort system msg] messages... [tool-choice msg]
[response-format msg] [generation prompt]. Every message is `<|open|>message k="v"...<|sep|> body
<|close|>message<|sep|><|end_of_msg|>`.

Images (spec §4.4): an image part with `width`/`height` renders its prompt `image_prompt(width, height)`. As in the
released encoder, an image part without a size and a literal `<|kimi_image_placeholder|>` in message text each take
the next of `image_prompts` (the processor's prompts, in order); with `image_prompts=None` (no processor ran) an
unsized part renders the literal placeholder text and a placeholder in text stays text.

Assistant mask (`encode_chat_with_mask`): which ids an SFT loss trains on, as the released tokenizer marks them
(its `apply_chat_template(..., return_assistant_tokens_mask=True)` sets `assistant_masks` from each segment's
`is_assistant`): every segment of an assistant turn from its first channel's opener (`<|open|>think<|sep|>`, or
`<|open|>response<|sep|>` with thinking off) through `<|end_of_msg|>`, openers included: the reasoning, the
response, any tool calls, `<|close|>message<|sep|>` and `<|end_of_msg|>` (the stop id). Only the turn's header
`<|open|>message role="assistant"<|sep|>` is unmarked, as are system, user and tool messages, internal system
messages and the generation prompt.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, NamedTuple

from .bpe import Tokenizer

__all__ = ["IMAGE_PLACEHOLDER", "THINKING_EFFORTS", "encode_chat", "encode_chat_with_mask", "image_prompt",
           "render_chat"]

PLAIN, SPECIAL, MARKUP = 0, 1, 2  # ordinary text; one special token's name; trusted text whose specials count


class Segment(NamedTuple):
    text: str
    kind: int  # PLAIN, SPECIAL or MARKUP (an image prompt: encoded with specials allowed, as the released encoder)
    trained: bool = False  # inside an assistant turn's generated part (the SFT mask)


OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
# Not a vocabulary token: it BPE-splits into ordinary ids; engines and processors replace it (spec §4.4)
IMAGE_PLACEHOLDER = "<|kimi_image_placeholder|>"

# {low, medium, high, max} is what the S1/S3 encoders accept; a vLLM copy of an older encoding_k3.py revision
# lists {low, high, max} (spec §8 item 11). We follow S1/S3.
THINKING_EFFORTS = ("low", "medium", "high", "max")

# Fixed bodies of the internal system messages: identical wording in S1 `encoding.py` (Moonshot-copyright copy of
# `encoding_k3.py`) and S3 `Kimi-K3.jinja`.
_EFFORT_TEXT = ("`thinking_effort` guides on how much to think in your thinking channel (not including the "
                "response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
                "Now the system is invoked with `thinking_effort={effort}`.")
_TOOLS_TEXT = "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n{json}\n```"
_NEW_TOOLS_TEXT = ("## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n"
                   "You have access to all existing and extended tools.\n"
                   "Here are the specs for the extended tools.\n\n```json\n{json}\n```")
_TOOL_CHOICE_TEXT = {
    "required": "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.",
    "none": "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.",
}
_JSON_ONLY = ("The system is invoked with `response_format={kind}`.\nYour response must be raw JSON data without "
              "markdown code blocks (```json) or any additional formatting.")
_SCHEMA_TAIL = "\nThe JSON data must match the following schema:\n```json\n{json}\n```"


def image_prompt(width: int, height: int) -> str:
    """The K3 processor's prompt for one image of `width` x `height` source pixels (one pad; spec §4.4)."""
    return f"<|media_begin|>image {width}x{height}<|media_content|><|media_pad|><|media_end|>"


def _text(s: str) -> list[Segment]:
    return [Segment(s, PLAIN)] if s else []  # empty pieces encode to nothing; dropping them keeps renders identical


def _special(name: str) -> list[Segment]:
    return [Segment(name, SPECIAL)]


class _Images:
    """Hands out `image_prompts` in order to unsized image parts and literal placeholders (the released encoder's
    `_ImagePromptState`); counts every request so a mismatch can name both counts."""

    def __init__(self, prompts: Sequence[str] | None):
        if prompts is not None and (isinstance(prompts, str) or not all(isinstance(p, str) for p in prompts)):
            raise ValueError("chat: image_prompts must be a list of str (one prompt per image)")
        self.prompts, self.taken = (None if prompts is None else list(prompts)), 0

    def next(self) -> list[Segment]:
        if self.prompts is None:
            return _text(IMAGE_PLACEHOLDER)
        self.taken += 1
        return [Segment(self.prompts[self.taken - 1], MARKUP)] if self.taken <= len(self.prompts) else []

    def check(self) -> None:
        if self.prompts is not None and self.taken != len(self.prompts):
            more = "more" if self.taken > len(self.prompts) else "fewer"
            raise ValueError(f"chat: {more} image placeholders than image prompts: {self.taken} placeholders (image "
                             f"parts without a size, and {IMAGE_PLACEHOLDER} in text) but {len(self.prompts)} "
                             "image_prompts")

    def text(self, s: str) -> list[Segment]:
        """Message text, each literal placeholder replaced by the next image prompt (when prompts were given)."""
        if self.prompts is None or IMAGE_PLACEHOLDER not in s:
            return _text(s)
        pieces = s.split(IMAGE_PLACEHOLDER)
        segs = _text(pieces[0])
        for piece in pieces[1:]:
            segs += self.next() + _text(piece)
        return segs


def _escape(value: Any) -> str:
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def _open(tag: str, attrs: Sequence[tuple[str, Any]] = ()) -> list[Segment]:
    segs = [*_special(OPEN), *_text(tag)]
    for key, value in attrs:
        segs += [*_text(f" {key}"), *_text('="'), *_text(_escape(value)), *_text('"')]
    return segs + _special(SEP)


def _close(tag: str) -> list[Segment]:
    return _special(CLOSE) + _text(tag) + _special(SEP)


def _message(attrs: Sequence[tuple[str, Any]], body: list[Segment]) -> list[Segment]:
    return _open("message", attrs) + body + _close("message") + _special(END_OF_MSG)


def _system(kind: str, body: str) -> list[Segment]:
    return _message([("role", "system"), ("type", kind)], _text(body.strip()))


def _compact_sorted(value: Any) -> str:
    # sort_keys sorts every nested object and keeps array order: the released encoder's deep_sort_dict + compact dump
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True)


def _content(content: Any, where: str, images: _Images) -> list[Segment]:
    """A message's `content`: str, None, or a list of {"type": "text"} / {"type": "image"|"image_url"} parts."""
    if content is None:
        return []
    if isinstance(content, str):
        return images.text(content)
    if not isinstance(content, list):
        raise ValueError(f"chat: {where} must be a str, a list of parts or None, got {type(content).__name__}")
    segs: list[Segment] = []
    for j, part in enumerate(content):
        w = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise ValueError(f"chat: {w} must be a dict part, got {type(part).__name__}")
        if part.get("type") in ("image", "image_url"):
            size = (part.get("width"), part.get("height"))
            if size == (None, None):  # no processor ran: the next image prompt, or the literal placeholder
                segs += images.next()
                continue
            if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in size):
                raise ValueError(f"chat: {w} needs positive int 'width' and 'height' (the image's pixel size, "
                                 f"spec §4.4) or neither, got {size}")
            # one <|media_pad|> per image; the model expands it into the image's feature rows (spec §4.4)
            segs.append(Segment(image_prompt(*size), MARKUP))
        elif isinstance(part.get("text"), str):
            segs += images.text(part["text"])
        else:
            raise ValueError(f"chat: {w} must be an image part or carry a str 'text'")
    return segs


def _arguments(arguments: Any, where: str) -> dict | str:
    """A call's arguments as a dict, or the raw string when it is not valid JSON (rendered as a json block)."""
    if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
        return {}
    if isinstance(arguments, dict):
        return arguments
    if not isinstance(arguments, str):
        raise ValueError(f"chat: {where} must be a dict or a JSON object string, got {type(arguments).__name__}")
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    if not isinstance(parsed, dict):
        raise ValueError(f"chat: {where} must encode a JSON object, got {type(parsed).__name__}")
    return parsed


def _xtml_type(value: Any) -> str:
    if isinstance(value, bool):  # before int: bool is an int subclass
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "object" if isinstance(value, dict) else "array"


def _xtml_value(value: Any) -> str:
    # Non-strings use json.dumps' default separators (", ", ": "), not the compact form: that is what the released
    # encoder writes here (S1 `_xtml_value`; S3 uses `tojson`, the same dump), unlike the compact tool declaration.
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _function(call: Any, where: str) -> dict:
    if not isinstance(call, dict):
        raise ValueError(f"chat: {where} must be a dict, got {type(call).__name__}")
    fn = call["function"] if isinstance(call.get("function"), dict) else call
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError(f"chat: {where}.function.name is required")
    return fn


def _assistant(msg: dict, where: str, thinking: bool, images: _Images) -> list[Segment]:
    """An assistant message's body after its first channel's open tag (`think`, or `response` without thinking):
    the part the model generates after the generation prompt. The caller adds that open tag."""
    segs: list[Segment] = []
    if thinking:  # the think channel is structural in thinking mode: always present, possibly empty
        reasoning = msg.get("reasoning_content") or msg.get("reasoning")
        segs += images.text(str(reasoning)) if reasoning is not None and str(reasoning).strip() else []
        segs += _close("think") + _open("response")
    segs += _content(msg.get("content"), f"{where}.content", images) + _close("response")
    calls = msg.get("tool_calls")
    if calls:
        segs += _open("tools")
        for k, call in enumerate(calls, start=1):
            w = f"{where}.tool_calls[{k - 1}]"
            fn = _function(call, w)
            segs += _open("call", [("tool", fn["name"]), ("index", k)])
            args = _arguments(fn.get("arguments"), f"{w}.function.arguments")
            if isinstance(args, str):
                segs += _open("json", [("type", "object")]) + images.text(args) + _close("json")
            else:
                for key, value in args.items():
                    segs += (_open("argument", [("key", key), ("type", _xtml_type(value))])
                             + images.text(_xtml_value(value)) + _close("argument"))
            segs += _close("call")
        segs += _close("tools")
    return segs


def _order_tool_results(messages: list[dict]) -> list[tuple[int, dict, str | None]]:
    """(original position, message, name of the matched call) with each run of tool results in call order.

    A result is matched to the most recent assistant's `tool_calls` by `tool_call_id == id`; the matched call's name
    is authoritative. A run whose results all match is stably sorted by call position. A run with a result that
    matches no call (no id, or an id no call has) keeps its order and that result is rendered as given, named by
    its own `tool`/`name` or else by position: the released encoder's behaviour.
    """
    out: list[tuple[int, dict, str | None]] = []
    calls: dict[str, tuple[int, str]] = {}
    i = 0
    while i < len(messages):
        msg = messages[i]
        if msg["role"] != "tool":
            if msg["role"] == "assistant":
                calls = {}
                for k, call in enumerate(msg.get("tool_calls") or []):
                    fn = _function(call, f"messages[{i}].tool_calls[{k}]")
                    if call.get("id") is not None:
                        calls.setdefault(str(call["id"]), (k, fn["name"]))
            out.append((i, msg, None))
            i += 1
            continue
        run: list[tuple[int, dict, tuple[int, str] | None]] = []
        while i < len(messages) and messages[i]["role"] == "tool":
            call_id = messages[i].get("tool_call_id", messages[i].get("id"))
            match = calls.get(str(call_id)) if call_id is not None else None
            run.append((i, messages[i], match))
            i += 1
        if all(m is not None for _, _, m in run):
            run.sort(key=lambda r: r[2][0])
        out += [(j, m, match[1] if match else None) for j, m, match in run]
    return out


def _tool_result(msg: dict, where: str, index: int, matched: str | None, calls: list | None,
                 images: _Images) -> list[Segment]:
    name = matched or msg.get("tool") or msg.get("name")
    if name is None and calls and index <= len(calls):  # positional fallback: the index-th call of the assistant
        name = _function(calls[index - 1], f"tool_calls[{index - 1}]")["name"]
    if not name:
        raise ValueError(f"chat: {where} needs a tool name: a tool_call_id matching a call, 'tool'/'name', or a "
                         "preceding assistant call at its position")
    return _message([("role", "tool"), ("tool", name), ("index", index)],
                    _content(msg.get("content"), f"{where}.content", images))


def _response_format(response_format: Any) -> list[Segment]:
    kind = response_format.get("type") if isinstance(response_format, dict) else response_format
    if kind in (None, "text"):
        return []
    if kind == "json_object":
        return _system("response-format", _JSON_ONLY.format(kind=kind))
    if kind != "json_schema":
        raise ValueError(f"chat: response_format.type must be text, json_object or json_schema, got {kind!r}")
    wrapper = response_format.get("json_schema") if isinstance(response_format, dict) else None
    if wrapper is None:
        raise ValueError("chat: response_format.json_schema is required when type is json_schema")
    # OpenAI nests the schema as json_schema.schema; the released encoder also accepts json_schema.json_schema
    # or the bare schema
    schema = wrapper.get("schema", wrapper.get("json_schema", wrapper)) if isinstance(wrapper, dict) else wrapper
    return _system("response-format", _JSON_ONLY.format(kind=kind) + _SCHEMA_TAIL.format(json=_compact_sorted(schema)))


def build_segments(messages: Sequence[dict], *, tools: list | None = None, thinking: bool = True,
                   thinking_effort: str | None = "max", tool_choice: Any = None, response_format: Any = None,
                   add_generation_prompt: bool = True, image_prompts: Sequence[str] | None = None
                   ) -> list[Segment]:
    """The prompt as segments (text, kind, trained); see `encode_chat` for the arguments."""
    if thinking and thinking_effort is not None and thinking_effort not in THINKING_EFFORTS:
        raise ValueError(f"chat: thinking_effort must be one of {THINKING_EFFORTS} or None, got {thinking_effort!r}")
    if not (tool_choice is None or isinstance(tool_choice, dict) or tool_choice in ("auto", "required", "none")):
        raise ValueError(f"chat: tool_choice must be auto, required, none, a dict or None, got {tool_choice!r}")
    messages = list(messages)
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or msg.get("role") not in ("system", "user", "assistant", "tool"):
            role = msg.get("role") if isinstance(msg, dict) else type(msg).__name__
            raise ValueError(f"chat: messages[{i}].role must be system, user, assistant or tool, got {role!r}")
        if msg.get("name") is not None and not isinstance(msg["name"], str):  # OpenAI's schema: a string
            raise ValueError(f"chat: messages[{i}].name must be a str, got {type(msg['name']).__name__}")

    segs: list[Segment] = []
    if tools:
        segs += _system("tool-declare", _TOOLS_TEXT.format(json=_compact_sorted(tools)))
    if thinking and thinking_effort is not None:
        segs += _system("thinking-effort", _EFFORT_TEXT.format(effort=thinking_effort))

    images = _Images(image_prompts)
    calls: list | None = None
    tool_index = 0
    for i, msg, matched in _order_tool_results(messages):
        role, where = msg["role"], f"messages[{i}]"
        named = [("role", role)] + ([("name", msg["name"])] if msg.get("name") else [])
        if role == "system" and msg.get("tools"):  # mid-conversation tools: the "New Tools Available" declaration
            segs += _system("tool-declare", _NEW_TOOLS_TEXT.format(json=_compact_sorted(msg["tools"])))
        elif role in ("system", "user"):
            segs += _message(named, _content(msg.get("content"), f"{where}.content", images))
        elif role == "assistant":
            calls, tool_index = msg.get("tool_calls"), 0
            # the released tokenizer's assistant mask: the channel opener through <|end_of_msg|>
            turn = (_open("think" if thinking else "response") + _assistant(msg, where, thinking, images)
                    + _close("message") + _special(END_OF_MSG))
            segs += _open("message", named) + [seg._replace(trained=True) for seg in turn]
        else:
            tool_index += 1  # 1-based position among the results rendered since the last assistant turn
            segs += _tool_result(msg, where, tool_index, matched, calls, images)

    if isinstance(tool_choice, str) and tool_choice in _TOOL_CHOICE_TEXT:
        segs += _system("tool-choice", _TOOL_CHOICE_TEXT[tool_choice])
    segs += _response_format(response_format)
    if add_generation_prompt:
        segs += _open("message", [("role", "assistant")]) + _open("think" if thinking else "response")
    images.check()
    return segs


def encode_chat(tokenizer: Tokenizer, messages: Sequence[dict], *, tools: list | None = None, thinking: bool = True,
                thinking_effort: str | None = "max", tool_choice: Any = None, response_format: Any = None,
                add_generation_prompt: bool = True, image_prompts: Sequence[str] | None = None) -> list[int]:
    """Token ids of a K3 prompt (no BOS, as the released encoder).

    Args:
        messages: OpenAI-style dicts. `role` system/user/assistant/tool; `content` str, None or a list of
            {"type": "text", "text"} / {"type": "image", "width", "height"} parts (size optional, see
            `image_prompts`); optional `name`; assistant `reasoning_content` and `tool_calls` ([{id, type,
            function: {name, arguments: dict | JSON str}}]); tool results `tool_call_id` (re-sorted into the
            preceding assistant's call order when every result of the run matches a call; rendered as given
            otherwise).
        tools: OpenAI tool definitions, declared as key-sorted compact JSON.
        thinking: thinking mode (think channel in assistant turns, prompt opens `think`); off opens `response`.
        thinking_effort: low/medium/high/max or None (no effort message); only used when thinking.
        tool_choice: "required"/"none" add an instruction; "auto", None or a specific-function dict add nothing
            (the released encoder has no wording for a forced function).
        response_format: None, {"type": "text" | "json_object" | "json_schema", "json_schema": {...}}.
        add_generation_prompt: end with the opened assistant message and channel.
        image_prompts: the processor's prompt per image (e.g. `image_prompt(w, h)`), taken in order by image parts
            without a size and by each literal `<|kimi_image_placeholder|>` in message text; None: no processor
            ran (unsized parts render the placeholder text). Their number must equal the placeholders'.

    Raises:
        ValueError: naming the offending field (bad role, half-sized image part, unknown effort, a tool result
            with no name, image prompts and placeholders that do not pair up, ...).
    """
    return encode_chat_with_mask(tokenizer, messages, tools=tools, thinking=thinking, thinking_effort=thinking_effort,
                                 tool_choice=tool_choice, response_format=response_format,
                                 add_generation_prompt=add_generation_prompt, image_prompts=image_prompts)[0]


def encode_chat_with_mask(tokenizer: Tokenizer, messages: Sequence[dict], **kwargs: Any
                          ) -> tuple[list[int], list[bool]]:
    """(ids, assistant_mask): `encode_chat`'s ids and, per id, whether an SFT loss trains on it.

    Takes `encode_chat`'s keyword arguments. The mask is True on each assistant turn's generated part (the module
    docstring says which ids and why), False elsewhere; a trained id is a label, so a loss predicts it from the
    ids before it. Training data usually passes `add_generation_prompt=False`.
    """
    ids: list[int] = []
    mask: list[bool] = []
    for text, kind, trained in build_segments(messages, **kwargs):
        if kind == SPECIAL:
            piece = [tokenizer.encode_special(text)]
        else:  # image prompts are trusted markup: their <|media_*|> names become special ids
            piece = tokenizer.encode(text, allow_special=kind == MARKUP)
        ids += piece
        mask += [trained] * len(piece)
    return ids, mask


def render_chat(messages: Sequence[dict], **kwargs: Any) -> str:
    """The prompt `encode_chat` builds, as one string with special tokens written literally (for reading and tests).

    Takes the same keyword arguments as `encode_chat`. Note `tokenizer.encode(render_chat(...), allow_special=True)`
    may differ from `encode_chat` where BPE would merge across segment boundaries; `encode_chat` is the truth.
    """
    return "".join(seg.text for seg in build_segments(messages, **kwargs))
