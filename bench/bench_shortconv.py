"""KDA's short convolution over whole sequences: the fused Triton kernels vs the torch reference, forward and
forward+backward, against the bytes floor (forward reads x and writes the output; backward reads x and d out and
writes d x), at a real-dims layer's prefill (8192 tokens x 12,288 channels: 96 heads x 128) on one sequence and
on eight packed documents (training), bf16. A KDA layer runs three (q, k, v).

    PYTHONPATH=src:. python3 bench/bench_shortconv.py            # device: table + $OUT/bench_shortconv.json
    PYTHONPATH=src:. python3 bench/bench_shortconv.py --smoke    # CPU check of this script at toy sizes
"""

from __future__ import annotations

import torch

from bench.common import DEVICE, FUSED_COLUMNS, ceilings, environment, fused_case, table, write_json
from kimik3.ops.shortconv import short_conv

W = 4


def fwd_bwd(x, w, cu_seqlens, d_out):
    xx, ww = x.detach().requires_grad_(), w.detach().requires_grad_()
    short_conv(xx, ww, cu_seqlens).backward(d_out)


def main(smoke: bool = False):
    copy = ceilings()["copy_bytes_per_s"]
    rows, results, errors = [], {}, {}
    T, P = (128, 256) if smoke else (8192, 12288)
    cases = (("one sequence", None), ("8 packed documents", torch.arange(0, T + 1, T // 8, device=DEVICE)))
    for name, cu_seqlens in cases:
        x, d_out = (torch.randn(1, T, P, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
        w = (torch.rand(P, W, device=DEVICE) * 2 - 1) * W**-0.5
        n = x.numel()
        floors = {"fwd": 2 * 2 * n / copy * 1e3, "fwd+bwd": (2 + 3) * 2 * n / copy * 1e3}
        results[name], errors[name], case_rows = fused_case(
            name, (1, T, P), lambda: short_conv(x, w, cu_seqlens), lambda: fwd_bwd(x, w, cu_seqlens, d_out), floors)
        rows += case_rows
    table(f"short convolution (W = {W}), bf16 (copy {copy / 1e12:.2f} TB/s), median ms", FUSED_COLUMNS, rows)
    write_json("bench_shortconv", {"env": environment(), "results": results, "rel_err": errors})


if __name__ == "__main__":
    import sys

    main(smoke="--smoke" in sys.argv[1:])
