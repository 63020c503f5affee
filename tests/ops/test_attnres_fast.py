"""AttnRes depth mix: the fused Triton kernels against the reference (forward, all four gradients).

CPU: the kernels run under Triton's interpreter on small shapes, in fp32 (skipped where triton is not
installed; the interpreter rounds fp32 -> bf16 toward zero, the GPU to nearest, so bf16 is checked on GPU).
GPU (`-m gpu`): K3 shapes, bf16 and fp32, through the public dispatching function; run with `-s` to see
the measured errors.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from kimik3.ops.attnres import attn_res_mix, reference
from kimik3.ops.backend import use_backend
from tests.helpers import interpret_triton, patch_interpreter_index, rel_err

HAS_TRITON = importlib.util.find_spec("triton") is not None
EPS = 1e-5


def _inputs(M, lead, D, dtype=torch.float32, device="cpu", contiguous=True):
    """Sources of growing, per-row-varying scale (as snapshots of a residual stream) and a softmax that mixes."""
    N = int(np.prod(lead))
    if contiguous:
        blocks = torch.randn(M, N, D, device=device)
        partial = torch.randn(N, D, device=device)
    else:
        blocks = torch.randn(N, M, D, device=device).transpose(0, 1)
        partial = torch.randn(D, N, device=device).t()
    blocks = blocks * (1 + torch.arange(M, device=device)[:, None, None]) * (0.5 + torch.rand(M, N, 1, device=device))
    blocks, partial = blocks.reshape(M, *lead, D), partial.reshape(*lead, D)
    norm_weight = 1 + 0.2 * torch.randn(D, device=device)
    proj_weight = 3 * torch.randn(1, D, device=device) / D**0.5
    return [t.to(dtype).requires_grad_() for t in (blocks, partial, norm_weight, proj_weight)]


def _oracle(blocks, partial, norm_weight, proj_weight, eps):
    """The reference formula in fp64 (the reference itself always computes in fp32)."""
    v = torch.cat([blocks, partial[None]]).double()
    w = norm_weight.double() * proj_weight.double().reshape(-1)
    pi = (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * w).sum(-1).softmax(0)
    return (pi.unsqueeze(-1) * v).sum(0)


def _fwd_bwd(fn, inputs, grad):
    xs = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*xs, EPS)
    return [out, *torch.autograd.grad(out, xs, grad.to(out.dtype))]


def _errors(got, want):
    return [rel_err(a, b) for a, b in zip(got, want)]


# without CUDA, tests/conftest.py switched Triton's interpreter on before anything imported triton
INTERPRET = not torch.cuda.is_available() and interpret_triton()


@pytest.fixture(scope="module")
def interp():
    """`kimik3.ops.attnres.triton` with its kernels running in Triton's interpreter, on CPU tensors (its loops over
    runtime sizes need `patch_interpreter_index` while this module's tests run)."""
    if not INTERPRET:
        pytest.skip("needs triton, no CUDA, and triton not imported before this module")
    from kimik3.ops.attnres import triton as fast

    with pytest.MonkeyPatch.context() as mp:
        patch_interpreter_index(mp)
        yield fast


# (M, leading dims, D, forward config, backward config); the CPU "device" has 3 SMs, so several rows share
# a program; block_d < D takes the chunked path (d w read-modify-written), block_d >= D the one-chunk one;
# M = 5 pads the blocks tile to 8 rows.
CASES = [
    (3, (5,), 100, (32, 4, 1), (32, 4, 1)),
    (1, (2, 3), 64, (64, 4, 1), (64, 4, 1)),
    (4, (37,), 100, (64, 4, 2), (128, 4, 1)),
    (8, (3, 3), 48, (64, 4, 1), (16, 4, 2)),
    (5, (7,), 40, (16, 4, 1), (64, 4, 1)),
]


@pytest.mark.parametrize("M,lead,D,fwd,bwd", CASES)
def test_interpreted_matches_reference(interp, monkeypatch, M, lead, D, fwd, bwd):
    configs = {False: interp.Config(*fwd), True: interp.Config(*bwd)}
    monkeypatch.setattr(interp, "default_config", lambda M, backward: configs[backward])
    inputs = _inputs(M, lead, D, contiguous=M != 4)
    grad = torch.randn(*lead, D)
    got = _fwd_bwd(interp.attn_res_mix, inputs, grad)
    want = _fwd_bwd(reference.attn_res_mix, inputs, grad)
    exact = _fwd_bwd(_oracle, [t.double() for t in inputs], grad.double())
    assert got[0].dtype == torch.float32 and got[0].shape == want[0].shape
    print(f"\ninterp M={M} lead={lead} D={D}: vs ref", " ".join(f"{e:.1e}" for e in _errors(got, want)),
          "| vs fp64", " ".join(f"{e:.1e}" for e in _errors(got, exact)))
    assert max(_errors(got, want)) < 1e-5, _errors(got, want)
    assert max(_errors(got, exact)) < 1e-5, _errors(got, exact)  # checks the backward's derivation


