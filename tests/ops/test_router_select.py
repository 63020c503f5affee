"""The router's expert selection: the Triton kernel against the reference (`route`).

CPU: under Triton's interpreter (tests/conftest.py switches it on before triton is imported) when triton is
installed, else skipped. GPU (`-m gpu`): the CUDA kernel at K3's size, and the dispatch (the kernel only where no
gradient is asked for).
"""

import pytest
import torch

from kimik3.ops.router import select_reference
from tests.helpers import needs_cuda_triton as needs_cuda
from tests.helpers import needs_interpreter


def case(N, E, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, E, generator=gen) * 3
    bias = torch.randn(E, generator=gen) * 0.1
    return logits.to(device), bias.to(device)


def check(N, E, A, renormalize, device):
    from kimik3.ops.router import select_triton

    logits, bias = case(N, E, device, seed=N * E + A)
    idx, w, s = select_triton.route(logits, bias, A, renormalize, 2.5)
    idx_r, w_r, s_r = select_reference.route(logits, bias, A, renormalize, 2.5)
    assert idx.dtype == torch.int64 and w.dtype == torch.float32 and s.shape == (N, E)
    assert torch.allclose(s, s_r, rtol=1e-6, atol=0)
    # the same experts with the same weights (the reference's order is unspecified: compare sorted by expert),
    # on every row whose A-th and (A+1)-th biased scores are not within the two sigmoids' ulps of a tie
    top = (s_r + bias).sort(-1, descending=True).values
    clear = (top[:, A - 1] - top[:, A] > 1e-5) if A < E else torch.ones(N, dtype=torch.bool, device=device)
    assert clear.float().mean() > 0.9 if N else True
    o, o_r = idx[clear].sort(-1), idx_r[clear].sort(-1)
    assert torch.equal(o.values, o_r.values)
    assert torch.allclose(w[clear].gather(-1, o.indices), w_r[clear].gather(-1, o_r.indices), rtol=1e-6, atol=0)
    # in descending biased score
    biased = (s + bias).gather(-1, idx)
    assert (biased[:, :-1] >= biased[:, 1:]).all()


@needs_interpreter
@pytest.mark.parametrize("N,E,A,renormalize", [(3, 896, 16, True), (5, 8, 2, True), (4, 5, 1, True),
                                               (2, 64, 6, False), (0, 32, 4, True)])
def test_interpreted_matches_reference(N, E, A, renormalize):
    check(N, E, A, renormalize, "cpu")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("N", [1, 64, 8192])
def test_cuda_matches_reference_gpu(N):
    check(N, 896, 16, True, "cuda")


@pytest.mark.gpu
@needs_cuda
def test_cuda_dispatch_keeps_autograd_gpu():
    """With a gradient asked for, `route` takes the reference (the kernel has no backward)."""
    from kimik3.ops.router import route

    logits, bias = case(4, 896, "cuda")
    logits.requires_grad_()
    _, w, _ = route(logits, bias, 16, True, 2.5)
    w.sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0
