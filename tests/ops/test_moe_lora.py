"""The LoRA routed-experts op over frozen MXFP4 experts: forward and gradients against dense autograd.

The oracle is `reference.routed_experts` on the merged dense weights W + s B A with autograd, fp32: dz and the
factors' gradients must agree to fp32 rounding (design.md section 3); with B = 0 the op is the packed reference
bit for bit. The base gets no gradient and no dense copy of an expert's weight is saved for backward.
"""

from __future__ import annotations

import pytest
import torch

from kimik3.ops.lora import LoraWeights
from kimik3.ops.lora.experts import packed_linear
from kimik3.ops.moe import PackedWeights, reference, routed_experts
from kimik3.ops.mxfp4 import decode
from tests.helpers import needs_cuda_triton, needs_interpreter, patch_interpreter_index, rel_err
from tests.ops.test_moe_fast import mx_experts, routing

BETA, LINEAR_BETA = 4.0, 25.0
N, A, E, L, F, R = 20, 3, 5, 64, 96, 4


def _factors(shared: dict[str, tuple[bool, bool]], gen, zero_b: bool = False):
    dims = {"w1": (F, L), "w3": (F, L), "w2": (L, F)}
    a, b = [], []
    for name, (out, inp) in dims.items():
        sa, sb = shared[name]
        a.append((torch.randn(1 if sa else E, R, inp, generator=gen) / inp ** 0.5).requires_grad_())
        bt = torch.zeros(1 if sb else E, out, R) if zero_b else torch.randn(1 if sb else E, out, R, generator=gen) * 0.1
        b.append(bt.requires_grad_())
    return tuple(a), tuple(b)


LAYOUTS = {"per_expert": dict.fromkeys(("w1", "w3", "w2"), (False, False)),
           "shared_outer": {"w1": (True, False), "w3": (True, False), "w2": (False, True)},
           "shared": dict.fromkeys(("w1", "w3", "w2"), (True, True)),
           # no kimik3 layout: w1's and w3's A differ in shape, so the grouped path cannot stack them
           "mixed": {"w1": (True, False), "w3": (False, True), "w2": (True, False)}}


def test_packed_linear_dx_matches_dense_autograd():
    gen = torch.Generator().manual_seed(0)
    packed, scales = mx_experts(1, L, F, gen)
    p, s = packed[0][0], scales[0][0]  # one expert's w1 [F, L]
    x = torch.randn(7, L, generator=gen, requires_grad=True)
    dy = torch.randn(7, F, generator=gen)
    y = packed_linear(x, p, s)
    (dx,) = torch.autograd.grad(y, x, dy)
    w = decode(p, s, torch.float32).requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    y2 = x2 @ w.T
    dx2, dw = torch.autograd.grad(y2, (x2, w), dy)
    assert torch.equal(y, y2)
    assert rel_err(dx, dx2) < 1e-5 and dw.abs().sum() > 0  # the dense path would train W; ours has no such output


def test_zero_b_is_the_packed_reference_bit_for_bit():
    gen = torch.Generator().manual_seed(1)
    z = torch.randn(N, L, generator=gen)
    idx, tw = routing(N, A, E, gen)
    packed, scales = mx_experts(E, L, F, gen)
    a, b = _factors(LAYOUTS["per_expert"], gen, zero_b=True)
    out = routed_experts(z, idx, tw, LoraWeights(PackedWeights(packed, scales), a, b, 2.0), BETA, LINEAR_BETA)
    assert torch.equal(out, reference.routed_experts_mxfp4(z, idx, tw, packed, scales, BETA, LINEAR_BETA))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_forward_and_gradients_match_dense_autograd(layout):
    gen = torch.Generator().manual_seed(2)
    z = torch.randn(N, L, generator=gen, requires_grad=True)
    idx, tw = routing(N, A, E, gen)
    packed, scales = mx_experts(E, L, F, gen)
    a, b = _factors(LAYOUTS[layout], gen)
    scale = 1.5
    dout = torch.randn(N, L, generator=gen)
    out = routed_experts(z, idx, tw, LoraWeights(PackedWeights(packed, scales), a, b, scale), BETA, LINEAR_BETA)
    grads = torch.autograd.grad(out, (z, *a, *b), dout)
    # the oracle: dense fp32 weights W + s B A, differentiable in z and the factors through plain autograd
    z2 = z.detach().clone().requires_grad_()
    a2 = [t.detach().clone().requires_grad_() for t in a]
    b2 = [t.detach().clone().requires_grad_() for t in b]
    w = [decode(p, s, torch.float32) + scale * torch.matmul(bb, aa).expand(E, -1, -1)
         for p, s, aa, bb in zip(packed, scales, a2, b2)]
    ref = reference.routed_experts(z2, idx, tw, *w, BETA, LINEAR_BETA)
    ref_grads = torch.autograd.grad(ref, (z2, *a2, *b2), dout)
    assert rel_err(out, ref) < 1e-5
    for name, g, r in zip(["z", "A1", "A3", "A2", "B1", "B3", "B2"], grads, ref_grads):
        assert torch.isfinite(g).all() and rel_err(g, r) < 1e-5, (layout, name, rel_err(g, r))