def test_interpreted_writes_every_element(interp):
    """NaN-poisoned output and gradient buffers are fully overwritten; stats hold pi, r and s."""
    M, N, D = 3, 11, 72
    blocks, partial, nw, pw = (t.detach() for t in _inputs(M, (N,), D))
    out = torch.full((N, D), float("nan"))
    out, stats = interp.mix_forward(blocks, partial, nw, pw.reshape(-1), EPS, interp.Config(32, 4, 1), out=out)
    assert rel_err(out, reference.attn_res_mix(blocks, partial, nw, pw, EPS)) < 1e-5
    v = torch.cat([blocks, partial[None]])
    rstd = torch.rsqrt(v.pow(2).mean(-1) + EPS)
    score = (v * rstd[..., None] * nw * pw.reshape(-1)).sum(-1)
    assert rel_err(stats, torch.stack([score.softmax(0), rstd, score])) < 1e-5
    gb, gp = torch.full_like(blocks, float("nan")), torch.full_like(partial, float("nan"))
    grad = torch.randn(N, D)
    gb, gp, dw = interp.mix_backward(grad, blocks, partial, nw, pw.reshape(-1), stats, interp.Config(64, 4, 1),
                                     grad_blocks=gb, grad_partial=gp)
    want = _fwd_bwd(reference.attn_res_mix, [blocks, partial, nw, pw], grad)
    assert rel_err(gb, want[1]) < 1e-5 and rel_err(gp, want[2]) < 1e-5
    assert rel_err(dw * pw.reshape(-1), want[3]) < 1e-5


def test_interpreted_no_blocks(interp):
    """M = 0: the output is the partial sum, its gradient passes straight through, the weights get zero."""
    blocks, partial, nw, pw = _inputs(0, (6,), 40)
    grad = torch.randn(6, 40)
    out, gb, gp, gnw, gpw = _fwd_bwd(interp.attn_res_mix, [blocks, partial, nw, pw], grad)
    assert torch.equal(out, partial) and torch.equal(gp, grad) and gb.shape == blocks.shape
    assert not gnw.any() and not gpw.any()


def test_interpreted_rejects_bad_shapes(interp):
    blocks, partial, nw, pw = _inputs(2, (4,), 16)
    with pytest.raises(ValueError, match="blocks"):
        interp.attn_res_mix(blocks[:, :3], partial, nw, pw, EPS)
    with pytest.raises(ValueError, match="proj_weight"):
        interp.attn_res_mix(blocks, partial, nw, pw[:, :8], EPS)


def test_cpu_dispatches_to_reference():
    inputs = _inputs(2, (3, 5), 24)
    assert torch.equal(attn_res_mix(*inputs, EPS), reference.attn_res_mix(*inputs, EPS))


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M", [1, 4, 8])
@pytest.mark.parametrize("D", [7168, 100])
@pytest.mark.parametrize("N", [1, 37, 4097])
def test_matches_reference_gpu(dtype, M, D, N):
    inputs = _inputs(M, (1, N), D, dtype, "cuda", contiguous=N != 37)
    grad = torch.randn(1, N, D, device="cuda")
    got = _fwd_bwd(attn_res_mix, inputs, grad)
    with use_backend("torch"):
        want = _fwd_bwd(attn_res_mix, inputs, grad)
    errs = _errors(got, want)
    print(f"\nattnres {str(dtype)[6:]} M={M} D={D} N={N}: rel err out/blocks/partial/norm_w/proj_w "
          + " ".join(f"{e:.1e}" for e in errs))
    assert got[0].dtype == dtype
    assert max(errs) < (1e-5 if dtype == torch.float32 else 1e-2), errs


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("M,N,D", [(8, 4097, 7168), (0, 37, 7168), (4, 5, 100)])
def test_writes_every_element_gpu(M, N, D):
    from kimik3.ops.attnres import triton as fast

    blocks, partial, nw, pw = (t.detach() for t in _inputs(M, (N,), D, torch.bfloat16, "cuda"))
    out, stats = fast.mix_forward(blocks, partial, nw, pw.reshape(-1), EPS,
                                  out=torch.full_like(partial, float("nan")))
    grad = torch.randn(N, D, device="cuda", dtype=torch.bfloat16)
    gb, gp, dw = fast.mix_backward(grad, blocks, partial, nw, pw.reshape(-1), stats,
                                   grad_blocks=torch.full_like(blocks, float("nan")),
                                   grad_partial=torch.full_like(partial, float("nan")))
    want = _fwd_bwd(reference.attn_res_mix, [blocks, partial, nw, pw], grad)
    assert rel_err(out, want[0]) < 1e-2 and rel_err(gp, want[2]) < 1e-2
    assert torch.isfinite(stats).all() and torch.isfinite(dw).all()
    if M:
        assert rel_err(gb, want[1]) < 1e-2


@pytest.mark.gpu
@gpu
def test_dispatch_follows_backend_gpu():
    inputs = _inputs(2, (3, 5), 128, torch.bfloat16, "cuda")
    assert type(attn_res_mix(*inputs, EPS).grad_fn).__name__ == "_AttnResMixBackward"
    with use_backend("torch"):
        assert torch.equal(attn_res_mix(*inputs, EPS), reference.attn_res_mix(*inputs, EPS))


@pytest.mark.gpu
@gpu
def test_same_result_every_run_gpu():
    """Deterministic: no atomics, a fixed row-to-program assignment for the d w partial sums."""
    inputs = _inputs(8, (2, 2048), 7168, torch.bfloat16, "cuda")
    grad = torch.randn(2, 2048, 7168, device="cuda")
    first = _fwd_bwd(attn_res_mix, inputs, grad)
    second = _fwd_bwd(attn_res_mix, inputs, grad)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
