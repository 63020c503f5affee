"""The serving engine against static-batch `generate()` on the same requests, and against the decode roofline.

Rows (issue 16), all in one call:
  mixed     64 requests, prompts 128-4096, outputs 16-512 (greedy, ignore_eos): continuous batching tokens/s
            vs static batches of 16 through generate(cuda_graph=True), in arrival order (target >= 1.5x);
  decode    decode-only engine steps (sampling and bookkeeping included) at 1, 8, 64 running sequences vs
            generate()'s CUDA-graph step + sampler at that batch (target <= 1.2x), and vs the bytes roofline
            (weights the step must read + the KDA states and MLA latents at that context, at the measured copy
            bandwidth);
  prefix    a 4,096-token shared prefix: time to first token of a warm request (restored snapshot) vs a cold
            one (target <= 0.2x).

    PYTHONPATH=src:. python3 bench/bench_engine.py             # device: slice-12, table + $OUT/bench_engine.json
    PYTHONPATH=src:. python3 bench/bench_engine.py --cpu-demo  # the same rows, scaled down, demo model fp32 on CPU
    PYTHONPATH=src:. python3 bench/bench_engine.py --smoke     # CPU check of this script at toy sizes
    ... --rows prefix,mixed                                     # only some of decode, prefix, mixed
    ... --profile             # decode rows also: the graph replay alone (device time, CUDA events) for both sides,
                              # so host overhead and kernel time separate; and the kernels of one eager step each
"""

from __future__ import annotations

import random
import sys
import time

import torch

from bench.common import DEVICE, ceilings, environment, median_ms, profile_top, smoke_config, sync, table, write_json
from kimik3.inference import Sampler, SamplingParams, generate
from kimik3.inference.cuda_graph import GraphedDecoder, static_step
from kimik3.inference.engine import Engine, Request
from kimik3.inference.engine.runner import _DecodeGraph
from kimik3.model import K3ForCausalLM
from kimik3.model.moe import LatentMoE
from kimik3.ops.backend import moe_backend_from_env, use_backend
from kimik3.presets import load_config
from kimik3.quant import relayout_experts

SIZES = {  # mixed: requests, prompt range, output range, static batch; decode: context, steps; prefix tokens
    "device": dict(requests=64, prompt=(128, 4096), output=(16, 512), static_batch=16, context=1024, steps=16,
                   batches=(1, 8, 64), prefix=4096, budget=2048),
    "cpu-demo": dict(requests=12, prompt=(32, 256), output=(4, 32), static_batch=4, context=128, steps=3,
                     batches=(1, 8, 64), prefix=512, budget=256),
    "smoke": dict(requests=6, prompt=(16, 100), output=(2, 8), static_batch=3, context=32, steps=2, batches=(1, 4),
                  prefix=128, budget=128),
}


def workload(s: dict, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(vocab) for _ in range(rng.randint(*s["prompt"]))], rng.randint(*s["output"]))
            for _ in range(s["requests"])]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)


def run_engine(engine: Engine, reqs) -> float:
    """Generated tokens per second, all requests submitted at once."""
    sync()
    t0 = time.perf_counter()
    outs = engine.generate([p for p, _ in reqs], [greedy(n) for _, n in reqs])
    sync()
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


def run_static(model, reqs, batch: int, graphs: bool) -> float:
    sync()
    t0 = time.perf_counter()
    tokens = 0
    for i in range(0, len(reqs), batch):
        part = reqs[i:i + batch]
        outs = generate(model, [p for p, _ in part], [greedy(n) for _, n in part], cuda_graph=graphs)
        tokens += sum(len(o.token_ids) for o in outs)
    sync()
    return tokens / (time.perf_counter() - t0)


