"""The optimizer phase's two passes over every parameter, ours (`kimik3.ops.optim`) vs torch's, against the bytes
floor: the AdamW update with the clip folded in as a `grad_scale` (torch's fused AdamW, the previous trainer's,
also writes the unscaled gradient back: 16 bytes per bf16 parameter; ours 14) and the global gradient norm
(2 bytes per parameter). Parameters: one MoE layer of the training slice (the two routed-expert stacks, the
shared expert, a KDA layer's projections and the small vectors), bf16 weights and moments.

    PYTHONPATH=src:. python3 bench/bench_optim.py            # device: table + $OUT/bench_optim.json
    PYTHONPATH=src:. python3 bench/bench_optim.py --smoke    # CPU check of this script at toy sizes
"""

from __future__ import annotations

import torch

from bench.common import DEVICE, ceilings, environment, median_ms, table, write_json
from kimik3.ops.optim import grad_norm
from kimik3.train.optim import AdamW

# [shape] per parameter: experts w1 (gate|up) [E, 2F, L] and w2 [E, L, F], shared gate/up/down, KDA q/k/v/g/o,
# norms and gates (one layer of configs/slice-train-4.json: E = 128, F = 3072, L = 3584, H = 7168)
SHAPES = [(128, 6144, 3584), (128, 3584, 3072), (6144, 7168), (7168, 6144), *[(12288, 7168)] * 4, (7168, 12288),
          (7168,), (7168,), (96,), (12288, 4)]
HYPER = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def make_params(smoke: bool) -> list[torch.nn.Parameter]:
    shapes = [tuple(max(1, d // 64) for d in s) for s in SHAPES] if smoke else SHAPES
    params = []
    for s in shapes:
        p = torch.nn.Parameter(torch.randn(s, device=DEVICE, dtype=torch.bfloat16) * 0.02)
        p.grad = torch.randn_like(p) * 1e-3
        params.append(p)
    return params


def main(smoke: bool = False):
    copy = ceilings()["copy_bytes_per_s"]
    params = make_params(smoke)
    n = sum(p.numel() for p in params)
    scale = torch.tensor(1.5, device=DEVICE)
    results, rows = {}, []
    floors = {"adamw": 14 * n / copy * 1e3, "norm": 2 * n / copy * 1e3}  # bytes moved at the copy rate
    for name, opt in (("torch fused", torch.optim.AdamW(params, fused=True, **HYPER)),
                      ("ours", AdamW(params, **HYPER))):
        opt.grad_scale = scale  # the trainer's clip, as Optimizers.step hands it over
        results[f"adamw {name}"] = median_ms(opt.step, 2, 10)
        opt.state.clear()
    grads = [p.grad for p in params]
    results["norm torch get_total_norm"] = median_ms(lambda: torch.nn.utils.get_total_norm(grads, 2.0), 3, 20)
    results["norm ours"] = median_ms(lambda: grad_norm(grads), 3, 20)
    truth = torch.stack([g.double().square().sum() for g in grads]).sum().sqrt()
    rel = {"norm ours": float((grad_norm(grads).double() - truth).abs() / truth),
           "norm torch get_total_norm": float((torch.nn.utils.get_total_norm(grads, 2.0).double() - truth).abs()
                                              / truth)}
    for key, ms in results.items():
        floor = floors[key.split()[0]]
        rows.append([key, f"{ms:.2f}", f"{floor:.2f}", f"{floor / ms:.0%}", f"{rel[key]:.1e}" if key in rel else ""])
    table(f"optimizer passes over {n / 1e9:.2f} G bf16 parameters (copy {copy / 1e12:.2f} TB/s), median ms",
          ["pass", "ms", "bytes floor", "of floor", "rel err (norm vs fp64)"], rows)
    write_json("bench_optim", {"env": environment(), "params": n, "results": results, "floors_ms": floors,
                               "rel_err": rel})


if __name__ == "__main__":
    import sys

    main(smoke="--smoke" in sys.argv[1:])
