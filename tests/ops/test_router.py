"""The router's logits against the float64 truth, elementwise, with the summation bound of `kimik3.ops.router`.

CPU: the fp32 reference, an fp32 sum in another order (chunks, as cuBLAS's tiling and split-K add), and the
tensor-core autograd function with its GEMM emulated by exact upcasts and an fp32 GEMM (`aten::mm.dtype` has no
CPU kernel). The tensor cores themselves: tests/ops/test_router_gpu.py (`-m gpu`).
"""

import pytest
import torch

from kimik3.ops.router import reference, router_logits, tensor_core

U = 2.0 ** -24  # fp32 unit roundoff (round to nearest)
ROUND_U = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: U}
K3_D, K3_E = 7168, 896


def gamma(n: int, u: float = U) -> float:
    return n * u / (1 - n * u)


def truth(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(a @ b, |a| @ |b|) in fp64: 16-bit products are exact there and the sums err by ~K 2^-53, nothing here."""
    a, b = a.double(), b.double()
    return a @ b, a.abs() @ b.abs()


def bound_ratio(out: torch.Tensor, exact: torch.Tensor, abs_sum: torch.Tensor, rel: float,
                round_u: float = 0.0) -> float:
    """max over entries of |out - exact| / bound, bound = rel * abs_sum (the summation) plus, when the result
    was then rounded to a format of unit roundoff round_u, round_u * (|exact| + rel * abs_sum). <= 1 passes."""
    sum_err = rel * abs_sum
    bound = sum_err + round_u * (exact.abs() + sum_err)
    err = (out.double() - exact).abs()
    assert torch.isfinite(out).all()
    return (err / bound.clamp_min(torch.finfo(torch.float64).tiny)).max().item()


def operands(N: int, E: int, D: int, kind: str, dtype=torch.bfloat16, seed: int = 0):
    """x [N, D] and w [E, D] in `dtype`. "cancelling": every product has a partner of opposite sign (the exact
    logits are 0), the case where the summation error is largest against the result."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g) * torch.exp(torch.randn(N, 1, generator=g))
    w = torch.randn(E, D, generator=g) * 0.02
    if kind == "cancelling":
        x = torch.cat([x[:, : D // 2], x[:, : D // 2]], dim=1)
        w = torch.cat([w[:, : D // 2], -w[:, : D // 2]], dim=1)
    return x.to(dtype), w.to(dtype)


def chunked_fp32(x: torch.Tensor, w: torch.Tensor, chunk: int = 112) -> torch.Tensor:
    """x @ w^T summed in fp32 in another order: per-chunk fp32 GEMMs, the partials added last chunk first."""
    N, D = x.shape
    parts = torch.einsum("nck,eck->cne", x.float().view(N, D // chunk, chunk), w.float().view(-1, D // chunk, chunk))
    acc = torch.zeros_like(parts[0])
    for p in parts.flip(0):
        acc = acc + p
    return acc


@pytest.mark.parametrize("kind", ["random", "cancelling"])
def test_two_fp32_orders_within_the_bound(kind):
    x, w = operands(16, 64, K3_D, kind)
    exact, abs_sum = truth(x, w.T)
    ref, other = reference.router_logits(x, w), chunked_fp32(x, w)
    assert ref.dtype == torch.float32 and ref.shape == (16, 64)
    assert bound_ratio(ref, exact, abs_sum, gamma(K3_D)) <= 1
    assert bound_ratio(other, exact, abs_sum, gamma(K3_D)) <= 1
    assert bound_ratio(ref, other.double(), abs_sum, 2 * gamma(K3_D)) <= 1
    assert not torch.equal(ref, other)  # the orders do differ, so the test exercises the bound
    if kind == "cancelling":
        assert (exact == 0).all()


def test_split3_is_exact():
    g = torch.randn(64, 96) * torch.exp(torch.empty(64, 96).uniform_(-70, 70))  # |g| from ~1e-30 to ~1e30
    parts = tensor_core.split3(g)
    assert parts.dtype == torch.bfloat16 and parts.shape == (64, 288)
    assert torch.equal(parts.double().view(64, 3, 96).sum(1), g.double())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tensor_core_function_emulated(monkeypatch, dtype):
    """Forward and backward of the autograd function; its GEMM here is exact upcasts and an fp32 GEMM, which
    adds the same exact products as `aten::mm.dtype`, in an order the bound covers."""
    monkeypatch.setattr(tensor_core, "mm_f32", lambda a, b: a.float() @ b.float())
    N, E = 24, 40
    x, w = operands(N, E, K3_D, "random", dtype, seed=1)
    x.requires_grad_()
    w.requires_grad_()
    out = tensor_core.router_logits(x, w)
    exact, abs_sum = truth(x.detach(), w.detach().T)
    assert out.dtype == torch.float32
    assert bound_ratio(out, exact, abs_sum, gamma(K3_D)) <= 1
    g = torch.randn(N, E, generator=torch.Generator().manual_seed(2))  # gradients stay in fp16's normal range
    out.backward(g)
    assert x.grad.dtype == dtype and w.grad.dtype == dtype
    slack = 1 + 2.0 ** -7  # |g1| + |g2| + |g3| <= (1 + 2^-7) |g|
    dx, dx_abs = truth(g, w.detach())
    assert bound_ratio(x.grad, dx, slack * dx_abs, gamma(3 * E), ROUND_U[dtype]) <= 1
    dw, dw_abs = truth(g.T, x.detach())
    assert bound_ratio(w.grad, dw, slack * dw_abs, gamma(N + 2), ROUND_U[dtype]) <= 1


def test_public_op_on_cpu_is_the_reference():
    x, w = operands(5, 12, 96, "random")
    assert torch.equal(router_logits(x, w), reference.router_logits(x, w))
    x.requires_grad_()
    master = w.float().requires_grad_()  # an fp32 master weight with bf16 activations: fp32 gradient
    router_logits(x, master).sum().backward()
    assert master.grad.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
