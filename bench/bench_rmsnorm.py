"""RMSNorm: the fused Triton kernels vs the torch reference (fp32 copy, norm, cast, gain: a pass each), forward
and forward+backward, against the bytes floor (forward reads x and writes y; backward reads x and d y and writes
d x), at a training step's hidden states (8192 x 7168) and latents (131,072 routed rows are not normed; the
latent norm sees 8192 x 3584), and at one decode token (1 x 7168, where the launches are the cost), bf16.

    PYTHONPATH=src:. python3 bench/bench_rmsnorm.py            # device: table + $OUT/bench_rmsnorm.json
    PYTHONPATH=src:. python3 bench/bench_rmsnorm.py --smoke    # CPU check of this script at toy sizes
"""

from __future__ import annotations

import torch

from bench.common import DEVICE, FUSED_COLUMNS, ceilings, environment, fused_case, table, write_json
from kimik3.ops.rmsnorm import rms_norm

EPS = 1e-5


def main(smoke: bool = False):
    copy = ceilings()["copy_bytes_per_s"]
    rows, results, errors = [], {}, {}
    shapes = (("hidden", (8192, 7168)), ("latent", (8192, 3584)), ("decode", (1, 7168)))
    for name, shape in ((n, (max(1, s[0] // 512), s[1] // 16)) for n, s in shapes) if smoke else shapes:
        x, dy = (torch.randn(shape, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
        w = (1 + 0.1 * torch.randn(shape[1], device=DEVICE)).bfloat16()
        n = x.numel()
        floors = {"fwd": 2 * 2 * n / copy * 1e3, "fwd+bwd": (2 + 3) * 2 * n / copy * 1e3}

        def fwd_bwd():
            xx, ww = x.detach().requires_grad_(), w.detach().requires_grad_()
            rms_norm(xx, ww, EPS).backward(dy)

        results[name], errors[name], case_rows = fused_case(name, shape, lambda: rms_norm(x, w, EPS), fwd_bwd,
                                                           floors)
        rows += case_rows
    table(f"RMSNorm, bf16 (copy {copy / 1e12:.2f} TB/s), median ms", FUSED_COLUMNS, rows)
    write_json("bench_rmsnorm", {"env": environment(), "results": results, "rel_err": errors})


if __name__ == "__main__":
    import sys

    main(smoke="--smoke" in sys.argv[1:])
