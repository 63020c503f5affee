"""SiTU-GLU: the fused Triton kernels vs the torch reference, forward and forward+backward, against the bytes
floor (forward reads gate and up and writes the output; backward reads them and d out and writes two
gradients), at the routed experts' shape of a training step (8192 tokens x top-16 rows, width 3072) and the
shared expert's (8192 x 6144), bf16.

    PYTHONPATH=src:. python3 bench/bench_situ.py            # device: table + $OUT/bench_situ.json
    PYTHONPATH=src:. python3 bench/bench_situ.py --smoke    # CPU check of this script at toy sizes
"""

from __future__ import annotations

import torch

from bench.common import DEVICE, FUSED_COLUMNS, ceilings, environment, fused_case, table, write_json
from kimik3.ops.situ import situ_glu

BETA, LINEAR_BETA = 4.0, 25.0


def fwd_bwd(gate, up, d_out):
    g, u = gate.detach().requires_grad_(), up.detach().requires_grad_()
    situ_glu(g, u, BETA, LINEAR_BETA).backward(d_out)


def main(smoke: bool = False):
    copy = ceilings()["copy_bytes_per_s"]
    rows, results, errors = [], {}, {}
    shapes = (("routed rows", (8192 * 16, 3072)), ("shared expert", (8192, 6144)))
    for name, shape in ((n, (s[0] // 512, s[1] // 16)) for n, s in shapes) if smoke else shapes:
        gate, up, d_out = (torch.randn(shape, device=DEVICE, dtype=torch.bfloat16) * 3 for _ in range(3))
        n = gate.numel()
        floors = {"fwd": 3 * 2 * n / copy * 1e3, "fwd+bwd": (3 + 5) * 2 * n / copy * 1e3}
        results[name], errors[name], case_rows = fused_case(
            name, shape, lambda: situ_glu(gate, up, BETA, LINEAR_BETA), lambda: fwd_bwd(gate, up, d_out), floors)
        rows += case_rows
    table(f"SiTU-GLU, bf16 (copy {copy / 1e12:.2f} TB/s), median ms", FUSED_COLUMNS, rows)
    write_json("bench_situ", {"env": environment(), "results": results, "rel_err": errors})


if __name__ == "__main__":
    import sys

    main(smoke="--smoke" in sys.argv[1:])
