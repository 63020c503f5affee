"""`kimik3 serve` under load vs the engine called in-process on the same requests.

Device: the real-dims 12-layer slice (random weights, bf16, CUDA graphs) at concurrency 1, 8 and 64. The same
closed-loop workload (each of C clients sends its next request when the last one finished; token-id prompts,
greedy, ignore_eos, fixed output length, logprobs=0 so every token is one observable event on both sides) runs
twice: through the engine's `add_request`/`step` in this process, then over HTTP against a child process that
serves the same slice with kimik3.serve's app (the `kimik3 serve` stack: uvicorn, the engine thread, SSE, the
output parser), driven by an aiohttp load generator. Reports output tokens/s, TTFT and ITL p50/p99, and the
HTTP overhead (1 - HTTP tokens/s / in-process tokens/s; the target is <= 5% at concurrency 64).

    PYTHONPATH=src:. python3 bench/bench_serve.py            # device: table + $OUT/bench_serve.json

The device image lacks the serve stack: carry wheels (pip download --no-deps for Python 3.12 of fastapi,
starlette, uvicorn, pydantic, pydantic-core, annotated-doc, annotated-types, typing-inspection, typing-extensions,
opentelemetry-api into .whl/serve/, beside fla's wheel in .whl/) and start the one device call with
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/fla_core-*.whl .whl/serve/*.whl &&
    PYTHONPATH=/tmp/site:src:. PYTHONUNBUFFERED=1 python3 bench/bench_serve.py
    PYTHONPATH=src:. python3 bench/bench_serve.py --smoke    # CPU: `kimik3 serve` on the demo model, load at
                                                             # concurrency 1, 2, 4, 8 for a fixed time; fails on
                                                             # any failed request
    PYTHONPATH=src:. python3 bench/bench_serve.py --check    # CPU: the device path on a toy-size slice
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

SLICE_PROMPT, SLICE_OUTPUT, SLICE_LEVELS = 512, 128, (1, 8, 64)
SMOKE_PROMPT, SMOKE_OUTPUT, SMOKE_LEVELS, SMOKE_SECONDS = 24, 6, (1, 2, 4, 8), 2.0


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
            rec["tokens"] += [now] * len(out.outputs[0].new_token_ids)
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError("the server did not become ready")


def synthetic_tokenizer(vocab_size: int):
    """A byte-level tokenizer with the slice's vocabulary width (the released tokenizer file is not shipped):
    256 single bytes, then distinct 3-byte tokens; specials at the released offsets from the end."""
    from kimik3.tokenizer import NUM_SPECIAL, Tokenizer

    ranks = {bytes([b]): b for b in range(256)}
    ranks.update({i.to_bytes(3, "big"): i for i in range(256, vocab_size - NUM_SPECIAL)})
    return Tokenizer(ranks, name="bench-slice")


def build_slice_engine(check: bool = False):
    from bench.build import materialize
    from bench.common import smoke_config
    from kimik3.inference.engine import Engine
    from kimik3.model import K3ForCausalLM
    from kimik3.presets import load_config

    cfg = (smoke_config if check else load_config)("slice-12").text
    with torch.device("meta"):
        model = K3ForCausalLM(cfg, torch.bfloat16)
    model = materialize(model).eval()
    tok = synthetic_tokenizer(cfg.vocab_size)
    engine = Engine(model, max_num_seqs=64, max_num_batched_tokens=4096, max_model_len=2048,
                    eos_token_ids=(tok.eos_id,), model_id="bench-slice-12")
    return engine, tok, cfg.vocab_size


def serve_child(port: int, check: bool) -> None:
    """Child process: serve the slice with kimik3.serve's app (what `kimik3 serve` runs) until killed."""
    import uvicorn

    from kimik3.serve import Server, ServerConfig, build_app

    server = Server(ServerConfig(model_name="bench", max_pending=4096))
    engine, tok, vocab = build_slice_engine(check)
    server.attach(engine, tok, vocab_size=vocab)
    uvicorn.run(build_app(server), host="127.0.0.1", port=port, log_level="warning")


def _spawn(args: list[str]) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(["src", ".", os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, *args, "--port", str(port)], env=env,
                            cwd=Path(__file__).resolve().parents[1])
    return proc, f"http://127.0.0.1:{port}"


