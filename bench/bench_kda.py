"""KDA: our entry point (`chunk_kda_with_gate` / `recurrent_kda_with_gate`) vs a bare fla call, K3 shapes.

The overhead target: within 5% of calling fla directly with the same flags. Decode is timed twice: eager (one
call's host time dominates: fla's Python prologue, ~0.25 ms) and replayed from a CUDA graph, as the model's
decode runs it (kernel time only: the entry point's Python cost is gone there).

Also the decode short convolution (`decode_short_conv`, one per q, k, v of every KDA layer and decode step): the
fused Triton kernel vs the torch reference (gather, cat, index_copy, fp32 products and sum, silu), eager and
graphed, at the slice's width P = 64 heads x 128, W = 4, bf16; bandwidth against the bytes it must move.
"""

from __future__ import annotations

import torch
from fla.ops.kda import chunk_kda, fused_recurrent_kda

from bench.common import environment, graphed, median_ms, table, write_json
from kimik3.ops.backend import use_backend
from kimik3.ops.kda import chunk_kda_with_gate, recurrent_kda_with_gate
from kimik3.ops.shortconv import decode_short_conv

H, K = 96, 128


def inputs(B, T):
    r = lambda *s: torch.randn(*s, device="cuda")  # noqa: E731
    return (r(B, T, H, K).bfloat16(), r(B, T, H, K).bfloat16(), r(B, T, H, K).bfloat16(), r(B, T, H, K).bfloat16(),
            r(B, T, H).float(), torch.rand(128, device="cuda"), r(H * K), r(B, H, K, K))


def short_conv(P=64 * 128, W=4):
    """decode_short_conv, Triton vs reference: table rows and JSON results."""
    rows, results = [], {}
    for N in (1, 8, 64):
        x = torch.randn(N, P, device="cuda").bfloat16()
        tails = torch.randn(2 * N, W - 1, P, device="cuda").bfloat16()
        slots, weight = torch.randperm(2 * N, device="cuda")[:N], torch.randn(P, W, device="cuda") * W**-0.5

        def reference():
            with use_backend("torch"):
                return decode_short_conv(x, tails, slots, weight)

        fused = lambda: decode_short_conv(x, tails, slots, weight)  # noqa: E731
        before = tails.clone()
        out = fused().float()
        tails.copy_(before)
        ref = reference().float()
        assert (out - ref).norm() <= 2**-7 * ref.norm()  # the bound tests/ops/test_shortconv.py holds it to
        moved = N * P * 2 * (1 + 2 * (W - 1) + 1) + P * W * 4  # x, tail read + written, out (bf16); fp32 weight
        for how in ("eager", "graph"):
            run_fused, run_ref = (graphed(fused), graphed(reference)) if how == "graph" else (fused, reference)
            t_fused, t_ref = median_ms(run_fused), median_ms(run_ref)
            key = f"short conv N={N} ({how})"
            results[key] = {"triton_ms": t_fused, "reference_ms": t_ref, "bytes": moved,
                            "triton_tb_s": moved / t_fused / 1e9}
            rows.append([key, f"{t_fused:.4f}", f"{t_ref:.4f}", f"{t_ref / t_fused:.1f}x",
                         f"{moved / t_fused / 1e9:.2f}"])
    table(f"decode_short_conv, P={P} W={W} bf16 (median ms)", ["case", "triton", "reference", "speedup", "TB/s"],
          rows)
    return results


def main():
    rows, results = [], {}
    flags = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                 lower_bound=-5.0)
    for mode, B, T in (("prefill", 1, 4096), ("prefill", 1, 16384), ("decode", 1, 1), ("decode", 32, 1),
                       ("decode", 256, 1)):
        q, k, v, g, beta, A_log, dt, h0 = inputs(B, T)
        if mode == "prefill":
            ours = lambda: chunk_kda_with_gate(q, k, v, g, beta, A_log, dt, lower_bound=-5.0, initial_state=h0,  # noqa
                                               output_final_state=True)
            bare = lambda: chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, safe_gate=True,  # noqa
                                     A_log=A_log[:H], dt_bias=dt, **flags)
        else:
            ours = lambda: recurrent_kda_with_gate(q, k, v, g, beta, A_log, dt, lower_bound=-5.0,  # noqa
                                                   initial_state=h0, output_final_state=True)
            bare = lambda: fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,  # noqa
                                               A_log=A_log[:H], dt_bias=dt, **flags)
        assert torch.equal(ours()[0], bare()[0])
        for how in ("eager", "graph") if mode == "decode" else ("eager",):
            run_ours, run_bare = (graphed(ours), graphed(bare)) if how == "graph" else (ours, bare)
            t_ours, t_bare = median_ms(run_ours), median_ms(run_bare)
            key = f"{mode} B={B} T={T}" + (f" ({how})" if mode == "decode" else "")
            results[key] = {"ours_ms": t_ours, "fla_ms": t_bare, "overhead": t_ours / t_bare - 1}
            rows.append([key, f"{t_ours:.3f}", f"{t_bare:.3f}", f"{100 * (t_ours / t_bare - 1):+.1f}%"])
    table("KDA entry point vs bare fla (median ms)", ["case", "ours", "fla", "overhead"], rows)
    results.update(short_conv())
    write_json("bench_kda", {"env": environment(), "results": results})


if __name__ == "__main__":
    main()
