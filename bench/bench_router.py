"""The MoE router at K3's gate shape (hidden 7168, 896 experts, top-16) over decode to training token counts: the
logits as one bf16 tensor-core GEMM with fp32 output vs the fp32 reference (forward, forward+backward), and the
expert selection as one Triton kernel vs the reference's sigmoid / topk / gather / renormalize (no gradient).

    PYTHONPATH=src:. python3 bench/bench_router.py            # device: table + $OUT/bench_router.json
    PYTHONPATH=src:. python3 bench/bench_router.py --smoke    # CPU check of this script at toy sizes
"""

from __future__ import annotations

import sys

import torch

from bench.common import DEVICE, environment, median_ms, table, write_json
from kimik3.ops.backend import use_backend
from kimik3.ops.router import route, router_logits


def main(smoke: bool = False) -> None:
    (D, E), counts = ((64, 16), (4, 32)) if smoke else ((7168, 896), (16, 1024, 8192, 32768))
    g = torch.Generator(device=DEVICE).manual_seed(0)
    w = (torch.randn(E, D, device=DEVICE, generator=g) * 0.02).bfloat16().requires_grad_()
    rows, results = [], {}
    for N in counts:
        x = torch.randn(N, D, device=DEVICE, generator=g).bfloat16().requires_grad_()
        d_out = torch.randn(N, E, device=DEVICE, generator=g)
        r = {}
        for name in ("auto", "torch"):  # the fast path where it applies, then the reference
            with use_backend(name):
                with torch.no_grad():
                    r[f"{name} fwd"] = median_ms(lambda: router_logits(x, w))
                r[f"{name} fwd+bwd"] = median_ms(lambda: router_logits(x, w).backward(d_out))
        results[str(N)] = r
        rows.append([N, f"{r['auto fwd']:.3f} / {r['torch fwd']:.3f}", f"{r['torch fwd'] / r['auto fwd']:.1f}x",
                     f"{r['auto fwd+bwd']:.3f} / {r['torch fwd+bwd']:.3f}",
                     f"{r['torch fwd+bwd'] / r['auto fwd+bwd']:.1f}x"])
    table(f"router logits, D={D} E={E}, bf16 (ms: tensor-core GEMM / fp32 reference)",
          ["tokens", "fwd", "speed-up", "fwd+bwd", "speed-up"], rows)
    select_rows, A = [], 2 if smoke else 16
    bias = torch.randn(E, device=DEVICE, generator=g) * 0.01
    for N in (1, *counts):
        logits = torch.randn(N, E, device=DEVICE, generator=g)
        r = {}
        for name in ("auto", "torch"):
            with use_backend(name), torch.no_grad():
                r[name] = median_ms(lambda: route(logits, bias, A, True, 2.5))
        results[f"select {N}"] = r
        select_rows.append([N, f"{r['auto']:.4f}", f"{r['torch']:.4f}", f"{r['torch'] / r['auto']:.1f}x"])
    table(f"router selection, E={E} top-{A} (ms, no gradient)", ["tokens", "fused", "reference", "speed-up"],
          select_rows)
    write_json("bench_router", {"env": environment(), "results": results})


if __name__ == "__main__":
    main(smoke="--smoke" in sys.argv[1:])
