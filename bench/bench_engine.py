"""The serving engine at the settings users run: decode steps against `max_model_len` and the bytes floor, a
mixed step's composition, continuous against static batching, and the prefix cache's time to first token.

Rows (issue 26), all in one call (and `deterministic`, asked for by --rows: the batch-invariant mode's cost at
each batch and on a prefill chunk, issue 39):
  decode    engine decode steps (sampling and bookkeeping included) at 1, 8, 64 sequences of context 1,024 with the
            default max_model_len (the config's max_position_embeddings: 1,048,576 for slice-12) vs 1,100 (target
            <= 1.1x), and vs the bytes floor (weights the step must read + the KDA states and MLA latents at that
            context, at the measured copy bandwidth; target <= 1.3x);
  mixedstep one step of a 2,048-token prefill chunk with 60 decode rows vs the 2,048-token chunk alone (<= 1.3x);
  prefix    a 4,096-token shared prefix: time to first token of a warm request (restored snapshot) vs a cold
            one (target <= 0.2x);
  mixed     64 requests, prompts 128-4096, outputs 16-512 (greedy, ignore_eos): continuous batching tokens/s vs
            static batches of 16 (the same engine settings, a batch admitted only when the last one finished), in
            arrival order; each side on an engine just built with warmup=True (fresh: the first pass of each) and
            again (warm: the second pass of each) (target >= 1.5x both).

    PYTHONPATH=src:. python3 bench/bench_engine.py             # device: slice-12, table + $OUT/bench_engine.json
    PYTHONPATH=src:. python3 bench/bench_engine.py --cpu-demo  # the same rows, scaled down, demo model fp32 on CPU
    PYTHONPATH=src:. python3 bench/bench_engine.py --smoke     # CPU check of this script at toy sizes
    ... --rows prefix,mixed      # only some of decode, mixedstep, prefix, mixed, deterministic (also joined by +)
    ... --profile             # decode and mixedstep rows also: the kernels of one step by category
"""

from __future__ import annotations

import random
import sys
import time

import torch

from bench.build import step_weight_bytes
from bench.common import (
    DEVICE,
    ceilings,
    decoding_engine,
    environment,
    profile_top,
    smoke_config,
    sync,
    table,
    write_json,
)
from kimik3.inference import SamplingParams
from kimik3.inference.engine import Engine, EngineConfig, Request
from kimik3.model import K3ForCausalLM
from kimik3.model.cache import state_bytes
from kimik3.ops.backend import moe_backend_from_env, use_backend
from kimik3.presets import load_config
from kimik3.quant import relayout_experts

SIZES = {  # mixed: requests, prompt range, output range, static batch; decode: context, steps; prefix tokens
    "device": dict(requests=64, prompt=(128, 4096), output=(16, 512), static_batch=16, context=1024, steps=16,
                   batches=(1, 8, 64), prefix=4096, budget=2048, chunk=2048, rows=60),
    "cpu-demo": dict(requests=12, prompt=(32, 256), output=(4, 32), static_batch=4, context=128, steps=3,
                     batches=(1, 8, 64), prefix=512, budget=256, chunk=256, rows=16),
    "smoke": dict(requests=6, prompt=(16, 100), output=(2, 8), static_batch=3, context=32, steps=2, batches=(1, 4),
                  prefix=128, budget=128, chunk=128, rows=4),
}


def workload(s: dict, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(vocab) for _ in range(rng.randint(*s["prompt"]))], rng.randint(*s["output"]))
            for _ in range(s["requests"])]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)


