"""Products whose every row is summed the same way however many rows come with it: batch invariance on the CPU.

MKL's fp32 GEMM chooses its kernel, and with it the order of each row's sums, by the number of rows (one row: a
matrix-vector kernel; more: blockings that change with the count), so a token's router logits or MLA query changed
in their last bits with the batch it ran in, and in bf16 a near tie then went another way: a sequence's greedy
tokens depended on what else the engine was running (issue 39). `in_row_groups` runs a product over groups of ROWS
rows, the last padded with zeros: every call has one shape, and in it a row's sums depend neither on its place nor
on the other rows (tests/ops/test_rows.py measures both). bf16 GEMMs (the model's linear layers) sum each row alike
at most shapes (the same test), but not at all: on this repository's CPU, K = 512 from 37 rows and K = 7,168 from 2
rows sum some rows by where they fall in the call's blocking; `kimik3.ops.matmul.batch_invariant` (the engine's
`deterministic`) runs those in row groups too. Off the CPU it runs fn once: cuBLAS changes its
sums with the row count too, and grouping one product would not make a step invariant there (the GPU's batch
invariance is its kernels' work), while a loop of small products would slow the training forward whose fp32 master
router weight takes the reference path on CUDA.

Legend: M rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

ROWS = 16


def in_row_groups(fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """fn over x's leading dim in groups of ROWS rows (the last padded with zero rows, cut off after) on the CPU, in
    one call elsewhere: [M, ...] -> [M, ...]. `fn` must treat its rows independently (a product with x's rows on
    the left)."""
    if x.device.type != "cpu":
        return fn(x)
    M = x.shape[0]
    pad = -M % ROWS
    if pad:
        x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])])
    if x.shape[0] == 0:
        return fn(x)
    return torch.cat([fn(g) for g in x.split(ROWS)])[:M]
