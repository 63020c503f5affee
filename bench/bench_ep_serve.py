"""Serving a real-dims K3 slice too large for one GPU with expert parallelism: 24 layers (3:1 KDA:MLA, the
released widths) with all 896 MXFP4 experts per MoE layer, each of W ranks holding 896/W of them.

Each rank serves its own batch of B sequences (data-parallel attention, replicated dense weights); the routed
experts' latent rows travel by all-to-all. Reported: prefill and decode tokens/s over all ranks, and each
decode step against its bytes floor (this rank's dense weights + its experts + caches, read once, at the copy
bandwidth measured in the same run). Eager: the all-to-all split sizes are read on the host once per MoE layer,
which CUDA graphs cannot capture.

    torchrun --nproc_per_node 8 bench/bench_ep_serve.py            # nvidia-h200-x8: table + $OUT/bench_ep_serve.json
    torchrun --nproc_per_node 2 bench/bench_ep_serve.py --smoke    # CPU (gloo) check of this script at toy sizes
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "src")]

from bench.build import dense_bytes, expert_bytes, materialize  # noqa: E402
from bench.common import CONFIGS, DEVICE, ceilings, environment, smoke_config, sync, table, write_json  # noqa: E402
from kimik3.checkpoint.sharded import slice_experts  # noqa: E402
from kimik3.config import K3Config  # noqa: E402
from kimik3.distributed import apply_expert_parallel  # noqa: E402
from kimik3.model import K3ForCausalLM  # noqa: E402
from kimik3.quant import pack_experts  # noqa: E402


def slice_24() -> K3Config:
    """configs/slice-12.json grown to 24 layers (KDA, KDA, KDA, MLA repeated) with the released 896 experts."""
    d = json.loads((CONFIGS / "slice-12.json").read_text())
    t = d["text_config"]
    t.update(num_hidden_layers=24, num_experts=896)
    t["linear_attn_config"].update(kda_layers=[i for i in range(1, 25) if i % 4],
                                   full_attn_layers=[4, 8, 12, 16, 20, 24])
    return K3Config.from_hf(d)


def _sync() -> None:
    sync()
    dist.barrier()


@torch.no_grad()
def main(smoke: bool = False) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if DEVICE.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl" if DEVICE.type == "cuda" else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if DEVICE.type == "cuda" else DEVICE
    cfg = smoke_config("slice-12").text if smoke else slice_24().text
    prefill, context, steps = (32, 16, 4) if smoke else (8192, 1024, 32)
    with torch.device("meta"):
        model = K3ForCausalLM(cfg, torch.bfloat16)
    slice_experts(pack_experts(model), rank, world)  # this rank's experts only, before anything is allocated
    model = apply_expert_parallel(materialize(model, seed=rank)).eval()
    ceil = ceilings()
    # what a decode step streams: every weight but the embedding table (B rows of it) and this rank's experts
    weight_bytes = (dense_bytes(model) - model.model.embed_tokens.weight.nbytes
                    + expert_bytes(model) * (cfg.moe.num_experts // world) * sum(cfg.moe_layers))
    results, rows = {}, []

    ids = torch.randint(0, 1000, (1, prefill), device=device)
    model(ids)  # warm-up (kernel compilation and autotuning)
    _sync()
    t0 = time.perf_counter()
    model(ids)
    _sync()
    seconds = time.perf_counter() - t0
    results[f"prefill T={prefill} per rank"] = {"tokens_per_s": world * prefill / seconds, "ms": seconds * 1e3}
    rows.append([f"prefill T={prefill} x {world} ranks", f"{world * prefill / seconds:,.0f}", f"{seconds * 1e3:.1f}",
                 "", ""])
    for B in (1, 8, 64):
        cache = model.new_cache(B, context + steps + 2)
        model(torch.randint(0, 1000, (B, context), device=device), cache=cache)
        tokens = torch.randint(0, 1000, (B, 1), device=device)
        model(tokens, cache=cache)
        _sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            tokens = model(tokens, cache=cache)[:, -1:].argmax(-1)
        _sync()
        ms = (time.perf_counter() - t0) * 1e3 / steps
        cache_bytes = sum(cache.nbytes().values())
        floor = (weight_bytes + cache_bytes) / ceil["copy_bytes_per_s"] * 1e3  # as bench_layer's roofline
        results[f"decode B={B} per rank"] = {"tokens_per_s": world * B * 1e3 / ms, "ms_per_step": ms,
                                             "floor_ms": floor, "weight_bytes": weight_bytes,
                                             "cache_bytes": cache_bytes}
        rows.append([f"decode B={B} x {world} ranks", f"{world * B * 1e3 / ms:,.0f}", f"{ms:.2f}", f"{floor:.2f}",
                     f"{ms / floor:.2f}x"])
    if rank == 0:
        table(f"EP serving, {cfg.num_layers} layers, {cfg.moe.num_experts} experts over {world} ranks "
              f"({weight_bytes / 1e9:.1f} GB of weights per rank)",
              ["case", "tokens/s (all ranks)", "ms", "floor ms", "ratio"], rows)
        write_json("bench_ep_serve", {"env": {**environment(), "ranks": world}, "ceilings": ceil,
                                      "results": results})
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(smoke="--smoke" in sys.argv[1:])