def main(smoke: bool, check: bool) -> int:
    from bench.common import environment, table, write_json

    g = torch.Generator().manual_seed(0)
    rows, results = [], {}
    if smoke:  # the real CLI on the demo model; only the HTTP side, for a fixed time per level
        proc, url = _spawn(["-m", "kimik3", "serve", "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
                            "--served-model-name", "bench", "--log-level", "warning"])
        prompts = [torch.randint(0, 8000, (SMOKE_PROMPT,), generator=g).tolist() for _ in range(16)]
        try:
            _wait_ready(url, proc)
            for c in SMOKE_LEVELS:
                r = asyncio.run(run_http(url, prompts, c, SMOKE_OUTPUT, seconds=SMOKE_SECONDS))
                results[f"http c={c}"] = r
                rows.append([c, f"{r['tokens_per_s']:.1f}", f"{r['ttft_p50_ms']:.0f}", f"{r['itl_p50_ms']:.0f}",
                             r["requests"], r["failed"]])
        finally:
            proc.terminate()
            proc.wait(30)
        table("kimik3 serve, demo model on the CPU (fixed-duration closed loop)",
              ["concurrency", "tok/s", "TTFT p50 ms", "ITL p50 ms", "requests", "failed"], rows)
        write_json("bench_serve_smoke", {"env": environment(), "results": results})
        return 1 if any(r["failed"] or not r["requests"] for r in results.values()) else 0

    prompt_len, output_len = (32, 8) if check else (SLICE_PROMPT, SLICE_OUTPUT)
    engine, _, _ = build_slice_engine(check)
    for c in SLICE_LEVELS:  # in-process first, on the GPU alone
        # warm-up prompts of their own (a shared prompt would turn into a prefix-cache hit in the measurement)
        warm, prompts = ([torch.randint(0, 1000, (prompt_len,), generator=g).tolist() for _ in range(k)]
                         for k in (c, max(2 * c, 8)))
        run_inprocess(engine, warm, c, 8)  # CUDA graphs of this batch size, the allocator
        results[f"inprocess c={c}"] = run_inprocess(engine, prompts, c, output_len)
        results[f"prompts c={c}"] = (warm, prompts)
    del engine
    gc.collect()  # the engine's graphs refer back to it: freed only by the cycle collector
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    proc, url = _spawn([__file__, "--child"] + (["--check"] if check else []))
    try:
        _wait_ready(url, proc)
        for c in SLICE_LEVELS:
            warm, prompts = results.pop(f"prompts c={c}")
            asyncio.run(run_http(url, warm, c, 8))
            results[f"http c={c}"] = r = asyncio.run(run_http(url, prompts, c, output_len))
            base = results[f"inprocess c={c}"]
            overhead = 1 - r["tokens_per_s"] / base["tokens_per_s"]
            results[f"overhead c={c}"] = overhead
            for name, x in (("in-process", base), ("HTTP", r)):
                rows.append([c, name, f"{x['tokens_per_s']:,.0f}", f"{x['ttft_p50_ms']:.1f} / {x['ttft_p99_ms']:.1f}",
                             f"{x['itl_p50_ms']:.2f} / {x['itl_p99_ms']:.2f}", x.get("failed", "")])
            rows.append([c, "HTTP overhead", f"{100 * overhead:.1f}%", "", "", ""])
    finally:
        proc.terminate()
        proc.wait(60)
    table(f"12-layer slice behind kimik3 serve vs in-process (prompt {prompt_len}, output {output_len}, greedy)",
          ["concurrency", "path", "output tok/s", "TTFT p50 / p99 ms", "ITL p50 / p99 ms", "failed"], rows)
    write_json("bench_serve_check" if check else "bench_serve",
               {"env": environment(), "results": results, "workload": {"prompt": prompt_len, "output": output_len}})
    return 1 if any(results[f"http c={c}"]["failed"] for c in SLICE_LEVELS) else 0


if __name__ == "__main__":
    argv = sys.argv[1:]
    if "--child" in argv:
        serve_child(int(argv[argv.index("--port") + 1]), check="--check" in argv)
    else:
        sys.exit(main(smoke="--smoke" in argv, check="--check" in argv))