def test_backward_keeps_no_dense_expert_weight():
    """What autograd saves for backward: activations, the small factors and the uint8 codes, never a float tensor
    the size of an expert's weight (the packed experts are not copied to bf16/fp32 for the backward)."""
    gen = torch.Generator().manual_seed(3)
    z = torch.randn(N, L, generator=gen, requires_grad=True)
    idx, tw = routing(N, A, E, gen)
    packed, scales = mx_experts(E, L, F, gen)
    a, b = _factors(LAYOUTS["per_expert"], gen)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((t.dtype, tuple(t.shape))) or t, lambda t: t):
        out = routed_experts(z, idx, tw, LoraWeights(PackedWeights(packed, scales), a, b, 1.0), BETA, LINEAR_BETA)
    dense = [(d, s) for d, s in saved if d.is_floating_point and s[-2:] in ((F, L), (L, F))]
    assert not dense, dense
    assert any(d == torch.uint8 for d, _ in saved)  # the codes are what backward decodes again
    out.sum().backward()
    assert all(t.grad is None for t in (*packed, *scales))


def _lora_case(layout: str, seed: int, dtype: torch.dtype, device: str = "cpu", dims=(N, A, E, L, F), rank=8):
    n, a_, e, lat, f = dims
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(n, lat, generator=gen).to(device, dtype).requires_grad_()
    idx, tw = routing(n, a_, e, gen, device=device)
    packed, scales = mx_experts(e, lat, f, gen, device=device)
    fdims = {"w1": (f, lat), "w3": (f, lat), "w2": (lat, f)}
    fa, fb = [], []
    for name, (out, inp) in fdims.items():
        sa, sb = LAYOUTS[layout][name]
        fa.append((torch.randn(1 if sa else e, rank, inp, generator=gen) / inp ** 0.5).to(device).requires_grad_())
        fb.append((torch.randn(1 if sb else e, out, rank, generator=gen) * 0.1).to(device).requires_grad_())
    return z, idx, tw, packed, scales, tuple(fa), tuple(fb), torch.randn(n, lat, generator=gen).to(device)


def _dispatched(z, idx, tw, packed, scales, a, b, scale, beta, linear_beta):
    return routed_experts(z, idx, tw, LoraWeights(PackedWeights(packed, scales), a, b, scale), beta, linear_beta)


def _run(op, z, idx, tw, packed, scales, a, b, dout):
    out = op(z, idx, tw, packed, scales, a, b, 1.5, BETA, LINEAR_BETA)
    return out, torch.autograd.grad((out.float() * dout).sum(), (z, *a, *b))


