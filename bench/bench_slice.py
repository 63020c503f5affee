"""A real-dims 12-layer K3 slice (3:1 KDA:MLA, 256 MXFP4 experts per MoE layer, released vocabulary) on one
H200: prefill tokens/s at 8192 and decode tokens/s at batch 1, 8, 64 under CUDA graphs, side by side with
the same model on the reference ops (`use_backend("torch")`, eager: the references sync with the host).

    PYTHONPATH=src:. python3 bench/bench_slice.py            # device: table + $OUT/bench_slice.json
    PYTHONPATH=src:. python3 bench/bench_slice.py --smoke    # CPU check of this script at toy sizes
"""

from __future__ import annotations

import time

import torch

from bench.build import materialize
from bench.common import DEVICE, decoding_engine, environment, median_ms, smoke_config, sync, table, write_json
from kimik3.model import K3ForCausalLM
from kimik3.ops.backend import use_backend
from kimik3.presets import load_config


def decode_tps(model, B: int, steps: int, graph: bool, context: int, backend: str = "auto") -> float:
    """Decode tokens/s at batch B after a `context`-token prefill, through the engine (graphed where `graph`),
    the steps on `backend`."""
    engine = decoding_engine(model, B, dict(context=context, steps=steps, budget=max(2048, context + 64)), None,
                             graph and DEVICE.type == "cuda")
    with use_backend(backend):
        engine.step()
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync()
    return B * steps / (time.perf_counter() - t0)


@torch.no_grad()
def main(smoke: bool = False):
    cfg = (smoke_config if smoke else load_config)("slice-12").text
    long, short, context = (128, 64, 32) if smoke else (8192, 2048, 1024)
    with torch.device("meta"):
        model = K3ForCausalLM(cfg, torch.bfloat16)
    model = materialize(model).eval()
    results, rows = {}, []
    for T in (long, short):
        ids = torch.randint(0, 1000, (1, T), device=DEVICE)
        ms = median_ms(lambda: model(ids), 2, 5)
        results[f"prefill T={T} ours"] = T / (ms * 1e-3)
    with use_backend("torch"):
        ids = torch.randint(0, 1000, (1, short), device=DEVICE)
        ms = median_ms(lambda: model(ids), 1, 2)
        results[f"prefill T={short} reference"] = short / (ms * 1e-3)
    rows.append([f"prefill T={long}", f"{results[f'prefill T={long} ours']:,.0f}", "", ""])
    rows.append([f"prefill T={short}", f"{results[f'prefill T={short} ours']:,.0f}",
                 f"{results[f'prefill T={short} reference']:,.0f}",
                 f"{results[f'prefill T={short} ours'] / results[f'prefill T={short} reference']:.1f}x"])
    for B in (1, 8, 64):
        ours = decode_tps(model, B, 64, graph=True, context=context)
        eager = decode_tps(model, B, 16, graph=False, context=context)
        ref = decode_tps(model, B, 4, graph=False, context=context, backend="torch")
        results[f"decode B={B}"] = {"ours_graph": ours, "ours_eager": eager, "reference": ref}
        rows.append([f"decode B={B} (graph | eager)", f"{ours:,.0f} | {eager:,.0f}", f"{ref:,.0f}",
                     f"{ours / ref:.1f}x"])
    table("12-layer real-dims slice, tokens/s", ["case", "ours", "reference ops", "speedup"], rows)
    write_json("bench_slice", {"env": environment(), "results": results})


if __name__ == "__main__":
    import sys

    main(smoke="--smoke" in sys.argv[1:])
