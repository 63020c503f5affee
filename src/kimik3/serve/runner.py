"""The engine loop in its own thread, fed and drained through thread-safe queues.

The engine is synchronous: `step()` runs a forward. The asyncio front end never calls it; it puts commands in an
inbox (add, abort, call) and receives each request's outputs through its own asyncio queue, woken with
`call_soon_threadsafe`. A step never waits on a socket, a slow client never stalls the others (its outputs simply
queue up), and an abort is applied before the next step's forward.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

__all__ = ["ACCEPTED", "EngineRunner"]

ACCEPTED = object()  # what a sink receives first when the engine took its request

log = logging.getLogger("kimik3.serve")


class EngineRunner:
    """Owns the engine thread.

    Args:
        engine: an object with the engine contract (add_request, abort, step, has_unfinished, stats).
        max_pending: requests admitted (running + waiting) at most; `submit` refuses more (the server answers 503).
    """

    def __init__(self, engine, *, max_pending: int = 1024):
        self.engine = engine
        self.max_pending = max_pending
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Callable[[Any], None]] = {}  # engine thread only
        self._pending = 0  # guarded by _lock (read by the front end for admission)
        self._lock = threading.Lock()
        self.stats: dict[str, Any] = dict(engine.stats)  # a copy taken after each step (read by /metrics)
        self.steps = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kimik3-engine", daemon=True)
        self._thread.start()

    def submit(self, request, sink: Callable[[Any], None]) -> bool:
        """Queue a request; False if full. From the engine thread `sink` then gets ACCEPTED and RequestOutputs,
        or the Exception add_request raised."""
        with self._lock:
            if self._pending >= self.max_pending:
                return False
            self._pending += 1
        self._inbox.put(("add", request, sink))
        return True

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id, None))

    def call(self, fn: Callable[[Any], Any]) -> Future:
        """Run `fn(engine)` in the engine thread between two steps (reset_prefix_cache, ...)."""
        fut: Future = Future()
        self._inbox.put(("call", fn, fut))
        return fut

    async def acall(self, fn: Callable[[Any], Any]) -> Any:
        return await asyncio.wrap_future(self.call(fn))

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._inbox.put(("wake", None, None))
        self._thread.join(timeout)

    def _done(self, request_id: str) -> None:
        if self._sinks.pop(request_id, None) is not None:
            with self._lock:
                self._pending -= 1

    def _handle(self, kind: str, item: Any, extra: Any) -> None:
        if kind == "add":
            try:
                self.engine.add_request(item)
            except Exception as e:  # noqa: BLE001 (a refused request is the client's answer, not a dead loop)
                with self._lock:
                    self._pending -= 1
                extra(e)
                return
            self._sinks[item.request_id] = extra
            extra(ACCEPTED)
        elif kind == "abort":
            if item in self._sinks:
                self.engine.abort(item)
                self._done(item)
        elif kind == "call":
            try:
                extra.set_result(item(self.engine))
            except Exception as e:  # noqa: BLE001
                extra.set_exception(e)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                # idle: block until a command arrives; busy: only drain what is there
                block = not self.engine.has_unfinished()
                while True:
                    self._handle(*self._inbox.get(block=block, timeout=0.5 if block else None))
                    block = False
            except queue.Empty:
                pass
            if self._stop.is_set() or not self.engine.has_unfinished():
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:
                log.exception("engine step failed; failing its requests")
                for request_id, sink in list(self._sinks.items()):
                    sink(e)
                    self.engine.abort(request_id)
                    self._done(request_id)
                continue
            self.steps += 1
            self.stats = dict(self.engine.stats)
            for out in outputs:
                sink = self._sinks.get(out.request_id)
                if sink is not None:
                    sink(out)
                    if out.finished:
                        self._done(out.request_id)
