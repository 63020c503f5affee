"""OpenAI request bodies -> what the engine runs: validated prompt ids, sampling parameters, constraints.

Every check raises `APIError` (400 `invalid_request_error` unless said otherwise) with the offending field in
`param`; unknown fields are ignored. Thinking and effort are read from the three spellings in the wild, with the
vendor's precedence (Kimi-Vendor-Verifier `test_thinking_effort.py`): `reasoning_effort` over `thinking.effort`
over `chat_template_kwargs.thinking_effort`; thinking on/off from `thinking.type`, then
`chat_template_kwargs.thinking` / `enable_thinking`, then `reasoning_effort: "none"`. Effort words clients send
beyond K3's own low/medium/high/max map as hosted Kimi does: minimal -> low, xhigh -> max.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kimik3.inference.sampling import SamplingParams

__all__ = ["APIError", "ChatPlan", "CompletionPlan", "parse_chat", "parse_completion", "sampling_kwargs"]

EFFORT_ALIASES = {"minimal": "low", "low": "low", "medium": "medium", "high": "high", "xhigh": "max", "max": "max"}
MAX_N = 16
MAX_STOP = 16


class APIError(Exception):
    """An error answered in OpenAI's shape `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code
        # any other 4xx (405, 413, 422 ...) is the client's request, as OpenAI and vLLM type it
        self.type = type or {401: "authentication_error", 404: "not_found_error", 503: "service_unavailable"}.get(
            status, "invalid_request_error" if 400 <= status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


def _bad(param: str, message: str) -> APIError:
    return APIError(f"{param}: {message}", param=param)


def _number(body: dict, key: str, lo: float, hi: float, *, default: float | None = None,
            integer: bool = False) -> Any:
    value = body.get(key)
    if value is None:
        return default
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or not math.isfinite(value) or not lo <= value <= hi:
        raise _bad(key, f"must be {'an integer' if integer else 'a number'} in [{lo}, {hi}], got {value!r}")
    return value


def _bool(body: dict, key: str, default: bool = False) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(key, f"must be a boolean, got {value!r}")
    return value


@dataclass
class Sampling:
    """Validated sampling fields shared by both endpoints (engine `SamplingParams` keywords, see sampling_kwargs)."""

    max_tokens: int | None
    n: int
    kwargs: dict[str, Any]
    stop: list[str]
    stream: bool
    include_usage: bool


def _sampling(body: dict, defaults: SamplingParams, vocab_size: int, least: int = 1) -> Sampling:
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    param = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                   or max_tokens < least):
        raise _bad(param, f"must be an integer >= {least}, got {max_tokens!r}")
    kw: dict[str, Any] = {
        "temperature": _number(body, "temperature", 0, 2, default=defaults.temperature),
        "top_p": _number(body, "top_p", 0, 1, default=defaults.top_p),
        "min_p": _number(body, "min_p", 0, 1, default=defaults.min_p),
        "repetition_penalty": _number(body, "repetition_penalty", 0, 10, default=defaults.repetition_penalty),
        "presence_penalty": _number(body, "presence_penalty", -2, 2, default=defaults.presence_penalty),
        "frequency_penalty": _number(body, "frequency_penalty", -2, 2, default=defaults.frequency_penalty),
        "seed": _number(body, "seed", -(2**63), 2**63 - 1, integer=True),
        "ignore_eos": _bool(body, "ignore_eos"),
    }
    if kw["top_p"] == 0:
        raise _bad("top_p", "must be > 0")
    if kw["repetition_penalty"] == 0:
        raise _bad("repetition_penalty", "must be > 0")
    top_k = _number(body, "top_k", -1, vocab_size, default=defaults.top_k, integer=True)
    kw["top_k"] = 0 if top_k == -1 else top_k  # vLLM spells "off" as -1
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise _bad("logit_bias", "must map token ids to biases in [-100, 100]")
        pairs = []
        for k, v in bias.items():
            try:
                token = int(k)
            except (TypeError, ValueError):
                raise _bad("logit_bias", f"key {k!r} is not a token id") from None
            if not 0 <= token < vocab_size:
                raise _bad("logit_bias", f"token id {token} is outside the vocabulary [0, {vocab_size})")
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
                raise _bad("logit_bias", f"bias of token {token} must be a number in [-100, 100], got {v!r}")
            pairs.append((token, float(v)))
        kw["logit_bias"] = tuple(pairs)
    n = _number(body, "n", 1, MAX_N, default=1, integer=True)
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop
    if stop is not None and (not isinstance(stop, list) or len(stop) > MAX_STOP
                             or not all(isinstance(s, str) and s for s in stop)):
        raise _bad("stop", f"must be a non-empty string or a list of at most {MAX_STOP} of them")
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or not stream):
        raise _bad("stream_options", "is an object, allowed only with stream: true")
    include_usage = bool(opts and _bool(opts, "include_usage"))
    return Sampling(max_tokens, n, kw, stop or [], stream, include_usage)


