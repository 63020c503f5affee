"""The RMSNorm Triton kernels against the reference (`KimiRMSNorm`: fp32 norm, downcast, then the gain), forward
and backward.

CPU: under Triton's interpreter (tests/conftest.py switches it on before triton is imported) when triton is
installed, else skipped. GPU (`-m gpu`): the CUDA kernels at K3's widths, and the model's norms through them.
"""

import importlib.util

import pytest
import torch

from kimik3.ops.rmsnorm import reference
from tests.helpers import needs_cuda_triton as needs_cuda
from tests.helpers import needs_interpreter, rel_err

EPS = 1e-5


def both(x, w, dy):
    """(y, dx, dw) of the kernels and of the reference on the same inputs."""
    from kimik3.ops.rmsnorm import triton as fast

    runs = []
    for fn in (fast.rms_norm, reference.rms_norm):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(xx, ww, EPS)
        y.backward(dy.to(y.dtype))
        runs.append((y.detach(), xx.grad, ww.grad))
    return runs


def inputs(shape, x_dtype, w_dtype, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    scale = torch.tensor([1e-3, 1.0, 30.0])[torch.randint(0, 3, shape[:-1] + (1,), generator=gen)]  # row scales
    x = torch.randn(*shape, generator=gen) * scale
    w = 1 + 0.1 * torch.randn(shape[-1], generator=gen)
    dy = torch.randn(*shape, generator=gen)
    return x.to(device, x_dtype), w.to(device, w_dtype), dy.to(device)


def check(runs, out_dtype):
    (y, dx, dw), (y_r, dx_r, dw_r) = runs
    assert y.dtype == y_r.dtype == out_dtype and dx.dtype == dx_r.dtype and dw.dtype == dw_r.dtype
    # 16-bit: the kernels and torch sum the squares in different orders, so a value on a rounding boundary may
    # round the other way (one 8-bit ulp), and autograd rounds each dw product to bf16 where the kernels do not
    tol = 1e-5 if out_dtype == torch.float32 else 1e-2
    errors = {"y": rel_err(y, y_r), "dx": rel_err(dx, dx_r), "dw": rel_err(dw, dw_r)}
    print(f"rms_norm {out_dtype}: " + " ".join(f"{k} {v:.1e}" for k, v in errors.items()))
    assert max(errors.values()) < tol, errors


@needs_interpreter
@pytest.mark.parametrize("x_dtype,w_dtype,out_dtype", [
    (torch.float32, torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.float32, torch.float32),  # fp32 master weights under bf16 autocast
])
@pytest.mark.parametrize("shape", [(1, 512), (17, 1536), (2, 3, 7168)])  # 17 rows: two backward programs
def test_interpreted_matches_reference(shape, x_dtype, w_dtype, out_dtype):
    x, w, dy = inputs(shape, x_dtype, w_dtype, seed=shape[-1])
    check(both(x, w, dy), out_dtype)


@needs_interpreter
def test_zero_rows_and_bad_weight():
    from kimik3.ops.rmsnorm import triton as fast

    x = torch.zeros(0, 64, requires_grad=True)
    y = fast.rms_norm(x, torch.ones(64), EPS)
    y.sum().backward()
    assert y.shape == (0, 64) and x.grad.shape == (0, 64)
    with pytest.raises(ValueError, match="weight must be"):
        fast.rms_norm(torch.ones(2, 64), torch.ones(32), EPS)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("D", [512, 1536, 3584, 7168])
@pytest.mark.parametrize("rows", [1, 8192])
def test_cuda_matches_reference_gpu(D, rows):
    x, w, dy = inputs((rows, D), torch.bfloat16, torch.bfloat16, device="cuda", seed=D + rows)
    check(both(x, w, dy), torch.bfloat16)


def test_gated_reference_on_cpu_is_the_written_out_form():
    """`gated_rms_norm` off CUDA is the reference: rms(o) * weight * sigmoid(gate) in fp32, cast to o's dtype."""
    from kimik3.ops.rmsnorm import gated_rms_norm

    o, gate = torch.randn(3, 4, 128).bfloat16(), torch.randn(3, 4, 128).bfloat16()
    w = torch.rand(128) + 0.5
    of = o.float()
    want = (of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + EPS) * w * gate.float().sigmoid()).bfloat16()
    got = gated_rms_norm(o, gate, w, EPS)
    assert got.dtype == torch.bfloat16 and rel_err(got, want) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("fla") is None,
                    reason="needs CUDA and fla-core")
@pytest.mark.parametrize("rows", [1, 8192 * 96])  # decode, and a training step's T * H rows of KDA heads
def test_gated_cuda_matches_reference_gpu(rows):
    from kimik3.ops.backend import use_backend
    from kimik3.ops.rmsnorm import gated_rms_norm

    gen = torch.Generator(device="cuda").manual_seed(rows)
    o, gate, d_y = (torch.randn(rows, 128, device="cuda", generator=gen).bfloat16() for _ in range(3))
    w = torch.rand(128, device="cuda", generator=gen) + 0.5
    runs = []
    for backend in ("auto", "torch"):
        oo, gg, ww = (t.clone().requires_grad_() for t in (o, gate, w))
        with use_backend(backend):
            y = gated_rms_norm(oo, gg, ww, EPS)
        y.backward(d_y)
        runs.append((y.detach(), oo.grad, gg.grad, ww.grad))
    for a, b in zip(*runs):
        assert a.dtype == b.dtype and rel_err(a, b) < 1e-2
