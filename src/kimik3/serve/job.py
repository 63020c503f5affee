"""The engine requests of one HTTP request: submitted through the engine thread, their outputs in one asyncio queue,
aborted when the client goes away, and their timing in the metrics.

A client that goes away has its requests aborted: a streaming response is cancelled by Starlette when the socket
closes, a waiting non-streaming handler polls `is_disconnected()` (Starlette only cancels streams); either way the
abort reaches the engine before its next step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from kimik3.serve.protocol import APIError
from kimik3.serve.runner import ACCEPTED, ServerShutdown

log = logging.getLogger("kimik3.serve")


class Job:
    """The engine requests of one HTTP request, their outputs in one asyncio queue, and their timing."""

    def __init__(self, server, http: Request):
        self.server, self.http = server, http
        self.queue: asyncio.Queue = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self.live: dict[str, int] = {}  # engine request id -> index of the prompt
        self.arrival = time.monotonic()
        self.first = self.last = None
        self.cached_by: dict[int, int] = {}  # prompt index -> its prompt tokens the prefix cache held
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
                if isinstance(out, ServerShutdown):
                    self.live.clear()  # the engine aborted them
                    raise APIError(str(out), status=503, code="server_shutdown")
                if isinstance(out, Exception):
                    raise APIError(f"the engine failed: {out}", status=500)
                self._time(k, out)
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

    @property
    def cached(self) -> int:
        return sum(self.cached_by.values())

    def _time(self, k: int, out) -> None:
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
        self.cached_by[k] = max(self.cached_by.get(k, 0), out.cached_tokens or 0)

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