def sampling_kwargs(s: Sampling, max_tokens: int, *, logprobs: int | None, prompt_logprobs: int | None = None,
                    eos_id: int | None = None, engine_stops: bool = False, skip_special_tokens: bool = True
                    ) -> dict[str, Any]:
    """Keywords of the engine's SamplingParams. The server makes the text (serve/outputs.py) and the engine none,
    except where the engine matches the stop strings (`engine_stops`: /v1/completions, so a request ends at the
    very token that completes one): there the engine makes the text it matches over (special ids left out when
    `skip_special_tokens`), and the server takes it. Chat matches them over the parsed content in the server,
    which then ends the request (`Engine.stop`)."""
    stops = engine_stops and bool(s.stop)
    return {**s.kwargs, "max_new_tokens": max_tokens, "n": s.n, "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs, "stop_token_ids": () if eos_id is None else (eos_id,),
            "stop": tuple(s.stop) if stops else (), "detokenize": stops, "skip_special_tokens": skip_special_tokens}


@dataclass
class ChatPlan:
    messages: list[dict]
    sampling: Sampling
    # encode_chat keywords: tools, thinking, thinking_effort, tool_choice, response_format
    encode_kwargs: dict[str, Any]
    thinking: bool
    tools_declared: bool
    logprobs: int | None
    grammar: tuple[str, Any] | None = None  # ("json", schema | None) or ("tools", [(name, schema)])
    cache_salt: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _thinking(body: dict) -> tuple[bool, str | None]:
    """(thinking on, effort) from reasoning_effort, thinking {type, effort} and chat_template_kwargs."""
    thinking_obj = body.get("thinking")
    if thinking_obj is not None and not isinstance(thinking_obj, dict):
        raise _bad("thinking", "must be an object {type, effort}")
    ctk = body.get("chat_template_kwargs")
    if ctk is not None and not isinstance(ctk, dict):
        raise _bad("chat_template_kwargs", "must be an object")
    thinking_obj, ctk = thinking_obj or {}, ctk or {}
    on = True
    for where, value in (("chat_template_kwargs.enable_thinking", ctk.get("enable_thinking")),
                         ("chat_template_kwargs.thinking", ctk.get("thinking"))):
        if value is not None:
            if not isinstance(value, bool):
                raise _bad(where, f"must be a boolean, got {value!r}")
            on = value
    kind = thinking_obj.get("type")
    if kind is not None:
        if kind not in ("enabled", "disabled"):
            raise _bad("thinking.type", f"must be enabled or disabled, got {kind!r}")
        on = kind == "enabled"
    effort = "max"
    for where, value in (("chat_template_kwargs.thinking_effort", ctk.get("thinking_effort")),
                         ("thinking.effort", thinking_obj.get("effort")),
                         ("reasoning_effort", body.get("reasoning_effort"))):
        if value is None:
            continue
        if where == "reasoning_effort" and value == "none":
            on = False
            continue
        if not isinstance(value, str) or value not in EFFORT_ALIASES:
            words = sorted(EFFORT_ALIASES) + (["none"] if where == "reasoning_effort" else [])  # none: thinking off
            raise _bad(where, f"must be one of {words}, got {value!r}")
        effort = EFFORT_ALIASES[value]
    return on, effort


def _tools(body: dict) -> tuple[list[dict] | None, dict[str, Any]]:
    tools = body.get("tools")
    if tools is None:
        return None, {}
    if not isinstance(tools, list):
        raise _bad("tools", "must be a list of {type: function, function: {name, parameters}}")
    schemas = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise _bad(f"tools[{i}]", "must be {type: function, function: {name, parameters}}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _bad(f"tools[{i}].function.name", "is required")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise _bad(f"tools[{i}].function.parameters", "must be a JSON schema object")
        schemas[fn["name"]] = params if params is not None else {"type": "object"}
    return tools, schemas


def _tool_choice(body: dict, tools: list | None, schemas: dict) -> tuple[Any, tuple[str, Any] | None]:
    """(tool_choice for the encoder, grammar or None)."""
    choice = body.get("tool_choice")
    if choice is None or choice == "auto" or choice == "none":
        return choice, None
    if choice == "required":
        if not tools:
            raise _bad("tool_choice", "required needs a non-empty tools list")
        return choice, ("tools", list(schemas.items()))
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type", "function") != "function" or not isinstance(name, str):
            raise _bad("tool_choice", "a named choice is {type: function, function: {name}}")
        if name not in schemas:
            raise _bad("tool_choice", f"names {name!r}, which is not in tools ({sorted(schemas)})")
        return choice, ("tools", [(name, schemas[name])])
    raise _bad("tool_choice", f"must be auto, none, required or {{type: function, function: {{name}}}}, got {choice!r}")


def _response_format(body: dict) -> tuple[Any, tuple[str, Any] | None]:
    rf = body.get("response_format")
    if rf is None:
        return None, None
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise _bad("response_format", "must be {type: text | json_object | json_schema}")
    if rf["type"] == "text":
        return rf, None
    if rf["type"] == "json_object":
        return rf, ("json", None)
    js = rf.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("name"), str) or not isinstance(js.get("schema"), dict):
        raise _bad("response_format.json_schema", "needs a string name and an object schema")
    if "strict" in js and js["strict"] is not None and not isinstance(js["strict"], bool):
        raise _bad("response_format.json_schema.strict", "must be a boolean")
    return rf, ("json", js["schema"])


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}]", "must be an object")
        if m.get("role") == "system" and m.get("tools") is not None:  # dynamic tools (Kimi-Vendor-Verifier)
            if m.get("content") not in (None, ""):
                raise _bad(f"messages[{i}]", "a system message that declares tools must have empty content")
            _tools({"tools": m["tools"]})
        elif m.get("tools") is not None:
            raise _bad(f"messages[{i}].tools", "tools may be declared only in a system message")
        content = m.get("content")
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") in ("image", "image_url")
                                             for p in content):
            raise _bad(f"messages[{i}].content", "image parts are not served (this server is text only)")
    return messages


