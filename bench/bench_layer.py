"""One real-dims K3 layer (hidden 7168, 96 heads, 896 MXFP4 experts top-16), KDA+MoE and MLA+MoE:
decode at batch 1, 8, 64 (CUDA graph, 4096 cached tokens) against the bytes roofline, and prefill of 8192
tokens against the bf16 matmul rate on the matmul FLOPs.

    PYTHONPATH=src:. python3 bench/bench_layer.py            # device: table + $OUT/bench_layer.json
    PYTHONPATH=src:. python3 bench/bench_layer.py --smoke    # CPU check of this script at toy sizes
    add --profile: the kernels of eager decode at batch 1 and of the prefill, by device time
"""

from __future__ import annotations

import torch

from bench.build import dense_bytes, expert_bytes, experts_backend_of, linear_flops, materialize
from bench.common import DEVICE, ceilings, environment, graphed, median_ms, profile_top, smoke_config, table, write_json
from kimik3.model.decoder import DecoderLayer
from kimik3.model.state import StatePool
from kimik3.model.step import uniform_step
from kimik3.presets import load_config


def routed_experts_touched(layer, x) -> int:
    """Distinct experts the router picks for x (the experts a decode step must stream)."""
    moe = layer.block_sparse_moe
    idx, _, _ = moe.gate(layer.post_attention_layernorm(x).reshape(-1, x.shape[-1]))
    return int(idx.unique().numel())


@torch.no_grad()
def main(smoke: bool = False, profile: bool = False):
    cfg = (smoke_config if smoke else load_config)("slice-layers").text
    context, prefill = (64, 128) if smoke else (4096, 8192)
    H, K = cfg.kda.num_heads, cfg.kda.head_dim
    latent = cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim
    ceil = ceilings()
    env, results, rows = environment(), {}, []
    D, A = cfg.hidden_size, cfg.moe.num_experts_per_token
    for idx, kind in ((0, "KDA+MoE"), (1, "MLA+MoE")):
        with torch.device("meta"):
            layer = DecoderLayer(cfg, idx, torch.bfloat16)
        layer = materialize(layer, seed=idx).eval()
        # counted on the stored MXFP4 experts, before `relayout_experts` may hand them to Humming's layout
        dense, per_expert, flops = dense_bytes(layer), expert_bytes(layer), linear_flops(layer, prefill, A)
        backend = experts_backend_of(layer)
        blocks = torch.randn(4, 64, 1, D, device=DEVICE, dtype=torch.bfloat16)
        for B in (1, 8, 64):
            MB = -(-(context + 1) // 64)
            pool = StatePool([layer.self_attn.state_spec()], B, B * MB, 64, torch.bfloat16, DEVICE)
            for t in (pool.recurrent, pool.conv, pool.latent):
                t.normal_()
            slots = torch.arange(B, device=DEVICE)
            step = uniform_step(slots, torch.full((B,), context, device=DEVICE),
                                torch.arange(B * MB, device=DEVICE).view(B, MB), row_len=1, block_size=64,
                                max_len=context + 1)
            x = torch.randn(1, B, D, device=DEVICE, dtype=torch.bfloat16)  # a step packs its rows in one
            eager = lambda: layer(x, blocks[:, :B].transpose(1, 2), None, pool.layers[0], step)  # noqa: E731
            if profile and B == 1:
                profile_top(eager, f"{kind} decode B=1, eager", iters=10)
            run = graphed(eager)
            ms = median_ms(run, 5, 50)
            # the state read and written: KDA's fp32 [H, K, K] per row, or MLA's bf16 latent row per cached token
            state = 2 * B * H * K * K * 4 if kind == "KDA+MoE" else 2 * B * (context + 1) * latent * 2
            touched = routed_experts_touched(layer, x)
            nbytes = dense + touched * per_expert + state + 4 * 2 * B * D * 5
            roof = nbytes / ceil["copy_bytes_per_s"] * 1e3
            results[f"{kind} decode B={B}"] = {"ms": ms, "bytes": nbytes, "roofline_ms": roof, "experts": touched}
            rows.append([kind, f"decode B={B}", f"{ms:.3f}", f"{roof:.3f}", f"{ms / roof:.2f}x",
                         f"{nbytes / 1e9:.2f} GB"])
        T = prefill
        x = torch.randn(1, T, D, device=DEVICE, dtype=torch.bfloat16)
        blocks1 = torch.randn(4, 1, T, D, device=DEVICE, dtype=torch.bfloat16)
        ms = median_ms(lambda: layer(x, blocks1), 2, 10)
        if profile:
            profile_top(lambda: layer(x, blocks1), f"{kind} prefill T={T}", iters=2)
        if kind == "MLA+MoE":
            qk, v = cfg.mla.qk_nope_head_dim + cfg.mla.qk_rope_head_dim, cfg.mla.v_head_dim
            flops += 2 * cfg.mla.num_heads * T * T * (qk + v) // 2  # causal attention: QK^T and PV, half the square
        rate = flops / (ms * 1e-3)
        frac = rate / ceil["bf16_flops_per_s"]
        results[f"{kind} prefill T={T}"] = {"ms": ms, "flops": flops, "tflops": rate / 1e12, "fraction": frac}
        rows.append([kind, f"prefill T={T}", f"{ms:.2f}", f"{flops / ceil['bf16_flops_per_s'] * 1e3:.2f}",
                     f"{frac * 100:.0f}% of mm rate", f"{rate / 1e12:.0f} TFLOP/s"])
        layer = None  # free the layer's weights before building the next
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()
    table(f"one real-dims layer, {backend} experts (copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
          f"bf16 mm {ceil['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s)",
          ["layer", "case", "ms", "roofline ms", "ratio", "bytes/rate"], rows)
    write_json("bench_layer", {"env": env, "ceilings": ceil, "experts": backend, "results": results})


if __name__ == "__main__":
    import sys

    main(smoke="--smoke" in sys.argv[1:], profile="--profile" in sys.argv[1:])