def run_engine(engine: Engine, reqs, steps: list | None = None) -> float:
    """Generated tokens per second, all requests submitted at once. `steps`, when given, receives each engine
    step's (seconds, sequences, packed tokens): a step returns its sampled tokens, so it ends synchronized."""
    sync()
    inner_step, inner_schedule, shape = engine.step, engine.scheduler.schedule, [0, 0]
    if steps is not None:
        def schedule():
            chunks = inner_schedule()
            shape[:] = [len(chunks), sum(c.num_tokens for c in chunks)]
            return chunks

        def step():
            t = time.perf_counter()
            out = inner_step()
            steps.append((time.perf_counter() - t, *shape))
            return out

        engine.step, engine.scheduler.schedule = step, schedule
    t0 = time.perf_counter()
    try:
        outs = engine.generate([p for p, _ in reqs], [greedy(n) for _, n in reqs])
        sync()
    finally:
        engine.step, engine.scheduler.schedule = inner_step, inner_schedule
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


def fresh_profile(fresh: list, warm: list, top: int = 8) -> dict:
    """Where a fresh pass loses to the warm one over the same schedule: per step, fresh minus warm time."""
    same = len(fresh) == len(warm) and all(f[1:] == w[1:] for f, w in zip(fresh, warm))
    excess = sorted(((f[0] - w[0], i, f[1], f[2], f[0], w[0]) for i, (f, w) in enumerate(zip(fresh, warm))),
                    reverse=True)[:top]
    return {"same_schedule": same, "steps": len(fresh), "fresh_s": sum(f[0] for f in fresh),
            "warm_s": sum(w[0] for w in warm),
            "slowest": [{"step": i, "sequences": n, "tokens": t, "fresh_ms": 1e3 * a, "warm_ms": 1e3 * b}
                        for _, i, n, t, a, b in excess]}


def run_static(engine: Engine, reqs, batch: int) -> float:
    """Static batching through the same engine: a batch of `batch` requests runs to its end before the next."""
    sync()
    t0 = time.perf_counter()
    tokens = 0
    for i in range(0, len(reqs), batch):
        part = reqs[i:i + batch]
        outs = engine.generate([p for p, _ in part], [greedy(n) for _, n in part])
        tokens += sum(len(o.outputs[0].token_ids) for o in outs)
    sync()
    return tokens / (time.perf_counter() - t0)


