"""Batch-invariant products (`kimik3.ops.matmul`) and the mode that routes a model's products through them.

CPU: the Triton kernel under Triton's interpreter against the fp32 reference (shapes off its tiles, batched and
strided operands, fp32 out, empty dims), each row the same bits at any row count; the mode's context (thread-local,
nothing routed on CPU tensors). GPU (`-m gpu`): the routes (F.linear, einsum, addmm, the router's fp32-out product)
inside `batch_invariant`, each row bitwise the same at 1 to 300 rows, near the reference.
Bounds (design.md §3): fp32 < 1e-5 relative, bf16 < 2e-2 (in fact ~1e-3: one rounding).
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from kimik3.ops.backend import batch_invariant_mode
from kimik3.ops.matmul import batch_invariant, matmul, reference
from tests.helpers import interpret_triton, patch_interpreter_index, rel_err, requires_cuda

INTERPRET = not torch.cuda.is_available() and interpret_triton()
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module")
def fast():
    if not INTERPRET:
        pytest.skip("needs triton, no CUDA, and triton not imported before this module")
    from kimik3.ops.matmul import triton

    with pytest.MonkeyPatch.context() as mp:
        patch_interpreter_index(mp)  # the kernel loops over a runtime K
        yield triton


def _rand(*shape, dtype=torch.float32, seed=0, device="cpu"):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,K,N", [(1, 96, 80), (70, 130, 200), (64, 64, 64), (3, 7, 5)])
def test_kernel_is_reference(fast, M, K, N, dtype):
    a, w = _rand(M, K, dtype=dtype), _rand(N, K, dtype=dtype, seed=1)
    out = fast.matmul(a, w.T)  # a weight's transposed view, as F.linear passes it
    want = reference.matmul(a, w.T)
    assert out.dtype == dtype and out.shape == (M, N)
    assert rel_err(out.float(), want.float()) < TOL[dtype]
    out32 = fast.matmul(a, w.T, torch.float32)  # the router's form: 16-bit in, fp32 sums out
    assert out32.dtype == torch.float32 and rel_err(out32, a.float() @ w.float().T) < 1e-5


def test_kernel_batched_strided_and_empty(fast):
    a = _rand(5, 3, 40, dtype=torch.bfloat16).transpose(0, 1)  # [3, 5, 40], not contiguous (MLA's head-major view)
    b = _rand(3, 40, 24, dtype=torch.bfloat16, seed=2)
    out = fast.matmul(a, b)
    assert out.shape == (3, 5, 24) and rel_err(out.float(), reference.matmul(a, b).float()) < 2e-2
    assert fast.matmul(a[:, :0], b).shape == (3, 0, 24)
    assert torch.equal(fast.matmul(a[..., :0], b[:, :0]), torch.zeros(3, 5, 24, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="do not multiply"):
        fast.matmul(a, b[:, :39])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_rows_do_not_depend_on_the_row_count(fast, dtype):
    """Row i of a 1-, 5-, 64- and 70-row product: the same bits as in the 130-row one."""
    a, w = _rand(130, 200, dtype=dtype), _rand(90, 200, dtype=dtype, seed=3)
    full = fast.matmul(a, w.T)
    for rows in (slice(0, 1), slice(7, 12), slice(60, 124), slice(3, 73)):
        assert torch.equal(fast.matmul(a[rows], w.T), full[rows])


def test_tile_follows_the_row_count_in_16_bit_only(fast):
    """64 x 64 tiles up to 64 rows, 128 x 128 above (the K order is the same: the row tests above cross it);
    fp32 inputs keep the first tile at every row count."""
    assert fast.tiling(1, torch.bfloat16) == fast.tiling(64, torch.float16) == (64, 64, 4, 4)
    assert fast.tiling(65, torch.bfloat16) == fast.tiling(8192, torch.bfloat16) == (128, 128, 8, 3)
    assert fast.tiling(8192, torch.float32) == (64, 64, 4, 4)


def test_split_k_follows_the_weight_shape_only(fast):
    """K split into S ranges (S from N and K alone: more for narrow weights, at least MIN_STEPS steps a range), the
    partials added in split order: near the reference, each row the same bits at any row count, batched too."""
    assert fast.splits(7168, 12288) == 3 and fast.splits(576, 7168) == 28 and fast.splits(163840, 7168) == 1
    assert fast.splits(96, 130) == 1 and fast.splits(96, 1100) == 5
    for dtype, out_dtype in ((torch.bfloat16, None), (torch.bfloat16, torch.float32), (torch.float32, None)):
        a, w = _rand(70, 1100, dtype=dtype, seed=6), _rand(96, 1100, dtype=dtype, seed=7)
        full = fast.matmul(a, w.T, out_dtype)
        want = reference.matmul(a, w.T, out_dtype)
        assert full.dtype == want.dtype and rel_err(full.float(), want.float()) < TOL[want.dtype]
        for rows in (slice(0, 1), slice(9, 12), slice(5, 70)):
            assert torch.equal(fast.matmul(a[rows], w.T, out_dtype), full[rows])
    a3, b3 = _rand(2, 5, 600, dtype=torch.bfloat16, seed=8), _rand(2, 600, 40, dtype=torch.bfloat16, seed=9)
    assert fast.splits(40, 600) == 3
    out = fast.matmul(a3, b3)
    assert rel_err(out.float(), reference.matmul(a3, b3).float()) < 2e-2
    assert torch.equal(fast.matmul(a3[:, 2:3], b3), out[:, 2:3])


def test_mode_is_scoped_to_its_thread_and_routes_nothing_on_the_cpu():
    a, w = _rand(6, 32, dtype=torch.bfloat16), _rand(16, 32, dtype=torch.bfloat16, seed=4)
    outside = F.linear(a, w)
    seen = []
    assert not batch_invariant_mode()
    with batch_invariant():
        assert batch_invariant_mode()
        worker = threading.Thread(target=lambda: seen.append(batch_invariant_mode()))
        worker.start()
        worker.join()
        assert torch.equal(F.linear(a, w), outside)  # CPU products are invariant as they are (kimik3.ops.rows)
        with batch_invariant():  # nested
            assert batch_invariant_mode()
        assert batch_invariant_mode()
    assert not batch_invariant_mode() and seen == [False]


def test_matmul_dispatch_on_cpu_is_reference():
    a, w = _rand(4, 24, dtype=torch.bfloat16), _rand(24, 8, dtype=torch.bfloat16, seed=5)
    assert torch.equal(matmul(a, w), reference.matmul(a, w))


ROW_COUNTS = (1, 2, 7, 16, 64, 65, 300)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("K,N", [(7168, 1536), (2048, 4096), (512, 9216)])
def test_linear_rows_are_batch_invariant_gpu(K, N):
    """F.linear in bf16 inside `batch_invariant`: row i's bits at every row count are those of the 300-row call,
    near the fp32 reference; outside the mode cuBLAS is free to differ (it picks kernels by the row count)."""
    x, w = _rand(300, K, dtype=torch.bfloat16, device="cuda"), _rand(N, K, dtype=torch.bfloat16, seed=1, device="cuda")
    w = w * K**-0.5
    with batch_invariant():
        full = F.linear(x, w)
        assert rel_err(full.float(), x.float() @ w.float().T) < 1e-2
        for n in ROW_COUNTS:
            for start in (0, 300 - n):
                assert torch.equal(F.linear(x[start:start + n], w), full[start:start + n]), (n, start)
        x3 = x[:64].view(4, 16, K)  # a 3-d input folds into one mm
        assert torch.equal(F.linear(x3, w).view(64, N), full[:64])


@pytest.mark.gpu
@requires_cuda
def test_routes_gpu():
    """Each routed aten product inside the mode runs `matmul`: bmm (einsum), addmm (a bias), mm.dtype (fp32 out)."""
    from kimik3.ops.router import router_logits

    x = _rand(37, 256, dtype=torch.bfloat16, device="cuda")
    w = _rand(96, 256, dtype=torch.bfloat16, seed=6, device="cuda")
    b = _rand(96, dtype=torch.bfloat16, seed=7, device="cuda")
    h = _rand(37, 4, 64, dtype=torch.bfloat16, seed=8, device="cuda")
    wh = _rand(4, 64, 48, dtype=torch.bfloat16, seed=9, device="cuda")
    with batch_invariant():
        assert torch.equal(torch.einsum("thn,hnc->thc", h, wh), matmul(h.transpose(0, 1), wh).transpose(0, 1))
        biased = F.linear(x, w, b)
        assert torch.equal(biased, (matmul(x, w.T, torch.float32) + b.float()).bfloat16())
        logits = router_logits(x, w)
        assert logits.dtype == torch.float32 and torch.equal(logits, matmul(x, w.T, torch.float32))
        assert torch.equal(router_logits(x[5:6], w), logits[5:6])


def test_reference_rows_do_not_depend_on_the_row_count():
    """The reference keeps the contract on the CPU too (MKL's fp32 GEMM alone changes a row's sums with the row
    count: `kimik3.ops.rows`), 2-d and batched."""
    a, w = _rand(70, 300, dtype=torch.bfloat16, seed=10), _rand(50, 300, dtype=torch.bfloat16, seed=11)
    full = reference.matmul(a, w.T, torch.float32)
    for rows in (slice(0, 1), slice(3, 5), slice(20, 37)):
        assert torch.equal(reference.matmul(a[rows], w.T, torch.float32), full[rows])
    a3, b3 = _rand(3, 40, 64, seed=12), _rand(3, 64, 24, seed=13)
    full3 = reference.matmul(a3, b3)
    assert torch.equal(reference.matmul(a3[:, 7:8], b3), full3[:, 7:8])
