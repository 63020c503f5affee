"""The engine thread's hand-off (serve/runner.py): one event-loop wake-up per step, outputs in order, and a step's
outputs handed over once the next step's forward is queued (when the engine calls `step`'s `on_launch`)."""

from __future__ import annotations

import asyncio
import threading

from kimik3.serve.runner import ACCEPTED, EngineRunner


class _Out:
    def __init__(self, request_id: str, step: int, finished: bool):
        self.request_id, self.step, self.finished = request_id, step, finished


class _StepEngine:
    """Each request runs `steps` steps; each step one output per request. Records, per step, when it launched."""

    def __init__(self, steps: int, hook: bool):
        self.steps, self.live, self.step_no = steps, {}, 0
        self.in_step, self.hook = False, hook
        self.stats: dict = {}

    def add_request(self, request) -> None:
        self.live[request.request_id] = 0

    def abort(self, request_id: str) -> None:
        self.live.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.live)

    def step(self, on_launch=None) -> list:
        self.step_no += 1
        self.in_step = True
        if self.hook and on_launch is not None:
            on_launch()
        outs = []
        for rid in list(self.live):
            self.live[rid] += 1
            finished = self.live[rid] == self.steps
            outs.append(_Out(rid, self.step_no, finished))
            if finished:
                del self.live[rid]
        self.in_step = False
        return outs


class _Req:
    def __init__(self, request_id: str):
        self.request_id = request_id


def _run(hook: bool, n: int = 8, steps: int = 5):
    engine = _StepEngine(steps, hook)
    runner = EngineRunner(engine)
    wakeups: list[tuple[bool, int]] = []  # (inside a step?, its number) at each call_soon_threadsafe

    async def main():
        loop = asyncio.get_running_loop()
        real = loop.call_soon_threadsafe

        def counting(cb, *args, **kw):  # in the engine thread
            wakeups.append((engine.in_step, engine.step_no))
            return real(cb, *args, **kw)

        loop.call_soon_threadsafe = counting
        got: dict[str, list] = {f"r{i}": [] for i in range(n)}
        done = asyncio.Event()

        def sink(rid):
            def put(item):
                assert threading.current_thread() is threading.main_thread()
                got[rid].append(item)
                if all(x and x[-1] is not ACCEPTED and x[-1].finished for x in got.values()):
                    done.set()
            return put

        gate = threading.Event()
        runner.call(lambda _: gate.wait(10))  # the engine thread waits: it then sees all the adds at once
        for rid in got:
            assert runner.submit(_Req(rid), sink(rid))
        gate.set()
        await asyncio.wait_for(done.wait(), 10)
        return got

    try:
        got = asyncio.run(main())
    finally:
        runner.shutdown()
    return engine, got, wakeups


def test_outputs_arrive_in_order_with_one_wakeup_per_step():
    for hook in (False, True):
        engine, got, wakeups = _run(hook)
        for items in got.values():
            assert items[0] is ACCEPTED
            assert [o.step for o in items[1:]] == list(range(1, 6))
        # one per step (not one per request), and with the hook one more: the last step's, after it
        assert len(wakeups) == engine.step_no + hook, (hook, wakeups)


def test_with_the_hook_a_step_is_handed_over_when_the_next_one_launched():
    # with the hook: the adds and steps 1..4 go out from inside steps 1..5 (once each forward is queued), the last
    # step's outputs after it (the engine went idle); an engine that never calls it: each after its own step
    assert _run(hook=True)[2] == [(True, k) for k in range(1, 6)] + [(False, 5)]
    assert _run(hook=False)[2] == [(False, k) for k in range(1, 6)]
