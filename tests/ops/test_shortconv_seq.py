"""KDA's short convolution over whole sequences (`kimik3.ops.shortconv.short_conv`: prefill and training): the
reference against an independent float64 convolution, the Triton kernels (forward and backward) against the
reference.

CPU: the kernels under Triton's interpreter (switched on in tests/conftest.py) when triton is installed, else
skipped. GPU (`-m gpu`): the CUDA kernels at K3's width, packed documents included, and the dispatch. Bounds (see
`kimik3.ops.shortconv.triton`): the pre-activation is the reference's to the bit, silu's exp may differ by an ulp:
outputs within 1e-6 relative in fp32 and one bf16 ulp in bf16; the gradients sum in another order: 1e-5 in fp32,
one bf16 ulp for d x in bf16.
"""

import pytest
import torch
import torch.nn.functional as F

from kimik3.model.kda import ShortConvolution
from kimik3.ops import shortconv
from kimik3.ops.backend import use_backend
from kimik3.ops.shortconv import reference
from tests.helpers import needs_interpreter, rel_err, requires_cuda

W = 4
TOL = {torch.float32: 1e-6, torch.bfloat16: 2**-7}
GRAD_TOL = {torch.float32: 1e-5, torch.bfloat16: 2**-7}


def inputs(B, T, P, dtype, device="cpu", seed=0):
    """x [B, T, P], weight [P, W] fp32 (ShortConvolution's init range), d out [B, T, P]."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, P, generator=gen).to(device, dtype)
    weight = ((torch.rand(P, W, generator=gen) * 2 - 1) * W**-0.5).to(device)
    dy = torch.randn(B, T, P, generator=gen).to(device, dtype)
    return x, weight, dy


def float64_truth(x, weight, cu_seqlens):
    """Each document convolved on its own (zero left padding), in float64, by `F.conv1d`."""
    x, w = x.double(), weight.double()
    bounds = [0, x.shape[1]] if cu_seqlens is None else cu_seqlens.tolist()
    outs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        seg = x[:, a:b].transpose(1, 2)  # [B, P, t]
        y = F.conv1d(F.pad(seg, (W - 1, 0)), w[:, None], groups=w.shape[0])
        outs.append(F.silu(y).transpose(1, 2))
    return torch.cat(outs, dim=1)


def run(fn, x, weight, dy, cu_seqlens):
    """(out, d x, d weight) of `fn`."""
    x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
    out = fn(x, weight, cu_seqlens)
    out.backward(dy)
    return out.detach(), x.grad, weight.grad


CASES = [  # (B, T, P, cu_seqlens)
    (1, 37, 200, None),
    (2, 45, 128, None),
    (1, 3, 130, None),  # T < W: fewer taps than the window
    (1, 70, 150, [0, 5, 6, 40, 70]),  # packed documents, one of a single token
]


@pytest.mark.parametrize("B, T, P, cu", CASES)
def test_reference_matches_float64_convolution(B, T, P, cu):
    x, weight, _ = inputs(B, T, P, torch.float32, seed=T)
    cu_seqlens = None if cu is None else torch.tensor(cu)
    got = reference.short_conv(x, weight, cu_seqlens)
    assert rel_err(got, float64_truth(x, weight, cu_seqlens)) < 1e-6
    mod = ShortConvolution(P, W)
    with torch.no_grad():
        mod.weight.copy_(weight[:, None])
    assert torch.equal(mod(x, cu_seqlens), got)  # the model's convolution is this op


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B, T, P, cu", CASES)
def test_interpreted_matches_reference(dtype, B, T, P, cu):
    from kimik3.ops.shortconv import triton as fast

    x, weight, dy = inputs(B, T, P, dtype, seed=T + P)
    cu_seqlens = None if cu is None else torch.tensor(cu)
    out, dx, dw = run(fast.short_conv, x, weight, dy, cu_seqlens)
    ref_out, ref_dx, ref_dw = run(reference.short_conv, x, weight, dy, cu_seqlens)
    assert out.dtype == dx.dtype == dtype and dw.dtype == torch.float32 and dw.shape == weight.shape
    assert rel_err(out, ref_out) <= TOL[dtype]
    assert rel_err(dx, ref_dx) <= GRAD_TOL[dtype]
    assert rel_err(dw, ref_dw) <= GRAD_TOL[torch.float32]  # fp32 in both cases


@needs_interpreter
def test_interpreted_rejects_bad_shapes():
    from kimik3.ops.shortconv import triton as fast

    x, weight, _ = inputs(2, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="cu_seqlens needs packed rows"):
        fast.short_conv(x, weight, torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="expected x"):
        fast.short_conv(x, weight[:8])


def test_cpu_dispatches_to_reference():
    x, weight, _ = inputs(1, 9, 32, torch.float32)
    assert torch.equal(shortconv.short_conv(x, weight), reference.short_conv(x, weight))


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cu", [None, [0, 100, 101, 1500, 2048]])
def test_gpu_matches_reference(dtype, cu):
    """K3's KDA width (96 heads x 128), 2,048 tokens, the fused kernels against the reference on the GPU."""
    x, weight, dy = inputs(1, 2048, 12288, dtype, device="cuda", seed=3)
    cu_seqlens = None if cu is None else torch.tensor(cu, device="cuda")
    out, dx, dw = run(shortconv.short_conv, x, weight, dy, cu_seqlens)
    with use_backend("torch"):
        ref_out, ref_dx, ref_dw = run(shortconv.short_conv, x, weight, dy, cu_seqlens)
    assert rel_err(out, ref_out) <= TOL[dtype]
    assert rel_err(dx, ref_dx) <= GRAD_TOL[dtype]
    assert rel_err(dw, ref_dw) <= GRAD_TOL[torch.float32]  # fp32 in both cases


