"""`kimik3 serve` under load vs the engine called in-process on the same requests.

Device: the real-dims 12-layer slice (random weights, bf16, CUDA graphs) at concurrency 1, 8 and 64. The same
closed-loop workload (each of C clients sends its next request when the last one finished; token-id prompts,
greedy, ignore_eos, fixed output length, logprobs=0 so every token is one observable event on both sides) runs
twice: through the engine's `add_request`/`step` in this process, then over HTTP against a child process that
serves the same slice with kimik3.serve's app (the `kimik3 serve` stack: uvicorn, the engine thread, SSE, the
output parser), driven by an aiohttp load generator (both closed loops are in `serve_load.py`). Reports output
tokens/s, TTFT and ITL p50/p99, and the HTTP overhead (1 - HTTP tokens/s / in-process tokens/s; the target is <= 5%
at concurrency 64).

    PYTHONPATH=src:. python3 bench/bench_serve.py            # device: table + $OUT/bench_serve.json

The device image lacks the serve stack: carry wheels (pip download --no-deps for Python 3.12 of fastapi,
starlette, uvicorn, pydantic, pydantic-core, annotated-doc, annotated-types, typing-inspection, typing-extensions,
opentelemetry-api (fastapi 0.165 imports it) into .whl/serve/, beside fla's wheel in .whl/) and start the one device
call with
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/fla_core-*.whl .whl/serve/*.whl &&
    PYTHONPATH=/tmp/site:src:. PYTHONUNBUFFERED=1 python3 bench/bench_serve.py
    PYTHONPATH=src:. python3 bench/bench_serve.py --smoke    # CPU: `kimik3 serve` on the demo model, load at
                                                             # concurrency 1, 2, 4, 8 for a fixed time; fails on
                                                             # any failed request
    PYTHONPATH=src:. python3 bench/bench_serve.py --check    # CPU: the device path on a toy-size slice
    PYTHONPATH=src:. python3 bench/bench_serve.py --host     # CPU: the host overhead alone, against a stand-in
                                                             # engine that sleeps for the device time
    ... --levels=64                                          # only these concurrencies (any mode but --smoke)

`--host` replaces the model by `HostEngine`: each step sleeps for the slice's measured device time (the GIL is free
then, as in a CUDA sync) around a few hundred torch dispatches (each drops and retakes the GIL, as the real step's
launches do), and returns outputs shaped as the engine's. What the HTTP side loses against it is host work that
serializes with the engine loop; the child reports, per step, the engine thread's time outside `step()`, the
inflation of `step()` itself (its GIL waits), and the event loop thread's CPU time.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import json
import os
import socket
import subprocess
import sys
import threading
import time
import traceback
import weakref
from pathlib import Path

import torch

from bench.serve_load import run_http, run_inprocess

SLICE_PROMPT, SLICE_OUTPUT, SLICE_LEVELS = 512, 128, (1, 8, 64)
SMOKE_PROMPT, SMOKE_OUTPUT, SMOKE_LEVELS, SMOKE_SECONDS = 24, 6, (1, 2, 4, 8), 2.0
# the 12-layer slice on the H200 (2026-12-01): a decode step of n sequences is ~8 ms + 0.44 ms * n of device time
# (36 ms at 64) and ~9 ms of host time at 64 (ITL 44.7 ms in-process); a prompt token ~0.1 ms of device time
HOST_STEP_S, HOST_DECODE_S, HOST_PREFILL_S = 8e-3, 0.44e-3, 0.1e-3
HOST_PREP_S, HOST_POST_S = (1e-3, 0.06e-3), (0.5e-3, 0.04e-3)  # host time before the launch, after the sync: a + b*n


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
    from bench.build import experts_backend_of, materialize
    from bench.common import smoke_config
    from kimik3.inference.engine import Engine, EngineConfig
    from kimik3.model import K3ForCausalLM
    from kimik3.presets import load_config

    cfg = (smoke_config if check else load_config)("slice-12").text
    with torch.device("meta"):
        model = K3ForCausalLM(cfg, torch.bfloat16)
    model = materialize(model).eval()
    experts_backend_of(model)  # Humming's layout where `kimik3 serve` would pick it (both sides of the comparison)
    tok = synthetic_tokenizer(cfg.vocab_size)
    # `kimik3 serve`'s defaults: EngineConfig() (64 sequences, 2,048 tokens a step, max_model_len = the config's
    # 1,048,576 positions) with the warm-up it runs before /health answers
    engine = Engine(model, EngineConfig(warmup=True), eos_token_ids=(tok.eos_id,), model_id="bench-slice-12")
    return engine, tok, cfg.vocab_size


class HostEngine:
    """An `EngineLike` (kimik3.serve.runner) without a model (for `--host`): chunked prefill under a token budget,
    one token per running sequence per step; host work that holds the GIL (Python, with a torch dispatch every
    ~50 us as the launches have) before the launch and after the sync, a sleep for the device time between them,
    outputs built as the engine builds them; `on_launch` called once the step's device work is queued, as the
    engine does."""

    def __init__(self, max_num_seqs: int = 64, max_num_batched_tokens: int = 4096, max_model_len: int = 2048):
        from collections import OrderedDict

        self.max_num_seqs, self.budget, self.max_model_len = max_num_seqs, max_num_batched_tokens, max_model_len
        self.requests: OrderedDict = OrderedDict()  # id -> [request, prompt tokens computed, output ids, logprobs]
        self.stats = {"running": 0, "waiting": 0}
        self.x = torch.zeros(8)

    def add_request(self, request) -> None:
        self.requests[request.request_id] = [request, 0, [], []]

    def abort(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def stop(self, request_id: str, stop_reason=None) -> None:  # the server's stop strings: none in this load
        self.requests.pop(request_id, None)

    def reset_prefix_cache(self) -> None:  # no cache
        pass

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self, on_launch=None) -> list:
        from kimik3.inference.engine import RequestOutput, SequenceOutput, TokenLogprob

        budget, decodes, prefill, sampled = self.budget, 0, 0, []
        for st in list(self.requests.values())[: self.max_num_seqs]:
            req, done = st[0], st[1]
            if done == len(req.prompt_ids):
                decodes, budget = decodes + 1, budget - 1
                sampled.append(st)
            elif budget > 0:
                n = min(budget, len(req.prompt_ids) - done)
                st[1], prefill, budget = done + n, prefill + n, budget - n
                if st[1] == len(req.prompt_ids):
                    sampled.append(st)
        n = len(sampled)
        self._host(HOST_PREP_S[0] + HOST_PREP_S[1] * n)
        launched = time.perf_counter()  # the device runs from here, whatever this thread does next
        if on_launch is not None:
            on_launch()
        device_s = HOST_STEP_S + HOST_DECODE_S * decodes + HOST_PREFILL_S * prefill
        time.sleep(max(0.0, launched + device_s - time.perf_counter()))
        self._host(HOST_POST_S[0] + HOST_POST_S[1] * n)
        outs = []
        for st in sampled:
            req, _, out, lps = st
            token = len(out) % 251
            out.append(token)
            if req.params.logprobs is not None:
                lps = st[3] = lps + [TokenLogprob(token, -1.0, [])]
            finished = len(out) >= req.params.max_new_tokens
            outs.append(RequestOutput(req.request_id, list(req.prompt_ids), [SequenceOutput(
                0, list(out), out[-1:], lps if req.params.logprobs is not None else None,
                "length" if finished else None, None)], finished, 0, None, {"queue_time": 0.0}))
            if finished:
                del self.requests[req.request_id]
        self.stats = {"running": len(self.requests), "waiting": 0}
        return outs

    def _host(self, seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            for _ in range(3000):  # ~50 us of Python between two dispatches
                pass
            self.x.add_(1)


class _StepClock:
    """Wraps an engine's `step` to time it and the engine thread's gaps between two steps (busy periods only).

    A watchdog thread samples the stepping thread's Python stack every 0.2 s while a step has run for more than
    SLOW_STEP_S: a one-time stall (a compile, a library's per-shape plan) shows up as the place it spends its time,
    and the snapshot reports the slow steps and those places."""

    SLOW_STEP_S = 0.5

    def __init__(self, engine):
        self.engine, self.inner = engine, engine.step
        self.steps, self.in_step, self.between, self.last_end = 0, 0.0, 0.0, None
        self.longest = 0.0  # the longest step() so far, in seconds
        self.running: tuple[int, float] | None = None  # (thread id, start) of the step in progress
        self.slow: list[tuple] = []  # (step index, sequences, packed tokens, seconds) of each slow step
        self.stacks: collections.Counter = collections.Counter()  # innermost frames -> samples
        self.shape = (0, 0)  # (sequences, packed tokens) of the step last scheduled
        engine.step = self.step
        if hasattr(engine, "scheduler"):
            schedule = engine.scheduler.schedule

            def scheduled():
                chunks = schedule()
                self.shape = (len(chunks), sum(c.num_tokens for c in chunks))
                return chunks

            engine.scheduler.schedule = scheduled
        # the thread holds the clock weakly: `del engine, clock` must still free the engine's GPU memory
        threading.Thread(target=_StepClock._watch, args=(weakref.ref(self),), daemon=True,
                         name="bench-watchdog").start()

    def step(self, **kwargs):  # the serve loop passes on_launch
        t0 = time.perf_counter()
        if self.last_end is not None and t0 - self.last_end < 0.1:  # a longer gap is idle time, not host work
            self.between += t0 - self.last_end
        self.running = (threading.get_ident(), t0)
        outs = self.inner(**kwargs)
        self.running = None
        self.last_end = t1 = time.perf_counter()
        self.steps += 1
        self.in_step += t1 - t0
        self.longest = max(self.longest, t1 - t0)
        if t1 - t0 > self.SLOW_STEP_S:
            self.slow.append((self.steps, *self.shape, round(t1 - t0, 3)))
        return outs

    @staticmethod
    def _watch(ref) -> None:
        while True:
            time.sleep(0.2)
            clock = ref()
            if clock is None:
                return
            clock._sample()
            del clock  # not held across the sleep

    def _sample(self) -> None:
        running = self.running
        if running is None or time.perf_counter() - running[1] < self.SLOW_STEP_S:
            return
        frame = sys._current_frames().get(running[0])
        if frame is not None:
            inner = traceback.extract_stack(frame)[-6:]
            self.stacks[" <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(inner))] += 1

    def snapshot(self) -> dict:
        return {"steps": self.steps, "in_step_s": self.in_step, "between_s": self.between, "longest_s": self.longest,
                "loop_cpu_s": time.thread_time(),  # called on the event loop thread
                "slow_steps": list(self.slow), "stall_stacks": dict(self.stacks)}


def serve_child(port: int, check: bool, host: bool = False) -> None:
    """Child process: serve the slice with kimik3.serve's app (what `kimik3 serve` runs) until killed."""
    import uvicorn

    from kimik3.serve import Server, ServerConfig, build_app

    server = Server(ServerConfig(model_name="bench", max_pending=4096))
    if host:
        engine, tok, vocab = HostEngine(), synthetic_tokenizer(1024), 1024
    else:
        engine, tok, vocab = build_slice_engine(check)
    clock = _StepClock(engine)
    server.attach(engine, tok, vocab_size=vocab)
    app = build_app(server)

    @app.get("/bench_clock")
    async def bench_clock():  # async: runs on the event loop thread, whose CPU time it reads
        return clock.snapshot()

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def _spawn(args: list[str]) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(["src", ".", os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, *args, "--port", str(port)], env=env,
                            cwd=Path(__file__).resolve().parents[1])
    return proc, f"http://127.0.0.1:{port}"


def fresh_serve(check: bool, concurrency: int = 64) -> dict:
    """A fresh server process: it warms up before /health answers (what `kimik3 serve` does), then meets
    `concurrency` streams at once (fresh) and the same load again (warm). Returns seconds to ready, both runs'
    statistics and the longest step after ready. Run first in the bench, so nothing of this process has compiled
    into the machine's caches (on the device: Triton's holds only the restored autotune choices, no kernels;
    Humming's is empty). A Triton cache emptied too would make fla autotune each kernel at each warm-up shape:
    measured over 230 s before ready on the H200, a one-time cost of a new machine, not of a new process."""
    g = torch.Generator().manual_seed(1)
    prompt_len, output_len = (32, 8) if check else (SLICE_PROMPT, SLICE_OUTPUT)
    fresh, warm = ([torch.randint(0, 1000, (prompt_len,), generator=g).tolist() for _ in range(2 * concurrency)]
                   for _ in range(2))
    t0 = time.perf_counter()
    proc, url = _spawn([__file__, "--child"] + (["--check"] if check else []))
    try:
        _wait_ready(url, proc)
        out = {"ready_s": time.perf_counter() - t0}
        print(f"fresh server ready after {out['ready_s']:.1f} s", flush=True)
        for name, prompts in (("fresh", fresh), ("warm", warm)):
            before = _get_json(f"{url}/bench_clock")
            out[name] = r = asyncio.run(run_http(url, prompts, concurrency, output_len))
            r.update(_per_step(before, after := _get_json(f"{url}/bench_clock")))
            r["longest_step_s"] = after["longest_s"]  # since ready: warm-up ran before the clock
            print(f"  {name}: TTFT p99 {r['ttft_p99_ms']:.1f} ms, longest step {r['longest_step_s']:.3f} s",
                  flush=True)
    finally:
        proc.terminate()
        proc.wait(60)
    out["ttft_p99_fresh_over_warm"] = out["fresh"]["ttft_p99_ms"] / out["warm"]["ttft_p99_ms"]
    return out


def main(smoke: bool, check: bool, host: bool, levels: tuple[int, ...] = SLICE_LEVELS) -> int:
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

    if not host:  # first, before this process compiles anything into the shared Triton cache
        if not check:  # the children start as an installed package's would (`byte_compile`)
            from bench.common import byte_compile

            results["byte_compile_s"] = byte_compile()
        results["fresh serve"] = f = fresh_serve(check, max(levels))
        table(f"fresh server (empty Triton cache, warm-up before ready), {max(levels)} streams",
              ["run", "TTFT p50 / p99 ms", "output tok/s", "longest step since ready s"],
              [[name, f"{f[name]['ttft_p50_ms']:.1f} / {f[name]['ttft_p99_ms']:.1f}",
                f"{f[name]['tokens_per_s']:,.0f}", f"{f[name]['longest_step_s']:.3f}"] for name in ("fresh", "warm")]
              + [["ready after", f"{f['ready_s']:.1f} s", "", ""],
                 ["TTFT p99 fresh / warm", f"{f['ttft_p99_fresh_over_warm']:.2f}x", "", ""]])
    prompt_len, output_len = (32, 8) if check else (SLICE_PROMPT, SLICE_OUTPUT)
    engine = HostEngine() if host else build_slice_engine(check)[0]
    clock = _StepClock(engine)
    for c in levels:  # in-process first, on the GPU alone
        # warm-up prompts of their own (a shared prompt would turn into a prefix-cache hit in the measurement)
        warm, prompts = ([torch.randint(0, 1000, (prompt_len,), generator=g).tolist() for _ in range(k)]
                         for k in (c, max(2 * c, 8)))
        run_inprocess(engine, warm, c, 8)  # CUDA graphs of this batch size, the allocator
        before = clock.snapshot()
        results[f"inprocess c={c}"] = run_inprocess(engine, prompts, c, output_len)
        results[f"inprocess c={c}"].update(_per_step(before, clock.snapshot()))
        results[f"prompts c={c}"] = (warm, prompts)
    del engine, clock
    gc.collect()  # whatever else a cycle holds (the engine itself is freed by del), before the child starts
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    proc, url = _spawn([__file__, "--child"] + (["--check"] if check else []) + (["--host"] if host else []))
    try:
        _wait_ready(url, proc)
        for c in levels:
            warm, prompts = results.pop(f"prompts c={c}")
            asyncio.run(run_http(url, warm, c, 8))
            before = _get_json(f"{url}/bench_clock")
            results[f"http c={c}"] = r = asyncio.run(run_http(url, prompts, c, output_len))
            r.update(_per_step(before, _get_json(f"{url}/bench_clock")))
            base = results[f"inprocess c={c}"]
            overhead = 1 - r["tokens_per_s"] / base["tokens_per_s"]
            results[f"overhead c={c}"] = overhead
            for name, x in (("in-process", base), ("HTTP", r)):
                rows.append([c, name, f"{x['tokens_per_s']:,.0f}", f"{x['ttft_p50_ms']:.1f} / {x['ttft_p99_ms']:.1f}",
                             f"{x['itl_p50_ms']:.2f} / {x['itl_p99_ms']:.2f}", f"{x['step_ms']:.2f}",
                             f"{x['between_ms']:.2f}", f"{x['loop_cpu_ms']:.2f}" if name == "HTTP" else "",
                             x.get("failed", "")])
            rows.append([c, "HTTP overhead", f"{100 * overhead:.1f}%", "", "", "", "", "", ""])
    finally:
        proc.terminate()
        proc.wait(60)
    what = "stand-in engine (--host)" if host else "12-layer slice"
    table(f"{what} behind kimik3 serve vs in-process (prompt {prompt_len}, output {output_len}, greedy)",
          ["concurrency", "path", "output tok/s", "TTFT p50 / p99 ms", "ITL p50 / p99 ms", "step() ms/step",
           "outside step() ms/step", "event loop CPU ms/step", "failed"], rows)
    name = "bench_serve_host" if host else "bench_serve_check" if check else "bench_serve"
    write_json(name, {"env": environment(), "results": results, "workload": {"prompt": prompt_len,
                                                                             "output": output_len}})
    return 1 if any(results[f"http c={c}"]["failed"] for c in levels) else 0


def _get_json(url: str) -> dict:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def _per_step(before: dict, after: dict) -> dict:
    """Per engine step of one level: wall time in step(), engine-thread time between steps, event loop CPU; the
    level's slow steps and where the stepping thread spent them (printed as they are found)."""
    n = max(1, after["steps"] - before["steps"])
    slow = after["slow_steps"][len(before["slow_steps"]):]
    stacks = (collections.Counter(after["stall_stacks"]) - collections.Counter(before["stall_stacks"])).most_common(8)
    if slow:
        print(f"  slow steps (index, sequences, tokens, s): {slow}", flush=True)
        for where, samples in stacks:
            print(f"    {samples} x {where}", flush=True)
    return {"slow_steps": slow, "stall_stacks": stacks, "steps": after["steps"] - before["steps"],
            "step_ms": 1e3 * (after["in_step_s"] - before["in_step_s"]) / n,
            "between_ms": 1e3 * (after["between_s"] - before["between_s"]) / n,
            "loop_cpu_ms": 1e3 * (after["loop_cpu_s"] - before["loop_cpu_s"]) / n}


if __name__ == "__main__":
    argv = sys.argv[1:]
    if "--child" in argv:
        serve_child(int(argv[argv.index("--port") + 1]), check="--check" in argv, host="--host" in argv)
    else:
        levels = [a.split("=", 1)[1] for a in argv if a.startswith("--levels=")]  # e.g. --levels=64
        sys.exit(main(smoke="--smoke" in argv, check="--check" in argv, host="--host" in argv,
                      levels=tuple(int(c) for c in levels[0].split(",")) if levels else SLICE_LEVELS))
