"""The engine loop in its own thread, fed and drained through thread-safe queues.

The engine is synchronous: `step()` runs a forward. The asyncio front end never calls it; it puts commands in an
inbox (add, abort, call) and receives each request's outputs in its event loop. A step never waits on a socket, a
slow client never stalls the others (its outputs simply queue up), and an abort is applied before the next step's
forward.

Between two steps the engine thread does as little as it can: the GPU idles until the next forward is launched, and
any Python the thread runs then (or waits for: the event loop holds the GIL while it formats the previous step's
responses) adds to every request's latency. So a step's outputs cross to the event loop in one batch, one
`call_soon_threadsafe` per step rather than one per request: each of those writes the loop's wake-up socket, and
each such write releases the GIL to an event loop thread that then keeps it for up to a switch interval (5 ms).
Everything per token (detokenizing, stop strings, JSON, SSE) happens on the event loop side (the server's requests ask
the engine for no text), and while the device runs: the engine calls `step`'s `on_launch` once the step's forward is
queued, and the batch of step N is handed over then, during step N+1, not while the engine thread is still preparing
it (the front end's work would then take the GIL from that preparation, with the device idle).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol, runtime_checkable

__all__ = ["ACCEPTED", "EngineLike", "EngineRunner", "ServerShutdown"]

ACCEPTED = object()  # what a sink receives first when the engine took its request

log = logging.getLogger("kimik3.serve")


@runtime_checkable
class EngineLike(Protocol):
    """The server's seam: what it runs, `kimik3.inference.engine.Engine` or a stand-in without a model (the tests'
    scripted engine, the host-overhead bench's). Requests and outputs are the engine's (`Request`,
    `RequestOutput` deltas); everything is called from the engine thread."""

    max_model_len: int

    def add_request(self, request: Any) -> None: ...  # a ValueError refuses it (the client's 400)

    def abort(self, request_id: str) -> None: ...  # now; its final output ("abort") comes from the next step

    def stop(self, request_id: str, stop_reason: int | str | None = None) -> None: ...  # a normal end ("stop")

    # one step; `on_launch()` once its device work is queued (an engine without a device may call it at once)
    def step(self, on_launch: Callable[[], None] | None = None) -> list: ...

    def has_unfinished(self) -> bool: ...

    def reset_prefix_cache(self) -> None: ...

    @property
    def stats(self) -> dict: ...  # counters for /metrics


class ServerShutdown(Exception):
    """What a request's sink receives when the server shuts down while it runs (its stream ends with an error)."""


class EngineRunner:
    """Owns the engine thread.

    Args:
        engine: what the server runs (`EngineLike`).
        max_pending: requests admitted (running + waiting) at most; `submit` refuses more (the server answers 503).
    """

    def __init__(self, engine: EngineLike, *, max_pending: int = 1024):
        self.engine = engine
        self.max_pending = max_pending
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, tuple[Callable[[Any], None], Any]] = {}  # engine thread only: (sink, its loop)
        self._outbox: dict[Any, list] = {}  # engine thread only: loop -> [(sink, item)] not yet handed over
        self._pending = 0  # guarded by _lock (read by the front end for admission)
        self._lock = threading.Lock()
        self.stats: dict[str, Any] = dict(engine.stats)  # a copy taken after each step (read by /metrics)
        self.steps = 0
        self._stop = threading.Event()
        self._launched = False  # engine thread only: the current step's forward is queued (its hook ran)
        self._thread = threading.Thread(target=self._loop, name="kimik3-engine", daemon=True)
        self._thread.start()

    def submit(self, request, sink: Callable[[Any], None]) -> bool:
        """Queue a request; False if full. `sink` then gets ACCEPTED and RequestOutputs, or the Exception
        add_request raised: in the event loop that called `submit` (batched per step), else in the engine
        thread."""
        with self._lock:
            if self._pending >= self.max_pending:
                return False
            self._pending += 1
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        self._inbox.put(("add", request, (sink, loop)))
        return True

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id, None))

    def stop(self, request_id: str, stop_reason: str | None = None) -> None:
        """End a request normally (the front end matched its stop string): `Engine.stop`."""
        self._inbox.put(("stop", request_id, stop_reason))

    def call(self, fn: Callable[[Any], Any]) -> Future:
        """Run `fn(engine)` in the engine thread between two steps (reset_prefix_cache, ...)."""
        fut: Future = Future()
        self._inbox.put(("call", fn, fut))
        return fut

    async def acall(self, fn: Callable[[Any], Any]) -> Any:
        return await asyncio.wrap_future(self.call(fn))

    def abort_all(self, message: str) -> None:
        """Abort every request the engine holds: each sink receives ServerShutdown(message) (its stream ends with
        an error event); later submissions are refused."""
        with self._lock:
            self.max_pending = 0
        self._inbox.put(("abort_all", message, None))

    def shutdown(self, timeout: float = 5.0) -> bool:
        """Stop the engine thread (after its current step); whether it stopped within `timeout` seconds."""
        self._stop.set()
        self._inbox.put(("wake", None, None))
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _done(self, request_id: str) -> None:
        if self._sinks.pop(request_id, None) is not None:
            with self._lock:
                self._pending -= 1

    def _send(self, target: tuple[Callable[[Any], None], Any], item: Any) -> None:
        sink, loop = target
        if loop is None:
            sink(item)
        else:
            self._outbox.setdefault(loop, []).append((sink, item))

    def _flush(self) -> None:
        """Hand what the sinks got since the last flush to their event loops: one wake-up per loop."""
        for loop, batch in self._outbox.items():
            try:
                loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:  # that loop is closed: nobody is left to read these
                pass
        self._outbox = {}

    def _on_launch(self) -> None:
        self._launched = True
        if self._outbox:
            self._flush()

    def _handle(self, kind: str, item: Any, extra: Any) -> None:
        if kind == "add":
            try:
                self.engine.add_request(item)
            except Exception as e:  # noqa: BLE001 (a refused request is the client's answer, not a dead loop)
                with self._lock:
                    self._pending -= 1
                self._send(extra, e)
                return
            self._sinks[item.request_id] = extra
            self._send(extra, ACCEPTED)
        elif kind == "abort":
            if item in self._sinks:
                self.engine.abort(item)
                self._done(item)
        elif kind == "stop":
            if item in self._sinks:  # its final output comes from the next step, as any finished request's
                self.engine.stop(item, extra)
        elif kind == "abort_all":
            for request_id, target in list(self._sinks.items()):
                self.engine.abort(request_id)
                self._send(target, ServerShutdown(item))
                self._done(request_id)
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
                self._flush()
                continue
            self._launched = False
            try:
                outputs = self.engine.step(on_launch=self._on_launch)
            except Exception as e:
                log.exception("engine step failed; failing its requests")
                for request_id, target in list(self._sinks.items()):
                    self._send(target, e)
                    self.engine.abort(request_id)
                    self._done(request_id)
                self._flush()
                continue
            self.steps += 1
            for out in outputs:
                target = self._sinks.get(out.request_id)
                if target is not None:
                    self._send(target, out)
                    if out.finished:
                        self._done(out.request_id)
            # the step never called its hook (no forward, or an engine without a device), or no next forward will
            # come to hand them over during: what is held goes now
            if not self._launched or not self.engine.has_unfinished():
                self._flush()
            self.stats = dict(self.engine.stats)


def _deliver(batch: list) -> None:
    for sink, item in batch:
        sink(item)
