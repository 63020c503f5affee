"""Expert tiering on the device: slice-12 (11 MoE layers x 256 MXFP4 experts, 49 GB) with the GPU keeping 100%, 50%,
25% and 10% of the routed experts, and 0% (exps=CPU: every expert computed on the host).

Rows, all in one call (the same engine settings for every row: greedy, no prefix cache):
  resident   the model as users get it without tiering (Humming's kernels, CUDA graphs), eager, and on Triton's
             kernels (the tiers' device kernel: the tokens every tiered row must equal, bf16)
  tiered     per budget: decode tokens/s at 1 and 8 sequences (a 256-token prompt, then 24 timed steps), prefill
             tokens/s of a 4,096-token prompt (2,048-token chunks, serve's default), the hit rate, the misses' way,
             and the bound: the resident step plus the step's missed bytes at the faster of the measured copy and
             host-kernel rates (target: batch-1 decode within 1.3x of it; faster than exps=CPU at every budget)
  exps=CPU   no slot: every routed expert computed on the host, prefill chunks too (42 tok/s on the device machine;
             llama.cpp's exps=CPU instead offloads batches of 32 rows or more to the GPU, which the tiered rows'
             streamed prefill is)

    PYTHONPATH=src:. python3 bench/bench_tiering.py            # device; table + $OUT/bench_tiering.json
    PYTHONPATH=src:. python3 bench/bench_tiering.py --smoke    # CPU check of this script at toy sizes
"""

from __future__ import annotations

import sys
import time

import torch

from bench.common import DEVICE, environment, smoke_config, sync, table, write_json
from kimik3.inference import SamplingParams
from kimik3.inference.engine import Engine, EngineConfig, Request
from kimik3.model import K3ForCausalLM
from kimik3.model.moe import LatentMoE, TieredExperts
from kimik3.ops.backend import use_backend
from kimik3.ops.moe.cache import ExpertCache
from kimik3.ops.moe.tiered import HostTier, empty_experts, expert_nbytes
from kimik3.placement import fill_slots, tier_stats
from kimik3.presets import load_config
from kimik3.quant import relayout_experts

SIZES = {"device": dict(prompt=256, steps=24, prefill=4096, budget=2048, batches=(1, 8), staging=32,
                        fractions=(0.5, 0.25, 0.1, 0.0)),
         "smoke": dict(prompt=32, steps=3, prefill=128, budget=64, batches=(1, 2), staging=2,
                       fractions=(0.5, 0.0))}


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]


