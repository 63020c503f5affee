"""A real-dims 12-layer K3 slice (3:1 KDA:MLA, 256 MXFP4 experts per MoE layer, released vocabulary) on one
H200: prefill tokens/s at 8192 and decode tokens/s at batch 1, 8, 64 under CUDA graphs, side by side with
the same model on the reference ops (`use_backend("torch")`, eager: the references sync with the host)."""

from __future__ import annotations

import time

import torch

from bench.build import materialize
from bench.common import environment, median_ms, table, write_json
from kimik3.inference.cuda_graph import GraphedDecoder
from kimik3.model import K3ForCausalLM
from kimik3.ops.backend import use_backend
from kimik3.presets import load_config

CONTEXT = 1024


def decode_tps(model, B: int, steps: int, graph: bool) -> float:
    cache = model.new_cache(B, CONTEXT + steps + 8)
    model(torch.randint(0, 1000, (B, CONTEXT), device="cuda"), cache=cache)
    tokens = torch.randint(0, 1000, (B,), device="cuda")
    step = GraphedDecoder(model, cache) if graph else (lambda t: model(t[:, None], cache=cache)[:, -1])
    step(tokens)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        tokens = step(tokens).argmax(-1)
    torch.cuda.synchronize()
    return B * steps / (time.perf_counter() - t0)


@torch.no_grad()
def main():
    cfg = load_config("slice-12").text
    with torch.device("meta"):
        model = K3ForCausalLM(cfg, torch.bfloat16)
    model = materialize(model).eval()
    results, rows = {}, []
    for T in (8192, 2048):
        ids = torch.randint(0, 1000, (1, T), device="cuda")
        ms = median_ms(lambda: model(ids), 2, 5)
        results[f"prefill T={T} ours"] = T / (ms * 1e-3)
    with use_backend("torch"):
        ids = torch.randint(0, 1000, (1, 2048), device="cuda")
        ms = median_ms(lambda: model(ids), 1, 2)
        results["prefill T=2048 reference"] = 2048 / (ms * 1e-3)
    rows.append(["prefill T=8192", f"{results['prefill T=8192 ours']:,.0f}", "", ""])
    rows.append(["prefill T=2048", f"{results['prefill T=2048 ours']:,.0f}",
                 f"{results['prefill T=2048 reference']:,.0f}",
                 f"{results['prefill T=2048 ours'] / results['prefill T=2048 reference']:.1f}x"])
    for B in (1, 8, 64):
        ours = decode_tps(model, B, 64, graph=True)
        eager = decode_tps(model, B, 16, graph=False)
        with use_backend("torch"):
            ref = decode_tps(model, B, 4, graph=False)
        results[f"decode B={B}"] = {"ours_graph": ours, "ours_eager": eager, "reference": ref}
        rows.append([f"decode B={B} (graph | eager)", f"{ours:,.0f} | {eager:,.0f}", f"{ref:,.0f}",
                     f"{ours / ref:.1f}x"])
    table("12-layer real-dims slice, tokens/s", ["case", "ours", "reference ops", "speedup"], rows)
    write_json("bench_slice", {"env": environment(), "results": results})


if __name__ == "__main__":
    main()
