"""The two generating endpoints: request -> engine requests -> whole response or SSE stream.

Both build the same per-choice deltas (serve/outputs.py); a stream sends them as chunks as they come, a whole
response sums them. A client that goes away has its requests aborted: a streaming response is cancelled by
Starlette when the socket closes, a waiting non-streaming handler polls `is_disconnected()` (Starlette only
cancels streams); either way the abort reaches the engine before its next step.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from kimik3.serve.outputs import ChatChoice, ChoiceDelta, TextChoice, legacy_logprobs
from kimik3.serve.protocol import APIError, parse_chat, parse_completion, sampling_kwargs
from kimik3.serve.runner import ACCEPTED

__all__ = ["chat_completion", "completion"]

log = logging.getLogger("kimik3.serve")
_COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class _Job:
    """The engine requests of one HTTP request, their outputs in one asyncio queue, and their timing."""

    def __init__(self, server, http: Request):
        self.server, self.http = server, http
        self.queue: asyncio.Queue = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self.live: dict[str, int] = {}  # engine request id -> index of the prompt
        self.arrival = time.monotonic()
        self.first = self.last = None
        self.cached = 0
        self.backlog: list = []

    async def submit(self, requests: list) -> None:
        """Queue every engine request; raises APIError (503 full, 400 refused) before anything was generated."""
        for k, req in enumerate(requests):
            def sink(item, k=k):  # called in this event loop (the runner batches a step's outputs per loop)
                self.queue.put_nowait((k, item))
            if not self.server.runner.submit(req, sink):
                self.abort()
                raise APIError("the server is at capacity; retry later", status=503, code="server_overloaded")
            self.live[req.request_id] = k
        pending, early = set(range(len(requests))), []
        while pending:  # each add is answered by the engine thread (accepted or refused) between two steps
            k, item = await self.queue.get()
            if item is ACCEPTED:
                pending.discard(k)
            elif isinstance(item, Exception) and k in pending:
                self.abort()
                raise APIError(str(item), code="invalid_request") if isinstance(item, ValueError) else item
            else:
                early.append((k, item))  # outputs of a request accepted before a later one was
        self.backlog = early

    def abort(self) -> None:
        for request_id in list(self.live):
            self.server.runner.abort(request_id)
        self.live.clear()

    async def outputs(self, *, poll: bool) -> AsyncIterator[tuple[int, Any]]:
        """(prompt index, RequestOutput) until every request finished; polls for a gone client when `poll`."""
        poll_s = self.server.config.disconnect_poll_s
        next_poll = time.monotonic() + poll_s
        try:
            while self.live:
                if poll and time.monotonic() >= next_poll:  # on a clock: a busy queue must not hide a gone client
                    next_poll = time.monotonic() + poll_s
                    if await self.http.is_disconnected():
                        log.info("client gone; aborting %s", ",".join(self.live))
                        self.abort()
                        return
                if self.backlog:
                    k, out = self.backlog.pop(0)
                elif not poll:  # a stream (Starlette cancels it when the client goes): no timer per token
                    k, out = await self.queue.get()
                else:
                    try:
                        k, out = await asyncio.wait_for(self.queue.get(), poll_s)
                    except asyncio.TimeoutError:
                        continue
                if isinstance(out, Exception):
                    raise APIError(f"the engine failed: {out}", status=500)
                self._time(out)
                if out.finished:
                    self.live.pop(out.request_id, None)
                yield k, out
        finally:
            self.abort()  # cancelled (stream closed) or finished early (stop strings): free the slots

    def finish_early(self, request_id: str, stop_reason: str | None) -> None:
        """Every choice of a request ended on a stop string (matched here, over the parsed text): the engine
        finishes it normally (reason "stop", its end snapshot taken for the next turn), not as an abort."""
        if self.live.pop(request_id, None) is not None:
            self.server.runner.stop(request_id, stop_reason)

    def _time(self, out) -> None:
        now = time.monotonic()
        if any(s.token_ids for s in out.outputs):
            m = self.server.metrics
            if self.first is None:
                self.first = now
                m.ttft.observe(now - self.arrival)
                queue_time = (out.metrics or {}).get("queue_time")
                if queue_time is not None:
                    m.queue.observe(queue_time)
            elif self.last is not None:
                m.itl.observe((now - self.last) / max(1, max(len(s.token_ids) for s in out.outputs)))
            self.last = now
        self.cached = max(self.cached, out.cached_tokens or 0)

    def record(self, request_id: str, prompt_tokens: int, completion_tokens: int, reasons: list[str],
               cached: int) -> None:
        m = self.server.metrics
        now = time.monotonic()
        m.prompt_tokens.inc(prompt_tokens)
        m.generation_tokens.inc(completion_tokens)
        m.cached_tokens.inc(cached)
        m.e2e.observe(now - self.arrival)
        for r in reasons:
            m.requests.labels(finish_reason=r or "abort").inc()
        ttft = f"{self.first - self.arrival:.3f}s" if self.first is not None else "-"
        log.info("%s prompt=%d completion=%d cached=%d ttft=%s e2e=%.3fs finish=%s", request_id, prompt_tokens,
                 completion_tokens, cached, ttft, now - self.arrival, ",".join(r or "abort" for r in reasons))


def _engine_request(**kw):
    from kimik3.inference.engine import Request as EngineRequest

    return EngineRequest(**kw)


def _sampling_params(**kw):
    from kimik3.inference.sampling import SamplingParams

    try:
        return SamplingParams(**kw)
    except ValueError as e:
        raise APIError(str(e)) from None


_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))  # json.dumps with arguments builds one per call


def _sse(obj: Any) -> str:
    return f"data: {_JSON.encode(obj)}\n\n"


def _sse_choices(head: dict):
    """`choices -> _sse({**head, "choices": choices})`, the same bytes, with the head (id, model, ...) encoded once
    per response instead of once per token."""
    prefix = f"data: {_JSON.encode(head)[:-1]},\"choices\":"
    return lambda choices: f"{prefix}{_JSON.encode(choices)}}}\n\n"


def _usage(prompt: int, completion: int, cached: int, reasoning: int | None = None) -> dict:
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
             "prompt_tokens_details": {"cached_tokens": cached}}
    if reasoning is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return usage


def _streaming(gen: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(gen, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def chat_completion(server, http: Request, body: dict):
    from kimik3.tokenizer import encode_chat

    plan = parse_chat(body, defaults=server.config.defaults, vocab_size=server.vocab_size)
    tok = server.tokenizer
    try:
        prompt = encode_chat(tok, plan.messages, **plan.encode_kwargs)
    except (ValueError, TypeError, KeyError, AttributeError) as e:  # malformed messages, whichever check meets them
        raise APIError(f"messages: {e}", param="messages") from None
    max_tokens = server.max_tokens(len(prompt), plan.sampling.max_tokens)
    params = _sampling_params(**sampling_kwargs(plan.sampling, max_tokens, logprobs=plan.logprobs))
    constraint = factory = None
    if plan.grammar is not None:
        # compiling a large schema can take a while: off the event loop
        grammar = await asyncio.to_thread(server.grammar, *plan.grammar, thinking=plan.thinking)
        factory = server.constraint_factory(grammar)
        constraint = factory()
    request_id = server.new_id("chatcmpl")
    n = plan.sampling.n
    kind, spec = plan.grammar or (None, None)
    forced = spec[0][0] if kind == "tools" and len(spec) == 1 else None  # the one tool the grammar allows
    choices = [ChatChoice(i, tok, thinking=plan.thinking, tools_declared=plan.tools_declared,
                          stops=plan.sampling.stop, id_prefix=f"call_{request_id[-8:]}_", logprobs=plan.logprobs,
                          forced_tool=forced)
               for i in range(n)]
    job = _Job(server, http)
    adapter = server.check_model(body)
    await job.submit([_engine_request(request_id=request_id, prompt_ids=prompt, params=params,
                                      cache_salt=plan.cache_salt, constraint=constraint,
                                      constraint_factory=factory, adapter=adapter)])
    created = int(time.time())
    head = {"id": request_id, "created": created, "model": server.model_name(adapter)}

    def finish():
        completion_tokens = sum(c.seen for c in choices)
        reasoning = sum(c.reasoning_tokens for c in choices)
        job.record(request_id, len(prompt), completion_tokens, [c.finish_reason for c in choices], job.cached)
        return _usage(len(prompt), completion_tokens, job.cached, reasoning)

    async def deltas(poll: bool) -> AsyncIterator[ChoiceDelta]:
        async for _, out in job.outputs(poll=poll):
            for seq in out.outputs:
                delta = choices[seq.index].advance(seq)
                if not delta.empty():
                    yield delta
            if not out.finished and all(c.finished for c in choices):
                job.finish_early(request_id, choices[0].stop_reason)

    if not plan.sampling.stream:
        acc = [{"reasoning": "", "content": "", "tool_calls": [], "logprobs": []} for _ in range(n)]
        async for d in deltas(poll=True):
            a = acc[d.index]
            a["reasoning"] += d.reasoning
            a["content"] += d.content
            a["tool_calls"] += d.tool_calls
            a["logprobs"] += d.logprobs
        if job.live or any(not c.finished for c in choices):  # the client went away
            return JSONResponse({"error": {"message": "client disconnected", "type": "aborted", "param": None,
                                           "code": "499"}}, status_code=499)
        out_choices = []
        for c, a in zip(choices, acc):
            message: dict[str, Any] = {"role": "assistant", "content": a["content"]}
            if a["reasoning"]:
                message["reasoning_content"] = a["reasoning"]
            if a["tool_calls"]:
                message["tool_calls"] = [{"id": t["id"], "type": "function",
                                          "function": {"name": t["name"], "arguments": t["arguments"]}}
                                         for t in a["tool_calls"]]
            out_choices.append({"index": c.index, "message": message,
                                "logprobs": {"content": a["logprobs"]} if plan.logprobs is not None else None,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return {**head, "object": "chat.completion", "choices": out_choices, "usage": finish()}

    chunk_head = {**head, "object": "chat.completion.chunk"}
    sse_choices = _sse_choices(chunk_head)

    def chunk(index: int, delta: dict, finish_reason: str | None = None, logprobs: list | None = None) -> str:
        choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish_reason}
        if logprobs:
            choice["logprobs"] = {"content": logprobs}
        return sse_choices([choice])

    async def stream() -> AsyncIterator[str]:
        for i in range(n):
            yield chunk(i, {"role": "assistant", "content": ""})
        calls_sent = [0] * n
        async for d in deltas(poll=False):
            text = {k: v for k, v in (("reasoning_content", d.reasoning), ("content", d.content)) if v}
            if text or d.logprobs:
                yield chunk(d.index, text, logprobs=d.logprobs)
            for call in d.tool_calls:  # a slot chunk (id, name, empty arguments), then the arguments
                slot = calls_sent[d.index]
                calls_sent[d.index] += 1
                yield chunk(d.index, {"tool_calls": [{"index": slot, "id": call["id"], "type": "function",
                                                      "function": {"name": call["name"], "arguments": ""}}]})
                yield chunk(d.index, {"tool_calls": [{"index": slot, "function": {"arguments": call["arguments"]}}]})
            if d.finish_reason is not None:
                yield chunk(d.index, {}, d.finish_reason)
        if all(c.finished for c in choices):
            usage = finish()
            if plan.sampling.include_usage:
                yield _sse({**chunk_head, "choices": [], "usage": usage})
            yield "data: [DONE]\n\n"

    return _streaming(stream())


async def completion(server, http: Request, body: dict):
    plan = parse_completion(body, defaults=server.config.defaults, vocab_size=server.vocab_size)
    tok = server.tokenizer
    # raw mode: the client writes the whole prompt, markers included (a chat prompt goes through encode_chat)
    prompts = [tok.encode(p, allow_special=True) if isinstance(p, str) else list(p) for p in plan.prompts]
    n = plan.sampling.n
    # max_tokens 0 (echo only): the engine runs the prompt and samples one token, which the response leaves out
    echo_only = plan.sampling.max_tokens == 0
    request_id = server.new_id("cmpl")
    adapter = server.check_model(body)
    requests, budgets = [], []
    for k, ids in enumerate(prompts):
        if not ids:
            raise APIError("prompt encodes to no tokens", param="prompt")
        budget = server.max_tokens(len(ids), 1 if echo_only else plan.sampling.max_tokens,
                                   default=_COMPLETION_DEFAULT_MAX_TOKENS, prompt_param="prompt")
        budgets.append(budget)
        params = _sampling_params(**sampling_kwargs(plan.sampling, budget, logprobs=plan.logprobs,
                                                    prompt_logprobs=plan.logprobs if plan.echo else None,
                                                    engine_stops=True))
        requests.append(_engine_request(request_id=f"{request_id}-{k}", prompt_ids=ids, params=params,
                                        cache_salt=plan.cache_salt, adapter=adapter))
    choices = [TextChoice(k * n + i, tok, stops=plan.sampling.stop, logprobs=plan.logprobs,
                          skip_special_tokens=plan.skip_special_tokens)
               for k in range(len(prompts)) for i in range(n)]
    echo_entries: dict[int, list] = {}
    job = _Job(server, http)
    await job.submit(requests)
    head = {"id": request_id, "object": "text_completion", "created": int(time.time()),
            "model": server.model_name(adapter)}
    cached = [0] * len(prompts)

    def finish():
        completion_tokens = 0 if echo_only else sum(c.seen for c in choices)
        job.record(request_id, sum(map(len, prompts)), completion_tokens, [c.finish_reason for c in choices],
                   sum(cached))
        return _usage(sum(map(len, prompts)), completion_tokens, sum(cached))

    async def deltas(poll: bool) -> AsyncIterator[tuple[int, ChoiceDelta]]:
        async for k, out in job.outputs(poll=poll):
            cached[k] = max(cached[k], out.cached_tokens or 0)
            if plan.echo and k not in echo_entries and out.prompt_logprobs is not None:
                echo_entries[k] = list(zip(prompts[k], out.prompt_logprobs))
            for seq in out.outputs:
                delta = choices[k * n + seq.index].advance(seq)
                if not delta.empty():
                    yield k, delta
            if not out.finished and all(c.finished for c in choices[k * n:(k + 1) * n]):
                job.finish_early(out.request_id, choices[k * n].stop_reason)

    if not plan.sampling.stream:
        acc = [{"text": "", "logprobs": []} for _ in choices]
        async for _, d in deltas(poll=True):
            acc[d.index]["text"] += d.text
            acc[d.index]["logprobs"] += d.logprobs
        if job.live or any(not c.finished for c in choices):
            return JSONResponse({"error": {"message": "client disconnected", "type": "aborted", "param": None,
                                           "code": "499"}}, status_code=499)
        out_choices = []
        for c, a in zip(choices, acc):
            k = c.index // n
            text, entries = a["text"], a["logprobs"]
            if echo_only:
                text, entries, c.finish_reason, c.stop_reason = "", [], "length", None
            if plan.echo:
                text = tok.decode(prompts[k]) + text
                entries = echo_entries.get(k, [(t, None) for t in prompts[k]]) + entries
            out_choices.append({"index": c.index, "text": text, "finish_reason": c.finish_reason,
                                "stop_reason": c.stop_reason,
                                "logprobs": legacy_logprobs(tok, entries) if plan.logprobs is not None else None})
        return {**head, "choices": out_choices, "usage": finish()}

    async def stream() -> AsyncIterator[str]:
        sse_choices = _sse_choices(head)
        if plan.echo:
            for c in choices:
                yield _sse({**head, "choices": [{"index": c.index, "text": tok.decode(prompts[c.index // n]),
                                                 "finish_reason": None, "logprobs": None}]})
        async for _, d in deltas(poll=False):
            choice = {"index": d.index, "text": d.text, "finish_reason": d.finish_reason,
                      "logprobs": legacy_logprobs(tok, d.logprobs) if plan.logprobs is not None else None}
            yield sse_choices([choice])
        if all(c.finished for c in choices):
            usage = finish()
            if plan.sampling.include_usage:
                yield _sse({**head, "choices": [], "usage": usage})
            yield "data: [DONE]\n\n"

    return _streaming(stream())
