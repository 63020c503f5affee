"""Engine outputs -> OpenAI choices, one step at a time: where the server's text is made.

A choice's state turns each engine step's new ids into a `ChoiceDelta`: it detokenizes them (the engine makes no text
for the server's requests) and matches the stop strings. A streamed response sends each delta as chunks, a whole
response is the sum of the same deltas. So the stream concatenates to the whole response by construction (the fault
of vllm#51412 cannot happen): there is one path from ids to text, and each id is decoded once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kimik3.tokenizer import ResponseParser, StreamDecoder, Tokenizer
from kimik3.tokenizer.stops import StopText

__all__ = ["ChatChoice", "ChoiceDelta", "TextChoice", "chat_logprob", "legacy_logprobs"]


@dataclass
class ChoiceDelta:
    index: int
    reasoning: str = ""
    content: str = ""
    text: str = ""  # /v1/completions
    tool_calls: list[dict] = field(default_factory=list)  # {"id", "name", "arguments": JSON string}
    logprobs: list[Any] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def empty(self) -> bool:
        return not (self.reasoning or self.content or self.text or self.tool_calls or self.logprobs
                    or self.finish_reason)

    def extend(self, d: ChoiceDelta) -> None:
        """Add a later delta of the same choice (a whole response is the sum of its stream's deltas)."""
        self.reasoning += d.reasoning
        self.content += d.content
        self.text += d.text
        self.tool_calls += d.tool_calls
        self.logprobs += d.logprobs
        self.finish_reason, self.stop_reason = d.finish_reason or self.finish_reason, d.stop_reason or self.stop_reason


def _token_text(tok: Tokenizer, token_id: int) -> str:
    return tok.decode([token_id])


def chat_logprob(tok: Tokenizer, lp) -> dict:
    """One chat `logprobs.content` entry from an engine TokenLogprob."""
    def entry(t, v):
        return {"token": _token_text(tok, t), "logprob": v, "bytes": list(tok.decode_bytes([t]))}
    return {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}


class _Base:
    def __init__(self, index: int, tok: Tokenizer, stops: list[str]):
        self.index, self.tok = index, tok
        self.stop = StopText(stops)
        self.seen = 0  # generated ids consumed
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def _new(self, seq) -> tuple[list[int], list]:
        """A step's new ids and logprobs (the engine's outputs are deltas)."""
        return list(seq.token_ids), list(seq.logprobs) if seq.logprobs is not None else []


class ChatChoice(_Base):
    """One chat choice: the K3 response parser, stop strings over content, reasoning-token count.

    A choice that runs out of tokens (finish_reason "length") inside a tool call reports the partial call, its
    arguments as far as they were generated (what OpenAI's stream has sent by then), never an empty message;
    `forced_tool` (the one tool a required or named tool_choice allows) names the call even when the output
    stopped before the model had written the call's header. `written`: the opening the grammar wrote into the
    prompt (output all the same, counted in `seen`).
    """

    def __init__(self, index: int, tok: Tokenizer, *, thinking: bool, tools_declared: bool, stops: list[str],
                 id_prefix: str, logprobs: int | None, forced_tool: str | None = None, written: list[int] = ()):
        super().__init__(index, tok, stops)
        self.id_prefix, self.forced_tool = id_prefix, forced_tool
        self.parser = ResponseParser(tok, start_in="think" if thinking else "response", id_prefix=id_prefix,
                                     tools=tools_declared)
        self.logprobs = logprobs
        self.reasoning_tokens = 0
        self.tool_calls: list[dict] = []
        self.written = list(written)  # output the grammar wrote (a forced call's opening): before the engine's ids

    def advance(self, seq) -> ChoiceDelta:
        """The delta of one engine step (a SequenceOutput)."""
        delta = ChoiceDelta(self.index)
        if self.finished:
            return delta
        ids, lps = self._new(seq)
        if self.written:  # no logprobs to align: a call with logprobs has no written opening
            ids, self.written = self.written + ids, []
        for k, t in enumerate(ids):
            in_think = self.parser.channel == "think"
            d = self.parser.feed([t])
            self.seen += 1
            self.reasoning_tokens += in_think
            delta.reasoning += d.reasoning_content
            delta.content += self.stop.feed(d.content)
            for call in d.tool_calls:
                args = call["arguments"]
                self._add_call(delta, {"id": call["id"], "name": call["name"], "arguments": args if isinstance(
                    args, str) else json.dumps(args, ensure_ascii=False)})
            if self.logprobs is not None and k < len(lps):
                delta.logprobs.append(chat_logprob(self.tok, lps[k]))
            if self.stop.hit is not None:
                self.finish_reason, self.stop_reason = "stop", self.stop.hit
                delta.finish_reason, delta.stop_reason = "stop", self.stop.hit
                return delta
        if seq.finish_reason is not None:
            self.parser.finish()  # an unfinished tag or character at the end is dropped, never shown
            delta.content += self.stop.flush()
            reason = seq.finish_reason
            if reason == "length":
                self._add_partial_call(delta)
            if reason == "stop" and self.tool_calls:
                reason = "tool_calls"
            self.finish_reason, self.stop_reason = reason, seq.stop_reason
            delta.finish_reason, delta.stop_reason = reason, seq.stop_reason
        return delta


    def _add_call(self, delta: ChoiceDelta, call: dict) -> None:
        delta.tool_calls.append(call)
        self.tool_calls.append(call)

    def _add_partial_call(self, delta: ChoiceDelta) -> None:
        partial = self.parser.partial_call()
        if partial is None and self.forced_tool is not None and not self.tool_calls:
            partial = {"name": self.forced_tool, "arguments": ""}
        if partial is not None:  # ids continue the parser's numbering (1-based call position)
            self._add_call(delta, {"id": f"{self.id_prefix}{len(self.parser.tool_calls) + 1}", **partial})


class TextChoice(_Base):
    """One /v1/completions choice: raw text and legacy logprobs. Without stop strings the choice decodes its ids;
    with them the engine matched them (so the request ends at the very token that completes one) over the text it
    made for the request, and the choice takes that text (`SequenceOutput.text`): each id is decoded once, in one
    place. Special ids (markers, EOS) add no text unless `skip_special_tokens` is False (then they are written
    literally, a stop id's too), as in vLLM."""

    def __init__(self, index: int, tok: Tokenizer, *, engine_text: bool, logprobs: int | None,
                 skip_special_tokens: bool = True):
        super().__init__(index, tok, [])
        self.decoder = None if engine_text else StreamDecoder(tok)
        self.logprobs = logprobs
        self.skip_special = skip_special_tokens

    def advance(self, seq) -> ChoiceDelta:
        delta = ChoiceDelta(self.index)
        if self.finished:
            return delta
        ids, lps = self._new(seq)
        for k, t in enumerate(ids):
            self.seen += 1
            if self.decoder is not None and not (self.skip_special and self.tok.is_special(t)):
                delta.text += self.decoder.feed([t])
            if self.logprobs is not None and k < len(lps):
                delta.logprobs.append((t, lps[k]))
        if self.decoder is None:
            delta.text += seq.text
        if seq.finish_reason is not None:
            if self.decoder is not None:
                delta.text += self.decoder.flush()
            elif isinstance(seq.stop_reason, int) and not (self.skip_special and self.tok.is_special(seq.stop_reason)):
                delta.text += self.tok.decode([seq.stop_reason])  # the engine's text never shows a stop id
            self.finish_reason, self.stop_reason = seq.finish_reason, seq.stop_reason
            delta.finish_reason, delta.stop_reason = seq.finish_reason, seq.stop_reason
        return delta


def legacy_logprobs(tok: Tokenizer, entries: list[tuple[int, Any]], offset: int = 0) -> dict:
    """OpenAI's legacy completion logprobs {tokens, token_logprobs, top_logprobs, text_offset} from (id, lp|None).

    `top_logprobs` dicts hold the top-k tokens and, as vLLM's do, the chosen token itself.
    """
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t, lp in entries:
        text = _token_text(tok, t)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if lp is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(lp.logprob)
        top = {_token_text(tok, i): v for i, v in lp.top}
        top.setdefault(text, lp.logprob)
        out["top_logprobs"].append(top)
    return out