def engine_decode_ms(model, B: int, s: dict, graphs: bool, profile: bool = False) -> float:
    """Median ms of an engine step once B sequences of `context` tokens all decode."""
    engine = Engine(model, max_num_seqs=max(B, 1), max_num_batched_tokens=max(s["budget"], s["context"] + 64),
                    max_model_len=s["context"] + s["steps"] + 64, use_cuda_graphs=graphs, enable_prefix_cache=False)
    g = torch.Generator().manual_seed(B)
    for i in range(B):
        prompt = torch.randint(0, 1000, (s["context"],), generator=g).tolist()
        engine.add_request(Request(str(i), prompt, greedy(s["steps"] + 8)))
    while engine.stats["waiting"] or any(q.num_computed < len(q.tokens) - 1 for q in engine.scheduler.running):
        engine.step()  # prefills
    times = []
    for _ in range(s["steps"]):
        sync()
        t0 = time.perf_counter()
        engine.step()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    if profile:  # the static step on the scratch rows: the same kernels as the real rows, nothing overwritten
        if graphs:
            replay = engine.runner.graphs[engine.runner._bucket(B)].graph.replay
            print(f"-- decode B={B}: engine graph replay alone {median_ms(replay):.3f} ms (device time)", flush=True)
        profile_top(_DecodeGraph(engine.runner, B, None)._forward, f"engine decode B={B}", iters=3)
    return sorted(times)[len(times) // 2]


def static_decode_ms(model, B: int, s: dict, graphs: bool, profile: bool = False) -> float:
    """Median ms of generate()'s decode step (graph replay + sampler) at batch B and the same context."""
    cache = model.new_cache(B, s["context"] + s["steps"] + 8)
    model(torch.randint(0, 1000, (B, s["context"]), device=DEVICE), cache=cache)
    sampler = Sampler([greedy(1)] * B, model.config.vocab_size, DEVICE)
    step = GraphedDecoder(model, cache) if graphs else (lambda t: model(t[:, None], cache=cache)[:, -1])
    tokens = torch.randint(0, 1000, (B,), device=DEVICE)
    times = []
    for _ in range(s["steps"]):
        sync()
        t0 = time.perf_counter()
        tokens = sampler.sample(step(tokens))
        tokens.tolist()  # generate() reads the tokens on the host every step too
        times.append((time.perf_counter() - t0) * 1e3)
    if profile:
        if graphs:
            print(f"-- decode B={B}: generate() graph replay alone {median_ms(step.graph.replay):.3f} ms (device time)",
                  flush=True)
        last = torch.full((1,), cache.length - 1, dtype=torch.long, device=DEVICE)  # rewrites the newest position
        profile_top(lambda: static_step(model, cache, tokens[:, None], last), f"generate() decode B={B}", iters=3)
    return sorted(times)[len(times) // 2]


def roofline_ms(model, B: int, context: int, bandwidth: float) -> float:
    """Bytes a decode step must move at the measured copy bandwidth: the dense weights, the routed experts B
    tokens are expected to touch, each sequence's KDA state (read + write) and MLA latents over `context`."""
    cfg = model.config
    expert, dense = 0, 0
    for name, t in model.state_dict().items():
        if name.endswith("embed_tokens.weight"):  # a lookup reads only B rows of the table
            dense += B * t[0].nbytes
            continue
        (expert := expert + t.nbytes) if ".experts." in name else (dense := dense + t.nbytes)
    moe = next((m for m in model.modules() if isinstance(m, LatentMoE)), None)
    touched = 1 - (1 - cfg.moe.num_experts_per_token / cfg.moe.num_experts) ** B if moe is not None else 0
    one = model.new_cache(1, context).nbytes()
    per_seq = 2 * (one["kda_state"] + one["kda_conv"]) + one["mla_latent"]
    return (dense + expert * touched + B * per_seq) / bandwidth * 1e3


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
def main(mode: str, which: tuple[str, ...] = ("decode", "prefix", "mixed"), profile: bool = False) -> None:
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
    for B in s["batches"] if "decode" in which else ():
        e = engine_decode_ms(model, B, s, graphs, profile)
        g = static_decode_ms(model, B, s, graphs, profile)
        roof = roofs[B]
        results[f"decode B={B}"] = {"engine_ms": e, "generate_ms": g, "ratio": e / g, "roofline_ms": roof}
        rows.append([f"decode step B={B}, context {s['context']} (ms)", f"{e:.2f}", f"{g:.2f}", f"{e / g:.2f}x",
                     f"<= 1.2x; roofline {roof:.2f} ms = {roof / e:.0%}"])
        emit(results, rows, mode)

    if "prefix" in which:
        prefix_row(model, s, vocab, results, rows, mode)
    if "mixed" in which:
        mixed_row(model, s, vocab, graphs, results, rows, mode)

    title = {"device": "slice-12 on the device", "cpu-demo": "demo model, fp32, CPU", "smoke": "smoke"}[mode]
    results["table"] = table(f"engine vs static generate(): {title}", ["row", "engine", "generate() / cold",
                                                                        "ratio", "target"], rows)
    results["env"] = environment()
    write_json(f"bench_engine_{mode}", {**results, "rows": rows})


def prefix_row(model, s, vocab, results, rows, mode) -> None:
    g = torch.Generator().manual_seed(1)
    head = torch.randint(0, vocab, (s["prefix"],), generator=g).tolist()
    tails = [torch.randint(0, vocab, (32,), generator=g).tolist() for _ in range(3)]
    engine = Engine(model, max_num_seqs=4, max_num_batched_tokens=s["budget"], max_model_len=s["prefix"] + 128)
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
    engine = Engine(model, max_num_seqs=s["requests"], max_num_batched_tokens=s["budget"],
                    max_model_len=longest + 64, enable_prefix_cache=True)
    run_engine(engine, reqs[:2])  # warm-up: compiles and graphs outside the timing
    engine.reset_prefix_cache()
    cont = run_engine(engine, reqs)
    run_static(model, reqs[:2], s["static_batch"], graphs)
    static = run_static(model, reqs, s["static_batch"], graphs)
    results["mixed"] = {"engine_tokens_per_s": cont, "static_tokens_per_s": static, "ratio": cont / static,
                        "engine_stats": engine.stats}
    rows.append([f"mixed, {s['requests']} requests (tokens/s)", f"{cont:,.1f}", f"{static:,.1f}",
                 f"{cont / static:.2f}x", ">= 1.5x"])
    emit(results, rows, mode)


if __name__ == "__main__":
    args = sys.argv[1:]
    which = tuple(args[args.index("--rows") + 1].split(",")) if "--rows" in args else ("decode", "prefix", "mixed")
    main("smoke" if "--smoke" in args else "cpu-demo" if "--cpu-demo" in args else "device", which,
         "--profile" in args)
