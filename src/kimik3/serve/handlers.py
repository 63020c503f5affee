"""The two generating endpoints: request -> engine requests -> `respond`, one path for both.

Each endpoint parses its body, encodes its prompts and builds its choices (serve/outputs.py: the server's
detokenizing and stop strings, the engine's requests carry neither) and a `Format`; `respond` runs the requests and
turns the choices' per-step deltas into a whole response or an SSE stream. A stream sends the deltas as chunks as
they come, a whole response sums the same deltas.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from kimik3.serve.job import Job
from kimik3.serve.outputs import ChatChoice, ChoiceDelta, TextChoice, legacy_logprobs
from kimik3.serve.protocol import APIError, Sampling, parse_chat, parse_completion, sampling_kwargs

__all__ = ["chat_completion", "completion", "respond"]

_COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))  # json.dumps with arguments builds one per call


@dataclass
class Format:
    """How an endpoint writes its choices: `whole(choice, the sum of its deltas)` is one choice of a whole response,
    `chunk(delta)` the choice objects a stream sends for one delta, `opening` the stream's first ones (one chunk
    each); `objects`: the whole response's and the chunks' object names."""

    objects: tuple[str, str]
    whole: Callable[[Any, ChoiceDelta], dict]
    chunk: Callable[[ChoiceDelta], list[dict]]
    opening: list[dict] = field(default_factory=list)


@dataclass
class Usage:
    """What a response's usage counts: prompt tokens, each choice's completion tokens (a function of the finished
    choices), and the reasoning tokens when the endpoint reports them."""

    prompt_tokens: int
    completion: Callable[[], int]
    reasoning: Callable[[], int] | None = None


async def respond(job: Job, request_id: str, choices: list, n: int, sampling: Sampling, head: dict, fmt: Format,
                  usage: Usage, on_output: Callable[[int, Any], None] | None = None):
    """The submitted `job`'s outputs as a whole response or an SSE stream (`sampling.stream`). Choice k * n + i is
    choice i of the job's request k; `on_output(k, out)` sees every engine output first. A request whose choices
    all ended on a stop string the server matched ends in the engine as a normal stop."""

    async def deltas(poll: bool) -> AsyncIterator[ChoiceDelta]:
        async for k, out in job.outputs(poll=poll):
            if on_output is not None:
                on_output(k, out)
            for seq in out.outputs:
                delta = choices[k * n + seq.index].advance(seq)
                if not delta.empty():
                    yield delta
            mine = choices[k * n:(k + 1) * n]
            if not out.finished and all(c.finished for c in mine):
                job.finish_early(out.request_id, mine[0].stop_reason)

    def finish() -> dict:
        completion = usage.completion()
        job.record(request_id, usage.prompt_tokens, completion, [c.finish_reason for c in choices], job.cached)
        out = {"prompt_tokens": usage.prompt_tokens, "completion_tokens": completion,
               "total_tokens": usage.prompt_tokens + completion, "prompt_tokens_details": {"cached_tokens": job.cached}}
        if usage.reasoning is not None:
            out["completion_tokens_details"] = {"reasoning_tokens": usage.reasoning()}
        return out

    whole_object, chunk_object = fmt.objects
    if not sampling.stream:
        acc = [ChoiceDelta(c.index) for c in choices]
        async for d in deltas(poll=True):
            acc[d.index].extend(d)
        if job.live or any(not c.finished for c in choices):  # the client went away
            return JSONResponse({"error": {"message": "client disconnected", "type": "aborted", "param": None,
                                           "code": "499"}}, status_code=499)
        return {**head, "object": whole_object, "choices": [fmt.whole(c, a) for c, a in zip(choices, acc)],
                "usage": finish()}

    chunk_head = {**head, "object": chunk_object}
    # the head (id, model, ...) encoded once per response instead of once per token: the same bytes
    prefix = f"data: {_JSON.encode(chunk_head)[:-1]},\"choices\":"

    def sse(choice: dict) -> str:
        return f"{prefix}{_JSON.encode([choice])}}}\n\n"

    async def stream() -> AsyncIterator[str]:
        for choice in fmt.opening:
            yield sse(choice)
        try:
            async for d in deltas(poll=False):
                for choice in fmt.chunk(d):
                    yield sse(choice)
        except APIError as e:  # the engine failed or the server shuts down: an error event ends the stream
            yield f"data: {_JSON.encode(e.body())}\n\n"
            yield "data: [DONE]\n\n"
            return
        if all(c.finished for c in choices):
            counts = finish()
            if sampling.include_usage:
                yield f"data: {_JSON.encode({**chunk_head, 'choices': [], 'usage': counts})}\n\n"
            yield "data: [DONE]\n\n"

    return StreamingResponse(stream(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _engine_request(**kw):
    from kimik3.inference.engine import Request as EngineRequest

    return EngineRequest(**kw)


def _sampling_params(**kw):
    from kimik3.inference.sampling import SamplingParams

    try:
        return SamplingParams(**kw)
    except ValueError as e:
        raise APIError(str(e)) from None


async def chat_completion(server, http: Request, body: dict, adapter: str | None):
    from kimik3.tokenizer import encode_chat

    plan = parse_chat(body, defaults=server.config.defaults, vocab_size=server.vocab_size)
    tok = server.tokenizer
    try:
        prompt = encode_chat(tok, plan.messages, **plan.encode_kwargs)
    except (ValueError, TypeError, KeyError, AttributeError) as e:  # malformed messages, whichever check meets them
        raise APIError(f"messages: {e}", param="messages") from None
    max_tokens = server.max_tokens(len(prompt), plan.sampling.max_tokens)
    kind, spec = plan.grammar or (None, None)
    constraint = factory = None
    written: list[int] = []  # the opening a forced call's grammar allows alone: written, not sampled (yet output)
    if plan.grammar is not None:
        # compiling a large schema can take a while: off the event loop
        grammar = await asyncio.to_thread(server.grammar, *plan.grammar, thinking=plan.thinking)
        fresh = server.constraint_factory(grammar)
        if kind == "tools" and plan.logprobs is None:  # with logprobs it is sampled, each token's reported
            written = fresh().forced()[: max_tokens - 1]  # at least one token is left to sample

        def factory():
            c = fresh()
            for t in written:
                c.accept(t)
            return c

        constraint = factory()
    left = max_tokens - len(written)
    params = _sampling_params(**sampling_kwargs(plan.sampling, left, logprobs=plan.logprobs))
    request_id = server.new_id("chatcmpl")
    n = plan.sampling.n
    forced = spec[0][0] if kind == "tools" and len(spec) == 1 else None  # the one tool the grammar allows
    choices = [ChatChoice(i, tok, thinking=plan.thinking, tools_declared=plan.tools_declared,
                          stops=plan.sampling.stop, id_prefix=f"call_{request_id[-8:]}_", logprobs=plan.logprobs,
                          forced_tool=forced, written=written)
               for i in range(n)]
    job = Job(server, http)
    # the written opening is prefilled with the prompt (one chunk, not a decode step per token)
    await job.submit([_engine_request(request_id=request_id, prompt_ids=prompt + written, params=params,
                                      cache_salt=plan.cache_salt, constraint=constraint,
                                      constraint_factory=factory, adapter=adapter)])
    head = {"id": request_id, "created": int(time.time()), "model": server.model_name(adapter)}
    usage = Usage(len(prompt), lambda: sum(c.seen for c in choices), lambda: sum(c.reasoning_tokens for c in choices))
    return await respond(job, request_id, choices, n, plan.sampling, head, _chat_format(n, plan.logprobs), usage)


def _chat_format(n: int, logprobs: int | None) -> Format:
    calls_sent = [0] * n  # tool calls a stream has opened, per choice

    def whole(c: ChatChoice, a: ChoiceDelta) -> dict:
        message: dict[str, Any] = {"role": "assistant", "content": a.content}
        if a.reasoning:
            message["reasoning_content"] = a.reasoning
        if a.tool_calls:
            message["tool_calls"] = [{"id": t["id"], "type": "function",
                                      "function": {"name": t["name"], "arguments": t["arguments"]}}
                                     for t in a.tool_calls]
        return {"index": c.index, "message": message,
                "logprobs": {"content": a.logprobs} if logprobs is not None else None,
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}

    def chunk(d: ChoiceDelta) -> list[dict]:
        def of(delta: dict, finish_reason: str | None = None, lps: list | None = None) -> dict:
            choice: dict[str, Any] = {"index": d.index, "delta": delta, "finish_reason": finish_reason}
            if lps:
                choice["logprobs"] = {"content": lps}
            return choice

        out = []
        text = {k: v for k, v in (("reasoning_content", d.reasoning), ("content", d.content)) if v}
        if text or d.logprobs:
            out.append(of(text, lps=d.logprobs))
        for call in d.tool_calls:  # a slot chunk (id, name, empty arguments), then the arguments
            slot = calls_sent[d.index]
            calls_sent[d.index] += 1
            out.append(of({"tool_calls": [{"index": slot, "id": call["id"], "type": "function",
                                           "function": {"name": call["name"], "arguments": ""}}]}))
            out.append(of({"tool_calls": [{"index": slot, "function": {"arguments": call["arguments"]}}]}))
        if d.finish_reason is not None:
            out.append(of({}, d.finish_reason))
        return out

    opening = [{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None} for i in range(n)]
    return Format(("chat.completion", "chat.completion.chunk"), whole, chunk, opening)


async def completion(server, http: Request, body: dict, adapter: str | None):
    plan = parse_completion(body, defaults=server.config.defaults, vocab_size=server.vocab_size)
    tok = server.tokenizer
    # raw mode: the client writes the whole prompt, markers included (a chat prompt goes through encode_chat)
    prompts = [tok.encode(p, allow_special=True) if isinstance(p, str) else list(p) for p in plan.prompts]
    n = plan.sampling.n
    # max_tokens 0 (echo only): the engine runs the prompt and samples one token, which the response leaves out
    echo_only = plan.sampling.max_tokens == 0
    request_id = server.new_id("cmpl")
    requests = []
    for k, ids in enumerate(prompts):
        if not ids:
            raise APIError("prompt encodes to no tokens", param="prompt")
        budget = server.max_tokens(len(ids), 1 if echo_only else plan.sampling.max_tokens,
                                   default=_COMPLETION_DEFAULT_MAX_TOKENS, prompt_param="prompt")
        params = _sampling_params(**sampling_kwargs(plan.sampling, budget, logprobs=plan.logprobs,
                                                    prompt_logprobs=plan.logprobs if plan.echo else None,
                                                    engine_stops=True, skip_special_tokens=plan.skip_special_tokens))
        requests.append(_engine_request(request_id=f"{request_id}-{k}", prompt_ids=ids, params=params,
                                        cache_salt=plan.cache_salt, adapter=adapter))
    choices = [TextChoice(k * n + i, tok, engine_text=bool(plan.sampling.stop), logprobs=plan.logprobs,
                          skip_special_tokens=plan.skip_special_tokens)
               for k in range(len(prompts)) for i in range(n)]
    echo_entries: dict[int, list] = {}

    def on_output(k: int, out) -> None:
        if plan.echo and k not in echo_entries and out.prompt_logprobs is not None:
            echo_entries[k] = list(zip(prompts[k], out.prompt_logprobs))

    def whole(c: TextChoice, a: ChoiceDelta) -> dict:
        k = c.index // n
        text, entries = a.text, a.logprobs
        if echo_only:
            text, entries, c.finish_reason, c.stop_reason = "", [], "length", None
        if plan.echo:
            text = tok.decode(prompts[k]) + text
            entries = echo_entries.get(k, [(t, None) for t in prompts[k]]) + entries
        return {"index": c.index, "text": text, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                "logprobs": legacy_logprobs(tok, entries) if plan.logprobs is not None else None}

    def chunk(d: ChoiceDelta) -> list[dict]:
        return [{"index": d.index, "text": d.text, "finish_reason": d.finish_reason,
                 "logprobs": legacy_logprobs(tok, d.logprobs) if plan.logprobs is not None else None}]

    opening = [{"index": c.index, "text": tok.decode(prompts[c.index // n]), "finish_reason": None, "logprobs": None}
               for c in choices] if plan.echo else []
    job = Job(server, http)
    await job.submit(requests)
    head = {"id": request_id, "created": int(time.time()), "model": server.model_name(adapter)}
    usage = Usage(sum(map(len, prompts)), lambda: 0 if echo_only else sum(c.seen for c in choices))
    return await respond(job, request_id, choices, n, plan.sampling, head,
                         Format(("text_completion", "text_completion"), whole, chunk, opening), usage, on_output)