def gathered_case(T, P, dtype, device="cpu", seed=0):
    """ext [X, P] = T new rows then one sequence's W-1 cached tail rows, and the index [W, T] that makes
    `gathered_short_conv` the convolution of the tail-extended row; also that row [1, W-1+T, P]."""
    gen = torch.Generator().manual_seed(seed)
    new, tail = torch.randn(T, P, generator=gen), torch.randn(W - 1, P, generator=gen)
    ext = torch.cat([new, tail]).to(device, dtype)
    full = torch.cat([tail, new])[None].to(device, dtype)
    # tap j of output t reads full[t + j], which is tail row t + j (< W-1) or new row t + j - (W-1)
    f = torch.arange(T)[None] + torch.arange(W)[:, None]
    index = torch.where(f < W - 1, T + f, f - (W - 1)).to(device)
    weight = ((torch.rand(P, W, generator=gen) * 2 - 1) * W**-0.5).to(device)
    return ext, index, weight, full


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gathered_reference_is_the_extended_row_bitwise(dtype):
    ext, index, weight, full = gathered_case(11, 40, dtype)
    want = reference.short_conv(full, weight)[0, W - 1:]
    assert torch.equal(reference.gathered_short_conv(ext, index, weight), want)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T, P", [(1, 128), (45, 200)])
def test_interpreted_gathered_matches_reference(dtype, T, P):
    from kimik3.ops.shortconv import triton as fast

    ext, index, weight, _ = gathered_case(T, P, dtype, seed=T)
    got = fast.gathered_short_conv(ext, index, weight)
    assert got.dtype == dtype and got.shape == (T, P)
    assert rel_err(got, reference.gathered_short_conv(ext, index, weight)) <= TOL[dtype]


def test_gathered_with_autograd_takes_the_reference():
    ext, index, weight, _ = gathered_case(6, 32, torch.float32)
    weight.requires_grad_()
    out = shortconv.gathered_short_conv(ext, index, weight)
    assert out.grad_fn is not None and torch.equal(out, reference.gathered_short_conv(ext, index, weight))


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_gathered_matches_reference(dtype):
    ext, index, weight, _ = gathered_case(777, 12288, dtype, device="cuda", seed=5)
    got = shortconv.gathered_short_conv(ext, index, weight)
    with use_backend("torch"):
        want = shortconv.gathered_short_conv(ext, index, weight)
    assert rel_err(got, want) <= TOL[dtype]