@needs_interpreter
@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_grouped_lora_matches_the_reference_loop_interpreter(layout, chunked, monkeypatch):
    """The grouped path (grouped GEMMs on the CPU, the row kernels under Triton's interpreter) in fp32: forward and
    every gradient equal the per-expert loop to fp32 rounding, with the experts decoded whole or a chunk at a time."""
    from kimik3.ops.lora import experts as lora
    from kimik3.ops.lora import experts_grouped as lora_grouped

    patch_interpreter_index(monkeypatch)  # lowrank_add_ loops over the experts of its rows
    if chunked:  # two experts' decoded w1 per chunk: three chunks of 5 experts, one holding the empty expert 1
        monkeypatch.setattr(lora_grouped, "CHUNK_BYTES", 2 * F * L * 4)
    z, idx, tw, packed, scales, a, b, dout = _lora_case(layout, 4, torch.float32)
    out, grads = _run(lora_grouped.routed_experts_mxfp4_lora, z, idx, tw, packed, scales, a, b, dout)
    ref, ref_grads = _run(lora.routed_experts_mxfp4_lora, z, idx, tw, packed, scales, a, b, dout)
    assert rel_err(out, ref) < 1e-5
    for name, g, r in zip(["z", "A1", "A3", "A2", "B1", "B3", "B2"], grads, ref_grads):
        assert rel_err(g, r) < 1e-5, (layout, name, rel_err(g, r))


@pytest.mark.gpu
@needs_cuda_triton
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_grouped_lora_matches_the_reference_loop_gpu(layout):
    """On CUDA in bf16 the dispatcher takes the grouped path; against the per-expert loop (bf16, the reference ops)
    at K3's widths: bf16-level agreement of the output and every gradient, and no float copy of the experts kept
    for backward."""
    from kimik3.ops.backend import use_backend

    case = _lora_case(layout, 5, torch.bfloat16, "cuda", dims=(64, 16, 32, 3584, 3072), rank=16)
    z, idx, tw, packed, scales, a, b, dout = case
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        out, grads = _run(_dispatched, *case[:-1], dout)
    assert not [s for s in saved if tuple(s[-2:]) in ((3072, 3584), (3584, 3072))]
    with use_backend("torch"):
        ref, ref_grads = _run(_dispatched, *case[:-1], dout)
    assert rel_err(out, ref) < 1e-2
    for name, g, r in zip(["z", "A1", "A3", "A2", "B1", "B3", "B2"], grads, ref_grads):
        assert rel_err(g, r) < 1e-2, (layout, name, rel_err(g, r))


def _lowrank_case(dtype, device, shared: bool, K: int, gen):
    M, N, E_ = 300, 200, 7
    e_M = torch.sort(torch.randint(0, E_, (M,), generator=gen)).values
    e_M[e_M == 3] = 4  # an expert with no rows
    c = torch.randn(M, N, generator=gen).to(device, dtype)
    t = torch.randn(M, K, generator=gen).to(device, dtype)
    f = torch.randn(1 if shared else E_, N, K, generator=gen).to(device, dtype).transpose(-2, -1)  # strided, as B^T
    return c, t, f, e_M.to(device)


@needs_interpreter
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("K", [8, 16, 32])
def test_lowrank_add_matches_its_reference_interpreter(shared, K, monkeypatch):
    """`lora_grouped.lowrank_add_` (the rank-R GEMM with its add fused, in place) under Triton's interpreter in fp32:
    the per-expert loop's value to fp32 rounding, for per-expert and shared factors, ranks below and above 16."""
    from kimik3.ops.lora import experts_grouped as lora_grouped

    patch_interpreter_index(monkeypatch)

    c, t, f, e_M = _lowrank_case(torch.float32, "cpu", shared, K, torch.Generator().manual_seed(6))
    ref = lora_grouped.lowrank_add_reference(c, t, f, e_M)
    out = lora_grouped.lowrank_add_(c, t, f, e_M)
    assert out is c and rel_err(out, ref) < 1e-6


@pytest.mark.gpu
@needs_cuda_triton
@pytest.mark.parametrize("shared", [False, True])
def test_lowrank_add_matches_its_reference_gpu(shared):
    """The same on CUDA in bf16 and fp32: fp32 sums rounded once, as the reference loop."""
    from kimik3.ops.lora import experts_grouped as lora_grouped

    for dtype, tol in ((torch.bfloat16, 1e-2), (torch.float32, 1e-6)):
        c, t, f, e_M = _lowrank_case(dtype, "cuda", shared, 32, torch.Generator().manual_seed(7))
        ref = lora_grouped.lowrank_add_reference(c, t, f, e_M)
        out = lora_grouped.lowrank_add_(c, t, f, e_M)
        assert rel_err(out.float(), ref.float()) < tol, (dtype, rel_err(out.float(), ref.float()))
