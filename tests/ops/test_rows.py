"""`kimik3.ops.rows.in_row_groups`: a row's product is bitwise the same alone, in any batch and at any place in it;
and the CPU's bf16 GEMM, which the model's linear layers use without it, is so on its own."""

import pytest
import torch
import torch.nn.functional as F

from kimik3.ops.rows import ROWS, in_row_groups


def test_fp32_products_in_row_groups_are_batch_invariant():
    g = torch.Generator().manual_seed(0)
    w_DE = torch.randn(256, 48, generator=g)
    x = torch.randn(3 * ROWS + 5, 256, generator=g)
    alone = in_row_groups(lambda r: r @ w_DE, x[:1])
    for M in (2, 3, ROWS - 1, ROWS, ROWS + 1, 3 * ROWS + 5):
        assert torch.equal(in_row_groups(lambda r: r @ w_DE, x[:M])[:1], alone)
    for place in (1, ROWS - 1, ROWS, 2 * ROWS + 3):  # the same row elsewhere in a batch, among other rows
        y = torch.randn(3 * ROWS, 256, generator=g)
        y[place] = x[0]
        assert torch.equal(in_row_groups(lambda r: r @ w_DE, y)[place], alone[0])
    assert torch.allclose(in_row_groups(lambda r: r @ w_DE, x), x @ w_DE, rtol=1e-5, atol=1e-4)
    assert in_row_groups(lambda r: r @ w_DE, x[:0]).shape == (0, 48)


@pytest.mark.parametrize("shape", [(256, 256), (1536, 256), (256, 1024), (4096, 1024)])
def test_cpu_bf16_linear_rows_are_batch_invariant(shape):
    """The engine's bf16 batch invariance on the CPU rests on this (the model's linear layers run as they are)."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(*shape, generator=g).bfloat16()
    x = torch.randn(130, shape[1], generator=g).bfloat16()
    alone = F.linear(x[:1], w)
    for M in (2, 3, 16, 17, 64, 65, 130):
        assert torch.equal(F.linear(x[:M], w)[:1], alone)


@pytest.mark.parametrize("shape", [(256, 512), (2048, 7168)])
def test_cpu_bf16_linear_rows_in_the_mode_are_batch_invariant(shape):
    """At these shapes MKL's bf16 GEMM sums some rows by where they fall in the call (on this repository's CPU from
    37 and from 2 rows); inside `batch_invariant` the CPU's 16-bit mm / addmm run in row groups, and every prefix of
    a batch, and a row placed elsewhere, gives the full batch's bits."""
    from kimik3.ops.matmul import batch_invariant

    g = torch.Generator().manual_seed(2)
    w = (torch.randn(*shape, generator=g) * 0.02).bfloat16()
    bias = torch.randn(shape[0], generator=g).bfloat16()
    x = torch.randn(100, shape[1], generator=g).bfloat16()
    with batch_invariant():
        for b in (None, bias):
            full = F.linear(x, w, b)
            for M in (1, 2, 15, 16, 17, 37, 64, 99):
                assert torch.equal(F.linear(x[:M], w, b), full[:M])
            y = torch.randn(40, shape[1], generator=g).bfloat16()
            y[33] = x[5]
            assert torch.equal(F.linear(y, w, b)[33], full[5])
            assert torch.equal(F.linear(x[None], w, b)[0], full)  # [1, T, D] as the model's layers call it
