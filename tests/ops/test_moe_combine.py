"""The routed rows' dispatch and combine kernels (`kimik3.ops.moe.combine`) against autograd on the reference code
(`z[tok]`, `grouped.reference_combine`), forward and gradients, and the grouped path with and without them.

CPU: under Triton's interpreter (tests/conftest.py switches it on before triton is imported) when triton is
installed, else skipped. GPU (`-m gpu`): the CUDA kernels at K3's widths.
"""

import pytest
import torch

from kimik3.ops.moe import grouped
from tests.helpers import needs_cuda_triton as needs_cuda
from tests.helpers import needs_interpreter, rel_err

BETA, LINEAR_BETA = 4.0, 25.0


def case(N, A, E, L, dtype, device="cpu", seed=0):
    """Rows y sorted by expert as the grouped path sorts them, the sort's order, weights, z and d out."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=gen)[:A] for _ in range(N)])  # distinct experts per token
    _, order = torch.sort(idx.reshape(-1), stable=True)
    w = torch.rand(N, A, generator=gen) + 0.05
    y = torch.randn(N * A, L, generator=gen)
    z = torch.randn(N, L, generator=gen)
    d_out = torch.randn(N, L, generator=gen)
    to = lambda t, dt=dtype: t.to(device, dt)  # noqa: E731
    return to(y), to(order, torch.long), to(w, torch.float32), to(z), to(d_out), to(idx, torch.long)


def run_pair(y, order, w, z, d_out):
    """(out, d y, d w) of combine and (x, d z) of dispatch, for the kernels and for the reference code."""
    from kimik3.ops.moe import combine

    N, A = w.shape
    tok = order // A
    results = []
    for fused in (True, False):
        yy, ww, zz = (t.clone().requires_grad_() for t in (y, w, z))
        if fused:
            inv = combine.inverse(order, N, A)
            out, x = combine.combine(yy, inv, ww), combine.dispatch(zz, tok, inv)
        else:
            out, x = grouped.reference_combine(yy, order, ww), zz[tok]
        d_x = torch.ones_like(x) * torch.arange(1, x.shape[0] + 1, device=x.device, dtype=x.dtype)[:, None] / 7
        torch.autograd.backward([out, x], [d_out.to(out.dtype), d_x])
        results.append((out.detach(), yy.grad, ww.grad, x.detach(), zz.grad))
    # d z's float64 truth: the A rows of each token summed exactly, then compared once
    truth = torch.zeros(z.shape, dtype=torch.float64, device=z.device).index_add(0, tok, d_x.double())
    return results, truth


def check(run, dtype):
    results, dz_truth = run
    (out, dy, dw, x, dz), (out_r, dy_r, dw_r, x_r, dz_r) = results
    assert out.dtype == dtype and dy.dtype == dtype and dw.dtype == torch.float32 and dz.dtype == dtype
    assert torch.equal(x, x_r)  # the dispatch forward is the same gather
    assert torch.equal(dy, dy_r)  # d y = round(w * d out) on both sides
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: fp32 sums in another order, rounded once to 8 bits
    errors = {"out": rel_err(out, out_r), "d w": rel_err(dw, dw_r), "d z": rel_err(dz, dz_r)}
    print(f"combine {dtype}: " + " ".join(f"{k} {v:.1e}" for k, v in errors.items()))
    assert max(errors.values()) < tol, errors
    # summed in fp32 and rounded once, the kernels' d z is at least as close to the truth as autograd's
    assert rel_err(dz, dz_truth) <= rel_err(dz_r, dz_truth) + 1e-7


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,A,L", [(1, 1, 8), (7, 3, 600), (16, 4, 64)])  # L past one block of 512; one row
def test_interpreted_matches_reference(N, A, L, dtype):
    y, order, w, z, d_out, _ = case(N, A, 6, L, dtype, seed=N * A)
    check(run_pair(y, order, w, z, d_out), dtype)


@needs_interpreter
def test_inverse_undoes_the_sort():
    from kimik3.ops.moe import combine

    _, order, *_ = case(9, 3, 5, 4, torch.float32)
    inv = combine.inverse(order, 9, 3)
    assert inv.dtype == torch.int32 and torch.equal(order[inv.reshape(-1).long()], torch.arange(27))


@needs_interpreter
def test_grouped_path_fused_equals_unfused():
    """The whole grouped path (sort, dispatch, three grouped GEMMs, SiTU, combine) with and without the kernels."""
    N, A, E, L, F = 12, 3, 6, 64, 96
    gen = torch.Generator().manual_seed(1)
    _, _, tw, z, d_out, idx = case(N, A, E, L, torch.bfloat16, seed=1)
    ws = [(torch.randn(*s, generator=gen) / s[-1] ** 0.5).bfloat16() for s in ((E, F, L), (E, F, L), (E, L, F))]
    runs = []
    for fused in (True, False):
        zz, tt, *wws = (t.clone().requires_grad_() for t in (z, tw, *ws))
        out = grouped.routed_experts(zz, idx, tt, *wws, BETA, LINEAR_BETA, fused=fused)
        runs.append((out, *torch.autograd.grad((out.float() * d_out.float()).sum(), [zz, tt, *wws])))
    for a, b in zip(*runs):
        assert rel_err(a, b) < 1e-2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("N", [1, 300, 8192])
def test_cuda_matches_reference_at_k3_width_gpu(N):
    y, order, w, z, d_out, _ = case(N, 16, 64, 3584, torch.bfloat16, device="cuda", seed=N)
    check(run_pair(y, order, w, z, d_out), torch.bfloat16)
