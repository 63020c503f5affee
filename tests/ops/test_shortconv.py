"""KDA's decode short convolution: the reference against the model's definition (`ShortConvolution.last` and the
tail update it replaced), the Triton kernel against the reference.

CPU: the kernel under Triton's interpreter (switched on in tests/conftest.py) when triton is installed, else
skipped. GPU (`-m gpu`): the CUDA kernel, eager and replayed from a CUDA graph, and the public op's dispatch.
Bounds (see `kimik3.ops.shortconv.triton`): the fp32 sum is the reference's to the bit (same order, no FMA), only
silu's exp may differ by an ulp: fp32 outputs within 1e-6 relative, bf16 within one bf16 ulp (2^-7); tails equal.
"""

import importlib.util

import pytest
import torch

from kimik3.model.kda import ShortConvolution
from kimik3.ops import shortconv
from kimik3.ops.backend import use_backend
from kimik3.ops.shortconv import reference
from tests.helpers import interpret_triton, rel_err, requires_cuda

HAS_TRITON = importlib.util.find_spec("triton") is not None
if HAS_TRITON and not torch.cuda.is_available():
    assert interpret_triton(), "Triton's interpreter must be on before triton is imported (tests/conftest.py)"

needs_interpreter = pytest.mark.skipif(not HAS_TRITON or torch.cuda.is_available(),
                                       reason="needs triton (CPU: run under Triton's interpreter)")
TOL = {torch.float32: 1e-6, torch.bfloat16: 2**-7}
W = 4


def inputs(N, S, P, dtype, device="cpu", seed=0):
    """x [N, P], tails [S, W-1, P], weight [P, W] fp32 (ShortConvolution's init range)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(N, P, generator=gen).to(device, dtype)
    tails = torch.randn(S, W - 1, P, generator=gen).to(device, dtype)
    weight = ((torch.rand(P, W, generator=gen) * 2 - 1) * W**-0.5).to(device)
    return x, tails, weight


def run(fn, x, tails, slots, weight):
    """(output, tails after) of `fn` on a copy of the tails."""
    tails = tails.clone()
    return fn(x, tails, slots, weight), tails


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_the_model_decode_bitwise(dtype):
    """Exactly what KDA's decode computed before the fused op: cat, tail update, `ShortConvolution.last`."""
    N, S, P = 5, 9, 1000
    x, tails, weight = inputs(N, S, P, dtype)
    slots = torch.tensor([7, 0, 3, 8, 5])
    mod = ShortConvolution(P, W)
    with torch.no_grad():
        mod.weight.copy_(weight[:, None])
    window = torch.cat([tails[slots], x[:, None]], dim=1)
    want_tails = tails.clone()
    want_tails[slots] = window[:, 1:]
    out, got_tails = run(reference.decode_short_conv, x, tails, slots, mod.weight.squeeze(1))
    assert out.dtype == dtype and out.shape == (N, P)
    assert torch.equal(out, mod.last(window)[:, 0].detach())
    assert torch.equal(got_tails, want_tails)
    untouched = torch.tensor([1, 2, 4, 6])
    assert torch.equal(got_tails[untouched], tails[untouched])


def test_cpu_dispatches_to_reference():
    x, tails, weight = inputs(3, 4, 64, torch.float32)
    slots = torch.tensor([2, 0, 3])
    (out, t), (ref, t_ref) = (run(fn, x, tails, slots, weight)
                              for fn in (shortconv.decode_short_conv, reference.decode_short_conv))
    assert torch.equal(out, ref) and torch.equal(t, t_ref)


def check(x, tails, slots, weight):
    from kimik3.ops.shortconv import triton as fast

    (out, t), (ref, t_ref) = (run(fn, x, tails, slots, weight)
                              for fn in (fast.decode_short_conv, reference.decode_short_conv))
    err = rel_err(out, ref)
    print(f"decode_short_conv {x.dtype} N={x.shape[0]} P={x.shape[1]}: {err:.1e}")
    assert out.dtype == x.dtype and err < TOL[x.dtype], err
    assert torch.equal(t, t_ref)  # moved rows and untouched slots alike


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N, slots", [(1, [2]), (5, [6, 0, 3, 2, 5])])  # distinct, out of order, gaps
@pytest.mark.parametrize("P", [256, 1000])  # one block, and a partial last block
def test_interpreted_matches_reference(dtype, N, slots, P):
    x, tails, weight = inputs(N, 7, P, dtype)
    check(x, tails, torch.tensor(slots), weight)


@needs_interpreter
def test_interpreted_edge_cases():
    from kimik3.ops.shortconv import triton as fast

    x, tails, weight = inputs(3, 4, 300, torch.float32)
    check(x[:, :150], tails[:, :, :150], torch.tensor([3, 1, 0]), weight[:150])  # row strides past P
    empty = fast.decode_short_conv(x[:0], tails, torch.zeros(0, dtype=torch.long), weight)
    assert empty.shape == (0, 300)
    with pytest.raises(ValueError, match="expected x"):
        fast.decode_short_conv(x, tails[:, :2], torch.tensor([0, 1, 2]), weight)
    with pytest.raises(ValueError, match="weight fp32"):
        fast.decode_short_conv(x, tails, torch.tensor([0, 1, 2]), weight.bfloat16())


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N", [1, 5, 64])
@pytest.mark.parametrize("P", [8192, 1000])  # K3's 64 heads x 128, and a partial block
def test_gpu_matches_reference(dtype, N, P):
    x, tails, weight = inputs(N, 2 * N + 3, P, dtype, "cuda")
    slots = torch.randperm(2 * N + 3, generator=torch.Generator().manual_seed(N))[:N].cuda()
    check(x, tails, slots, weight)


@pytest.mark.gpu
@requires_cuda
def test_gpu_graph_replay_matches_eager():
    """Captured once, replayed over new inputs and slots: the same outputs and tails as the reference."""
    N, S, P = 8, 20, 8192
    x, tails, weight = inputs(N, S, P, torch.bfloat16, "cuda")
    slots = torch.arange(N, device="cuda") * 2
    graph_tails = tails.clone()
    shortconv.decode_short_conv(x, graph_tails.clone(), slots, weight)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = shortconv.decode_short_conv(x, graph_tails, slots, weight)
    ref_tails = tails.clone()
    for step in range(3):
        new_x, _, _ = inputs(N, 1, P, torch.bfloat16, "cuda", seed=step + 1)
        x.copy_(new_x)
        slots.copy_(torch.randperm(S, generator=torch.Generator().manual_seed(step))[:N].cuda())
        graph.replay()
        with use_backend("torch"):
            ref = shortconv.decode_short_conv(x, ref_tails, slots, weight)
        assert rel_err(out, ref) < TOL[torch.bfloat16]
        assert torch.equal(graph_tails, ref_tails)


@pytest.mark.gpu
@requires_cuda
def test_gpu_dispatch_follows_backend():
    x, tails, weight = inputs(4, 6, 8192, torch.bfloat16, "cuda")
    slots = torch.tensor([5, 1, 0, 3], device="cuda")
    with use_backend("torch"):
        ref, t_ref = run(shortconv.decode_short_conv, x, tails, slots, weight)
    out, t = run(shortconv.decode_short_conv, x, tails, slots, weight)
    assert rel_err(out, ref) < TOL[torch.bfloat16] and torch.equal(t, t_ref)