def decode(model, B: int, s: dict, graphs: bool | None) -> tuple[float, list[list[int]], list[float], dict]:
    """(median step ms once B sequences decode, their greedy tokens, every timed step's ms, the tiers' counters
    over the timed steps)."""
    engine = Engine(model, EngineConfig(max_num_seqs=B, max_num_batched_tokens=max(s["budget"], B * s["prompt"]),
                                        max_model_len=s["prompt"] + s["steps"] + 16, enable_prefix_cache=False,
                                        use_cuda_graphs=graphs))
    for i, p in enumerate(prompts(B, s["prompt"], model.config.vocab_size, B)):
        engine.add_request(Request(str(i), p, greedy(s["steps"] + 4)))
    tokens = {str(i): [] for i in range(B)}

    def step():
        for out in engine.step():
            tokens[out.request_id] += out.outputs[0].token_ids

    while engine.stats["waiting"] or any(q.num_computed < len(q.tokens) - 1 for q in engine.scheduler.running):
        step()  # prefills
    before = tier_stats(model)
    times = []
    for _ in range(s["steps"]):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    after = tier_stats(model)
    return (sorted(times)[len(times) // 2], [tokens[str(i)] for i in range(B)], times,
            {k: after[k] - before[k] for k in after})


def prefill_tps(model, s: dict, graphs: bool | None) -> float:
    engine = Engine(model, EngineConfig(max_num_seqs=1, max_num_batched_tokens=s["budget"],
                                        max_model_len=s["prefill"] + 8, enable_prefix_cache=False,
                                        use_cuda_graphs=graphs))
    best = float("inf")
    for rep in range(2):  # the second pass: kernels compiled, slots as the first left them
        sync()
        t0 = time.perf_counter()
        engine.add_request(Request(f"p{rep}", prompts(1, s["prefill"], model.config.vocab_size, 99 + rep)[0],
                                   greedy(1)))
        while engine.has_unfinished():
            engine.step()
        sync()
        best = min(best, time.perf_counter() - t0)
    return s["prefill"] / best


def host_copies(model) -> list[tuple[LatentMoE, object]]:
    """Every MoE layer's experts copied into pinned host memory (the host tier, made once for every budget)."""
    out = []
    for moe in [m for m in model.modules() if isinstance(m, LatentMoE)]:
        w = moe.experts.weights()
        host = empty_experts(w, w.num_experts, torch.device("cpu"), pin=DEVICE.type == "cuda")
        for a, b in zip((*w.packed, *w.scales), (*host.packed, *host.scales)):
            b.copy_(a)
        out.append((moe, host))
    return out


def tier(layers, slots: int, staging: int, misses: str) -> HostTier:
    """Every MoE layer as TieredExperts over the shared host copies with `slots` slots (the old slots freed)."""
    first = layers[0][1]
    shared = HostTier(DEVICE, [empty_experts(first, min(staging, first.num_experts), DEVICE) for _ in range(2)],
                      misses)
    for moe, host in layers:
        moe.experts = None
        torch.cuda.empty_cache() if DEVICE.type == "cuda" else None
        moe.experts = TieredExperts(host, empty_experts(host, slots, DEVICE), ExpertCache(host.num_experts, slots),
                                    shared)
    return shared


@torch.no_grad()
def main(mode: str) -> None:
    s = SIZES[mode]
    if mode == "device":
        from bench.build import materialize

        with torch.device("meta"):
            model = K3ForCausalLM(load_config("slice-12").text, torch.bfloat16)
        model = materialize(model).eval()
    else:
        from kimik3.quant import pack_experts

        model = pack_experts(K3ForCausalLM(smoke_config("slice-12").text, torch.float32).init_weights(0)).eval()
    E = model.config.moe.num_experts
    results, rows = {"mode": mode, "sizes": s, "env": environment()}, []

    def row(name, B1, B8, pre, extra=""):
        rows.append([name, f"{B1:.1f}", f"{B8:.1f}", f"{pre:,.0f}", extra])
        print(" | ".join(rows[-1]), flush=True)
        write_json("bench_tiering", {**results, "rows": rows})

    # the tiers' device kernel on all-resident experts: the reference tokens and like-for-like speed
    with use_backend(moe="triton"):
        ref = {B: decode(model, B, s, None)[:2] for B in s["batches"]}
        tri_pre = prefill_tps(model, s, None)
    results["resident_triton"] = {B: r[0] for B, r in ref.items()}
    row("resident, Triton kernels, graphs (tok/s)", *(B / ref[B][0] * 1e3 for B in s["batches"]), tri_pre)
    layers = host_copies(model)
    expert = expert_nbytes(layers[0][1])
    results["expert_bytes"], results["moe_layers"] = expert, len(layers)
    relayout_experts(model)  # what users run without tiering: Humming where it can run
    res = {B: decode(model, B, s, None)[0] for B in s["batches"]}
    eager = {B: decode(model, B, s, False)[0] for B in s["batches"]}
    res_pre = prefill_tps(model, s, None)
    results["resident"] = {"decode_ms": res, "eager_ms": eager, "prefill_tps": res_pre}
    row("resident (default: Humming, graphs)", *(B / res[B] * 1e3 for B in s["batches"]), res_pre)
    row("resident, eager steps (what tiered steps pay)", *(B / eager[B] * 1e3 for B in s["batches"]), res_pre,
        " / ".join(f"B={B}: {eager[B] / res[B]:.2f}x the graphed step" for B in s["batches"]))

    for frac in (*s["fractions"],):
        slots = int(frac * E)
        misses = "host" if slots == 0 else "auto"
        shared = tier(layers, slots, s["staging"], misses)
        fill_slots(model)
        got, ok = {}, True
        shared.misses = "copy"  # every row the resident layer's: the tokens must be the resident run's
        copy_ms, copy_toks, _, _ = decode(model, s["batches"][0], s, None)
        shared.misses = misses
        for B in s["batches"]:
            ms, toks, times, d = decode(model, B, s, None)
            hit = d["hits"] / max(d["hits"] + d["misses"], 1)
            missed = d["missed_experts"] / max(d["steps"], 1)  # per layer and step
            link = shared.link_bytes_per_s
            host = expert / shared.host_seconds[0]
            bound = res[B] + len(layers) * missed * expert / max(link, host) * 1e3
            ok &= toks == ref[B][1]
            got[B] = dict(ms=ms, hit_rate=hit, missed_experts_per_layer_step=missed, bound_ms=bound,
                          of_bound=ms / bound, same_tokens=toks == ref[B][1], counters=d,
                          max_step_ms=max(times), layer_ms_per_step=d["layer_seconds"] / s["steps"] * 1e3,
                          host_kernel_ms_per_step=d["host_seconds"] / s["steps"] * 1e3)
        pre = prefill_tps(model, s, None)
        results[f"tiered {frac:.0%}"] = {"slots": slots, "misses": misses, "decode": got, "prefill_tps": pre,
                                         "copy_B1_ms": copy_ms,
                                         "copy_B1_same_tokens": copy_toks == ref[s["batches"][0]][1],
                                         "link_GBps": shared.link_bytes_per_s / 1e9,
                                         "host_GBps": expert / shared.host_seconds[0] / 1e9}
        name = f"{frac:.0%} of experts on the GPU ({slots} of {E} a layer)" if slots else "exps=CPU (0 slots)"
        one = got[s["batches"][0]]
        row(name, *(B / got[B]["ms"] * 1e3 for B in s["batches"]), pre,
            f"hit {one['hit_rate']:.0%}; B=1 {one['of_bound']:.2f}x its bound ({one['bound_ms']:.1f} ms; tiered layers "
            f"{one['layer_ms_per_step']:.1f} ms a step, host kernel {one['host_kernel_ms_per_step']:.1f}); tokens "
            f"{'=' if ok else '!='} resident; misses copied: {1e3 / copy_ms:.1f} tok/s, tokens "
            f"{'=' if copy_toks == ref[s['batches'][0]][1] else '!='} resident")

    results["table"] = table(f"expert tiering: {'slice-12, H200' if mode == 'device' else 'smoke'}",
                             ["row", f"decode B={s['batches'][0]} tok/s", f"decode B={s['batches'][1]} tok/s",
                              f"prefill {s['prefill']} tok/s", "notes"], rows)
    print(results["table"], flush=True)
    write_json("bench_tiering", {**results, "rows": rows})


if __name__ == "__main__":
    main("smoke" if "--smoke" in sys.argv else "device")
