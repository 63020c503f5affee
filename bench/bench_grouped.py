"""The training path of the routed experts (`kimik3.ops.moe.grouped`, three bf16 grouped GEMMs): the routed rows
moved by the gather kernels of `kimik3.ops.moe.combine` (fused) vs autograd's scatter-adds and fp32 row copies
(unfused), forward and forward+backward, at a training step's shape of the 4-layer slice (8192 tokens, top-16
of 128 experts, latent 3584, width 3072), bf16; with each side's error from the fused side's.

    PYTHONPATH=src:. python3 bench/bench_grouped.py            # device: table + $OUT/bench_grouped.json
    PYTHONPATH=src:. python3 bench/bench_grouped.py --smoke    # CPU check of this script at toy sizes
"""

from __future__ import annotations

import torch

from bench.common import DEVICE, environment, median_ms, table, write_json
from kimik3.ops.moe import grouped

BETA, LINEAR_BETA = 4.0, 25.0


def main(smoke: bool = False):
    N, A, E, L, F = (64, 4, 8, 64, 96) if smoke else (8192, 16, 128, 3584, 3072)
    gen = torch.Generator().manual_seed(0)
    idx = torch.stack([torch.randperm(E, generator=gen)[:A] for _ in range(N)]).to(DEVICE)
    tw = (torch.rand(N, A, generator=gen) + 0.05).to(DEVICE)
    z, d_out = (torch.randn(N, L, generator=gen).to(DEVICE, torch.bfloat16) for _ in range(2))
    ws = [(torch.randn(*s, generator=gen) / s[-1] ** 0.5).to(DEVICE, torch.bfloat16)
          for s in ((E, F, L), (E, F, L), (E, L, F))]
    fused_ok = DEVICE.type == "cuda" or smoke  # CPU: the kernels under Triton's interpreter (TRITON_INTERPRET=1)

    def run(fused: bool, backward: bool):
        zz, tt, *wws = (t.detach().requires_grad_(backward) for t in (z, tw, *ws))
        out = grouped.routed_experts(zz, idx, tt, *wws, BETA, LINEAR_BETA, fused=fused)
        if backward:
            out.backward(d_out)
            return out, zz.grad, tt.grad, *(w.grad for w in wws)
        return (out,)

    results, rows = {}, []
    sides = [True, False] if fused_ok else [False]
    outs = {f: [t.detach().float() for t in run(f, True)] for f in sides}
    errors = {}
    for fused in sides:
        name = "fused" if fused else "unfused"
        with torch.no_grad():
            fwd = median_ms(lambda: run(fused, False), 3, 20)
        fwd_bwd = median_ms(lambda: run(fused, True), 3, 20)
        errs = [float((a - b).norm() / b.norm()) for a, b in zip(outs[fused], outs[sides[0]])]
        results[name], errors[name] = {"fwd_ms": fwd, "fwd_bwd_ms": fwd_bwd}, max(errs)
        rows.append([name, f"{fwd:.3f}", f"{fwd_bwd:.3f}", f"{max(errs):.1e}"])
    if len(sides) == 2:
        u, f = results["unfused"], results["fused"]
        rows.append(["unfused / fused", f"{u['fwd_ms'] / f['fwd_ms']:.2f}x",
                     f"{u['fwd_bwd_ms'] / f['fwd_bwd_ms']:.2f}x", ""])
    table(f"Routed experts, grouped bf16 path, N={N} top-{A} of {E}, L={L}, F={F}: median ms",
          ["routed rows moved by", "fwd", "fwd+bwd", "max rel err (out, grads) vs fused"], rows)
    write_json("bench_grouped", {"env": environment(), "shape": [N, A, E, L, F], "results": results,
                                 "max_rel_err_vs_fused": errors})


if __name__ == "__main__":
    import sys

    main(smoke="--smoke" in sys.argv[1:])
