"""The SiTU-GLU Triton kernels against the reference, forward and backward.

CPU: under Triton's interpreter (TRITON_INTERPRET=1, set here before triton is imported) when triton is
installed, else skipped. GPU (`-m gpu`): the CUDA kernels, and the public op's dispatch.
"""

import importlib.util

import pytest
import torch

from kimik3.ops import situ
from kimik3.ops.backend import use_backend
from kimik3.ops.situ import reference
from tests.helpers import interpret_triton, rel_err

HAS_TRITON = importlib.util.find_spec("triton") is not None
if HAS_TRITON and not torch.cuda.is_available():
    assert interpret_triton(), "Triton's interpreter must be on before triton is imported (tests/conftest.py)"

BETA, LINEAR_BETA = 4.0, 25.0
needs_interpreter = pytest.mark.skipif(not HAS_TRITON or torch.cuda.is_available(),
                                       reason="needs triton (CPU: run under Triton's interpreter)")


def inputs(shape, dtype, device="cpu", seed=0):
    """Gate and up values across SiTU's regimes: near 0 (tanh's series branch), O(1), and saturating."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.tensor([0.01, 1.0, 8.0, 60.0])[torch.randint(0, 4, shape, generator=gen)]
    g, u = (torch.randn(*shape, generator=gen) * scale for _ in range(2))
    return g.to(device, dtype), u.to(device, dtype)


def both(gate, up, d_out):
    """(out, d gate, d up) of the fast kernels and of the reference on the same inputs."""
    from kimik3.ops.situ import triton as fast

    runs = []
    for fn in (fast.situ_glu, reference.situ_glu):
        g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
        out = fn(g, u, BETA, LINEAR_BETA)
        out.backward(d_out)
        runs.append((out.detach(), g.grad, u.grad))
    return runs


def check(runs, dtype):
    (out, dg, du), (out_r, dg_r, du_r) = runs
    assert out.dtype == dtype and dg.dtype == dtype and du.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: the two round different fp32 values to 8 bits
    errors = [rel_err(a, b) for a, b in ((out, out_r), (dg, dg_r), (du, du_r))]
    print(f"situ {dtype}: out {errors[0]:.1e} d gate {errors[1]:.1e} d up {errors[2]:.1e}")
    assert max(errors) < tol, errors


@needs_interpreter
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # numpy's exp(-g) at g << 0: sigmoid -> 0
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 1000), (4097,), (2, 5, 7)])  # a partial block, one past a block
def test_interpreted_matches_reference(dtype, shape):
    gate, up = inputs(shape, dtype)
    check(both(gate, up, torch.randn(shape).to(dtype)), dtype)


@needs_interpreter
def test_interpreted_edge_cases():
    from kimik3.ops.situ import triton as fast

    empty = torch.empty(0, 8)
    assert fast.situ_glu(empty, empty, BETA, LINEAR_BETA).shape == (0, 8)
    with pytest.raises(ValueError, match="gate and up must match"):
        fast.situ_glu(torch.zeros(2, 3), torch.zeros(3, 2), BETA, LINEAR_BETA)
    gate, up = inputs((4, 6), torch.float32)  # non-contiguous views are read correctly
    out = fast.situ_glu(gate.t(), up.t(), BETA, LINEAR_BETA)
    assert rel_err(out, reference.situ_glu(gate.t(), up.t(), BETA, LINEAR_BETA)) < 1e-6


def test_cpu_dispatches_to_reference():
    gate, up = inputs((5, 9), torch.float32)
    assert torch.equal(situ.situ_glu(gate, up, BETA, LINEAR_BETA), reference.situ_glu(gate, up, BETA, LINEAR_BETA))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(8192, 3072), (3, 1000), (1, 1)])
def test_matches_reference_gpu(dtype, shape):
    gate, up = inputs(shape, dtype, "cuda")
    check(both(gate, up, torch.randn(shape, device="cuda").to(dtype)), dtype)


@pytest.mark.gpu
def test_dispatch_follows_backend_gpu():
    gate, up = inputs((64, 128), torch.bfloat16, "cuda")
    with use_backend("torch"):
        ref = situ.situ_glu(gate, up, BETA, LINEAR_BETA)
    fast = situ.situ_glu(gate, up, BETA, LINEAR_BETA)
    assert fast.grad_fn is None  # no grad needed: plain tensors either way
    g = gate.clone().requires_grad_()
    assert type(situ.situ_glu(g, up, BETA, LINEAR_BETA).grad_fn).__name__ == "_SituGLUBackward"
    assert rel_err(fast, ref) < 1e-2
