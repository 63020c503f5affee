"""The client side of `bench_serve.py`: the closed-loop workload, driven either through the engine's
`add_request`/`step` in this process or over HTTP (aiohttp, streamed completions), and its statistics (output
tokens/s, TTFT and ITL percentiles). Each of C clients sends its next request when its last one finished.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def summarize(records: list[dict], wall: float) -> dict:
    """records: per request {"send", "tokens": [times]}; wall: first send to last token."""
    ttft = [r["tokens"][0] - r["send"] for r in records if r["tokens"]]
    itl = [b - a for r in records for a, b in zip(r["tokens"], r["tokens"][1:])]
    n = sum(len(r["tokens"]) for r in records)
    return {"requests": len(records), "output_tokens": n, "tokens_per_s": n / wall,
            "ttft_p50_ms": 1e3 * _pct(ttft, 0.5), "ttft_p99_ms": 1e3 * _pct(ttft, 0.99),
            "itl_p50_ms": 1e3 * _pct(itl, 0.5), "itl_p99_ms": 1e3 * _pct(itl, 0.99),
            "itl_mean_ms": 1e3 * statistics.fmean(itl) if itl else float("nan")}


def run_inprocess(engine, prompts: list[list[int]], concurrency: int, max_tokens: int) -> dict:
    """The closed loop on the engine directly: C requests in flight, a new one as soon as one finishes."""
    from kimik3.inference.engine import Request
    from kimik3.inference.sampling import SamplingParams

    params = SamplingParams(temperature=0, max_new_tokens=max_tokens, ignore_eos=True, logprobs=0)
    todo, live, records = list(enumerate(prompts)), {}, []
    start = time.perf_counter()

    def submit():
        k, ids = todo.pop(0)
        rec = {"send": time.perf_counter(), "tokens": []}
        live[f"r{k}"] = rec
        records.append(rec)
        engine.add_request(Request(f"r{k}", ids, params))

    while todo and len(live) < concurrency:
        submit()
    while live:
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            rec = live[out.request_id]
            rec["tokens"] += [now] * len(out.outputs[0].token_ids)
            if out.finished:
                del live[out.request_id]
                if todo:
                    submit()
    return summarize(records, time.perf_counter() - start)


async def _one(session, url: str, ids: list[int], max_tokens: int, rec: dict) -> bool:
    body = {"model": "bench", "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "stream": True, "stream_options": {"include_usage": True}}
    rec["send"] = time.perf_counter()
    async with session.post(f"{url}/v1/completions", json=body) as r:
        if r.status != 200:
            return False
        done = False
        async for line in r.content:
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                done = True
                continue
            chunk = json.loads(data)
            if "error" in chunk:  # the stream's error event (the server failed the request): a failed request
                return False
            for ch in chunk["choices"]:
                lp = ch.get("logprobs")
                rec["tokens"] += [time.perf_counter()] * (len(lp["tokens"]) if lp else 0)
    return done and len(rec["tokens"]) == max_tokens


async def run_http(url: str, prompts: list[list[int]], concurrency: int, max_tokens: int,
                   seconds: float | None = None) -> dict:
    """The same closed loop over HTTP (aiohttp, loopback). With `seconds`: clients stop sending after that long
    (a fixed-duration run) instead of after the prompt list."""
    import aiohttp

    records, failures = [], 0
    queue = list(prompts)
    start = time.perf_counter()

    async def client(session):
        nonlocal failures
        k = 0
        while True:
            if seconds is not None and time.perf_counter() - start > seconds:
                return
            if seconds is None and not queue:
                return
            ids = queue.pop(0) if seconds is None else prompts[k % len(prompts)]
            k += 1
            rec = {"tokens": []}
            try:
                ok = await _one(session, url, ids, max_tokens, rec)
            except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError):
                ok = False
            failures += not ok
            records.append(rec)

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    wall = max((r["tokens"][-1] for r in records if r["tokens"]), default=time.perf_counter()) - start
    return {**summarize(records, wall), "failed": failures}