def parse_chat(body: dict, *, defaults: SamplingParams, vocab_size: int) -> ChatPlan:
    """Validate a /v1/chat/completions body (everything but `model`, checked by the caller)."""
    messages = _messages(body)
    sampling = _sampling(body, defaults, vocab_size)
    thinking, effort = _thinking(body)
    tools, schemas = _tools(body)
    tool_choice, tool_grammar = _tool_choice(body, tools, schemas)
    response_format, json_grammar = _response_format(body)
    if tool_grammar and json_grammar:
        raise _bad("response_format", "cannot be combined with a required or named tool_choice")
    logprobs = _bool(body, "logprobs")
    top = _number(body, "top_logprobs", 0, 20, integer=True)
    if top is not None and not logprobs:
        raise _bad("top_logprobs", "needs logprobs: true")
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise _bad("cache_salt", "must be a non-empty string")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise _bad("user", "must be a string")
    encode_kwargs = {"tools": tools, "thinking": thinking, "thinking_effort": effort if thinking else None,
                     "tool_choice": tool_choice, "response_format": response_format}
    declared = bool(tools) or any(m.get("role") == "system" and m.get("tools") for m in messages)
    return ChatPlan(messages, sampling, encode_kwargs, thinking, declared and tool_choice != "none",
                    (top or 0) if logprobs else None, tool_grammar or json_grammar, salt)


@dataclass
class CompletionPlan:
    prompts: list[list[int] | str]
    sampling: Sampling
    echo: bool
    logprobs: int | None
    cache_salt: str | None = None
    skip_special_tokens: bool = True


def parse_completion(body: dict, *, defaults: SamplingParams, vocab_size: int) -> CompletionPlan:
    """Validate a /v1/completions body: prompt is a string, a list of strings, token ids or lists of token ids."""
    prompt = body.get("prompt")
    def ids(x) -> bool:
        return isinstance(x, list) and bool(x) and all(isinstance(t, int) for t in x)

    if isinstance(prompt, str) or ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and (all(isinstance(p, str) for p in prompt)
                                                  or all(ids(p) for p in prompt)):
        prompts = list(prompt)
    else:
        raise _bad("prompt", "must be a string, a list of strings, a list of token ids or a list of such lists")
    for p in prompts:
        if isinstance(p, list) and any(isinstance(t, bool) or not 0 <= t < vocab_size for t in p):
            raise _bad("prompt", f"token ids must be in [0, {vocab_size})")
        if isinstance(p, str) and not p:
            raise _bad("prompt", "must not be empty")
    # max_tokens 0 with echo: the prompt's logprobs and nothing generated (scoring, as vLLM serves lm-eval)
    sampling = _sampling(body, defaults, vocab_size, least=0)
    _refuse_unsupported(body, sampling.n)
    logprobs = _number(body, "logprobs", 0, 20, integer=True)
    echo = _bool(body, "echo")
    if sampling.max_tokens == 0 and (not echo or sampling.stream):
        raise _bad("max_tokens", "0 generates nothing: it is allowed only with echo: true and without stream "
                                 "(to get the prompt's logprobs)")
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise _bad("cache_salt", "must be a non-empty string")
    return CompletionPlan(prompts, sampling, echo, logprobs, salt, _bool(body, "skip_special_tokens", True))


def _refuse_unsupported(body: dict, n: int) -> None:
    """Fields of /v1/completions this server does not implement: a 400 naming them, never a silent ignore."""
    if body.get("suffix") is not None:
        raise _bad("suffix", "is not supported (no fill-in-the-middle)")
    best_of = body.get("best_of")
    if best_of is not None and (isinstance(best_of, bool) or best_of not in (1, n)):
        raise _bad("best_of", f"is not supported beyond best_of = n ({n}); got {best_of!r}")