def engine_decode_ms(model, B: int, s: dict, graphs: bool, max_model_len: int | None, profile: bool = False,
                     deterministic: bool = False) -> float:
    """Median ms of an engine step once B sequences of `context` tokens all decode (the MLA pool sized for the
    context alone, so both max_model_len settings hold the same blocks: only the step's span can differ)."""
    engine = decoding_engine(model, B, s, max_model_len, graphs, deterministic=deterministic)
    times = []
    for _ in range(s["steps"]):
        sync()
        t0 = time.perf_counter()
        engine.step()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    if profile and engine.runner.graphs:  # the device's share of the step: its graph replayed alone, on the inputs
        # the last step left (the same rows, routing and key span), no host work between replays
        key = max(k for k in engine.runner.graphs if k[2] == 1 and k[0] >= B)
        replay = engine.runner.graphs[key].graph
        if replay is not None:
            sync()
            t0 = time.perf_counter()
            for _ in range(20):
                replay.replay()
            sync()
            alone = (time.perf_counter() - t0) * 1e3 / 20
            print(f"-- decode B={B}: the graph {key} replayed alone {alone:.2f} ms, the engine's step "
                  f"{sorted(times)[len(times) // 2]:.2f} ms", flush=True)
    if profile:  # the timed engine's own steps (graphs replayed on its real rows: 4 of the 8 tokens left), then the
        # real rows' step with graphs off: real routing (scratch rows all pick the same experts, which under-counted
        # the experts' bytes at B=8 and 64), the same kernels a replay runs, launched eagerly. At B=64 the graphed
        # step took 4.7 ms more than the eager kernels summed, and the engine's host work is 0.6 ms (BENCHMARKS)
        profile_top(engine.step, f"engine decode B={B} (its rows, as timed), max_model_len {engine.max_model_len}"
                    + (", deterministic" if deterministic else ""), iters=3)
        eager = decoding_engine(model, B, s, max_model_len, False, deterministic=deterministic)
        profile_top(eager.step, f"engine decode B={B} (its rows, eager), max_model_len {eager.max_model_len}"
                    + (", deterministic" if deterministic else ""), iters=3)
    return sorted(times)[len(times) // 2]


def mixed_step_ms(model, s: dict, graphs: bool, rows: int, deterministic: bool = False) -> float:
    """Median ms of one step carrying a `chunk`-token prefill chunk beside `rows` decode rows (a fresh engine in
    the same state for each of three runs)."""
    times = []
    for rep in range(3):
        engine = decoding_engine(model, rows, s, None, graphs, spare=s["chunk"] + 64, deterministic=deterministic)
        engine.scheduler.budget = s["chunk"] + rows  # the whole chunk and every decode row in one step
        prompt = torch.randint(0, 1000, (s["chunk"] + 1,), generator=torch.Generator().manual_seed(rep)).tolist()
        engine.add_request(Request("prefill", prompt, greedy(1)))
        sync()
        t0 = time.perf_counter()
        engine.step()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[1]


def roofline_ms(model, B: int, context: int, bandwidth: float) -> float:
    """Bytes a decode step must move at the measured copy bandwidth: the dense weights, the routed experts B
    tokens are expected to touch, each sequence's KDA state (read + write) and MLA latents over `context`."""
    one = state_bytes(model.config, next(model.parameters()).dtype)
    per_seq = 2 * (one["kda_state_per_sequence"] + one["kda_conv_per_sequence"]) + context * one["mla_latent_per_token"]
    return (step_weight_bytes(model, B) + B * per_seq) / bandwidth * 1e3


def ttft_ms(engine: Engine, prompt: list[int], rid: str) -> tuple[float, int]:
    sync()
    t0 = time.perf_counter()
    engine.add_request(Request(rid, prompt, greedy(1)))
    cached = 0
    while engine.has_unfinished():
        for o in engine.step():
            cached = o.cached_tokens
    sync()
    return (time.perf_counter() - t0) * 1e3, cached


def emit(results: dict, rows: list, mode: str) -> None:
    """Print the newest row and rewrite the JSON: a run stopped at its time limit keeps what it measured."""
    print(" | ".join(rows[-1]), flush=True)
    write_json(f"bench_engine_{mode}", {**results, "rows": rows})


@torch.no_grad()
def main(mode: str, which: tuple[str, ...] = ("decode", "mixedstep", "prefix", "mixed"), profile: bool = False
         ) -> None:
    s = SIZES[mode]
    if mode == "device":
        from bench.build import materialize

        with torch.device("meta"):
            model = K3ForCausalLM(load_config("slice-12").text, torch.bfloat16)
        model = materialize(model).eval()
    elif mode == "cpu-demo":
        from kimik3.checkpoint.loader import load
        from kimik3.presets import DEMO_MODEL

        model = load(DEMO_MODEL, dtype=torch.float32, text_only=True, quiet=True).language_model.eval()
    else:
        model = K3ForCausalLM(smoke_config("slice-12").text, torch.float32).init_weights(0).eval()
    graphs = DEVICE.type == "cuda"
    vocab = model.config.vocab_size
    results, rows = {"mode": mode, "sizes": s, "env": environment()}, []

    # bytes moved at the measured copy rate, as bench_layer's roofline (a copy's rate counts its reads and writes;
    # halving it for read-only traffic put the floor above what generate() measured)
    bandwidth = ceilings()["copy_bytes_per_s"]
    # counted on the stored experts, before `relayout_experts` may hand them to Humming's layout (as serve does)
    roofs = {B: roofline_ms(model, B, s["context"], bandwidth) for B in s["batches"]}
    with use_backend(moe=moe_backend_from_env()):  # KIMIK3_MOE_BACKEND, read as the CLI reads it
        results["experts"] = "humming" if relayout_experts(model) else "triton"
    print(f"MXFP4 experts run {results['experts']}'s kernels", flush=True)
    positions = model.config.max_position_embeddings
    for B in s["batches"] if "decode" in which else ():
        long = engine_decode_ms(model, B, s, graphs, None, profile)
        short = engine_decode_ms(model, B, s, graphs, s["context"] + 76, profile)
        roof = roofs[B]
        results[f"decode B={B}"] = {"default_ms": long, "short_ms": short, "ratio": long / short,
                                    "roofline_ms": roof, "of_floor": long / roof}
        rows.append([f"decode step B={B}, context {s['context']}: max_model_len {positions:,} vs "
                     f"{s['context'] + 76:,} (ms)", f"{long:.2f}", f"{short:.2f}", f"{long / short:.2f}x",
                     f"<= 1.1x; floor {roof:.2f} ms: {long / roof:.2f}x (<= 1.3x)"])
        emit(results, rows, mode)
    if "mixedstep" in which:
        both = mixed_step_ms(model, s, graphs, s["rows"])
        alone = mixed_step_ms(model, s, graphs, 0)
        results["mixed_step"] = {"with_rows_ms": both, "alone_ms": alone, "ratio": both / alone}
        rows.append([f"step: {s['chunk']} prefill tokens + {s['rows']} decode rows vs the chunk alone (ms)",
                     f"{both:.1f}", f"{alone:.1f}", f"{both / alone:.2f}x", "<= 1.3x"])
        emit(results, rows, mode)

    if "deterministic" in which:
        deterministic_rows(model, s, graphs, results, rows, mode, profile)
    if "prefix" in which:
        prefix_row(model, s, vocab, results, rows, mode)
    if "mixed" in which:
        mixed_row(model, s, vocab, graphs, results, rows, mode)

    title = {"device": "slice-12 on the device", "cpu-demo": "demo model, fp32, CPU", "smoke": "smoke"}[mode]
    results["table"] = table(f"engine: {title}", ["row", "measured", "baseline", "ratio", "target"], rows)
    results["env"] = environment()
    write_json(f"bench_engine_{mode}", {**results, "rows": rows})


def deterministic_rows(model, s, graphs, results, rows, mode, profile: bool) -> None:
    """The batch-invariant mode's cost (`EngineConfig.deterministic`, issue 39: on by default if <= 10% of decode
    tokens/s): decode steps at each batch and a prefill chunk alone, with the mode and without, at serve's
    max_model_len default."""
    for B in s["batches"]:
        plain = engine_decode_ms(model, B, s, graphs, None)
        inv = engine_decode_ms(model, B, s, graphs, None, profile, deterministic=True)
        results[f"deterministic decode B={B}"] = {"deterministic_ms": inv, "default_ms": plain, "ratio": inv / plain}
        rows.append([f"decode step B={B}, context {s['context']}: deterministic vs default (ms)", f"{inv:.2f}",
                     f"{plain:.2f}", f"{inv / plain:.2f}x", "<= 1.1x: on by default"])
        emit(results, rows, mode)
    plain, inv = mixed_step_ms(model, s, graphs, 0), mixed_step_ms(model, s, graphs, 0, deterministic=True)
    results["deterministic prefill"] = {"deterministic_ms": inv, "default_ms": plain, "ratio": inv / plain}
    rows.append([f"step: a {s['chunk']}-token prefill chunk, deterministic vs default (ms)", f"{inv:.1f}",
                 f"{plain:.1f}", f"{inv / plain:.2f}x", ""])
    emit(results, rows, mode)


def prefix_row(model, s, vocab, results, rows, mode) -> None:
    g = torch.Generator().manual_seed(1)
    head = torch.randint(0, vocab, (s["prefix"],), generator=g).tolist()
    tails = [torch.randint(0, vocab, (32,), generator=g).tolist() for _ in range(3)]
    engine = Engine(model, EngineConfig(max_num_seqs=4, max_num_batched_tokens=s["budget"],
                                        max_model_len=s["prefix"] + 128))
    ttft_ms(engine, head[:64] + tails[0], "warmup")
    engine.reset_prefix_cache()
    cold, c0 = ttft_ms(engine, head + tails[1], "cold")
    warm, c1 = ttft_ms(engine, head + tails[2], "warm")
    results["prefix"] = {"cold_ttft_ms": cold, "warm_ttft_ms": warm, "ratio": warm / cold, "cold_cached": c0,
                         "warm_cached": c1}
    rows.append([f"TTFT, {s['prefix']}-token shared prefix (ms)", f"{warm:,.1f} (warm, {c1} cached)",
                 f"{cold:,.1f} (cold)", f"{warm / cold:.2f}x", "<= 0.2x"])
    emit(results, rows, mode)
    del engine
    if DEVICE.type == "cuda":
        torch.cuda.empty_cache()



def mixed_row(model, s, vocab, graphs, results, rows, mode) -> None:
    reqs = workload(s, vocab)
    longest = max(len(p) + n for p, n in reqs)
    t0 = time.perf_counter()
    engine = Engine(model, EngineConfig(max_num_seqs=s["requests"], max_num_batched_tokens=s["budget"],
                                        max_model_len=longest + 64, enable_prefix_cache=True, warmup=True))
    warm_s = time.perf_counter() - t0
    fresh_steps, warm_steps = [], []
    # the first requests this engine serves: whatever warm-up left out shows here
    fresh = run_engine(engine, reqs, fresh_steps)
    engine.reset_prefix_cache()
    cont = run_engine(engine, reqs, warm_steps)
    prof = fresh_profile(fresh_steps, warm_steps)
    print(f"fresh pass {prof['fresh_s']:.2f} s vs warm {prof['warm_s']:.2f} s over {prof['steps']} steps "
          f"(same schedule: {prof['same_schedule']}); the steps the fresh pass lost most on:", flush=True)
    for r in prof["slowest"]:
        print(f"  step {r['step']}: {r['sequences']} sequences, {r['tokens']} tokens: {r['fresh_ms']:.1f} ms fresh, "
              f"{r['warm_ms']:.1f} ms warm", flush=True)
    static_engine = Engine(model, EngineConfig(max_num_seqs=s["static_batch"], max_num_batched_tokens=s["budget"],
                                               max_model_len=longest + 64, enable_prefix_cache=False, warmup=True))
    # like with like: each side's first pass after its warm-up, then each side's second pass
    static_fresh = run_static(static_engine, reqs, s["static_batch"])
    static_warm = run_static(static_engine, reqs, s["static_batch"])
    results["mixed"] = {"engine_tokens_per_s": cont, "fresh_tokens_per_s": fresh,
                        "static_tokens_per_s": static_warm, "static_fresh_tokens_per_s": static_fresh,
                        "ratio": cont / static_warm, "fresh_ratio": fresh / static_fresh, "warmup_s": warm_s,
                        "fresh_profile": prof,
                        "engine_stats": engine.stats}
    rows.append([f"mixed, {s['requests']} requests (tokens/s): fresh / warm", f"{fresh:,.1f} / {cont:,.1f}",
                 f"{static_fresh:,.1f} / {static_warm:,.1f}",
                 f"{fresh / static_fresh:.2f}x / {cont / static_warm:.2f}x",
                 f">= 1.5x both (warm-up {warm_s:.1f} s before)"])
    emit(results, rows, mode)


if __name__ == "__main__":
    args = sys.argv[1:]
    # rows joined by "," or "+" (bench/device_suite.sh splits its step arguments at commas)
    rows = args[args.index("--rows") + 1].replace("+", ",") if "--rows" in args else "decode,mixedstep,prefix,mixed"
    which = tuple(rows.split(","))
    mode = "smoke" if "--smoke" in args else "cpu-demo" if "--cpu-demo" in args else "device"
    if "--batches" in args:  # decode rows at these batch sizes only, joined by "+"
        SIZES[mode]["batches"] = tuple(int(b) for b in args[args.index("--batches") + 1].split("+"))
    main(mode, which, "--profile" in args)
