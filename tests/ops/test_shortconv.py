"""KDA's short convolution, in one place: the module against its definition (loops, float64), the sequence op
(`kimik3.ops.shortconv.short_conv`: prefill and training) and its gathered form, and the decode op (one new token
against each slot's cached tail), each reference against an independent truth and each Triton kernel against its
reference.

CPU: the kernels under Triton's interpreter (switched on in tests/conftest.py) when triton is installed, else
skipped. GPU (`-m gpu`, the tests named `_gpu`): the CUDA kernels at K3's width, packed documents included, a decode
replayed from a CUDA graph, and the dispatch. Bounds (see `kimik3.ops.shortconv.triton`): the pre-activation is the
reference's to the bit (same order, no FMA), only silu's exp may differ by an ulp: outputs within 1e-6 relative in
fp32 and one bf16 ulp (2^-7) in bf16; the gradients sum in another order: 1e-5 in fp32, one bf16 ulp for d x in bf16;
decode tails equal.
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


def definition(weight, x, starts):
    """y[t, c] = silu(sum_j w[c, j] x[t - (W-1) + j, c]) over the token's own document, by loops (fp64)."""
    W, (B, T, P) = weight.shape[-1], x.shape
    y = torch.zeros(B, T, P, dtype=torch.float64)
    for t in range(T):
        start = max(s for s in starts if s <= t)
        for j in range(W):
            src = t - (W - 1) + j
            if src >= start:
                y[:, t] += weight[:, 0, j].double() * x[:, src].double()
    return torch.nn.functional.silu(y)


def module(P=6, W=W, seed=0):
    torch.manual_seed(seed)
    m = ShortConvolution(P, W)
    torch.nn.init.normal_(m.weight)
    return m


def test_module_matches_its_definition_with_and_without_documents():
    m = module()
    x = torch.randn(2, 11, 6)
    assert rel_err(m(x), definition(m.weight, x, [0])) < 1e-6
    cu = torch.tensor([0, 1, 4, 9, 11])
    assert rel_err(m(x[:1], cu), definition(m.weight, x[:1], cu.tolist())) < 1e-6
    assert rel_err(m(x[:, :2]), definition(m.weight, x[:, :2], [0])) < 1e-6  # shorter than the window


def last(weight_P1W, window_BWP):
    """The output at the newest of W consecutive tokens, written out over the window [B, W, P] -> [B, 1, P]: the form
    KDA's decode computed before it was one fused op (the decode reference's oracle below)."""
    y_BP = (window_BWP.float() * weight_P1W.float().squeeze(1).T).sum(1)
    return F.silu(y_BP)[:, None].to(window_BWP.dtype)


def test_last_is_the_newest_output_of_the_window():
    m = module()
    x = torch.randn(3, 4, 6)
    with torch.no_grad():
        assert rel_err(last(m.weight, x), m(x)[:, -1:]) < 1e-6
        assert last(m.weight, x.bfloat16()).dtype == torch.bfloat16


def test_module_gradients_match_the_definition():
    m = module(P=3)
    x = torch.randn(1, 9, 3, requires_grad=True)
    cu = torch.tensor([0, 4, 9])
    go = torch.randn(1, 9, 3)
    gx, gw = torch.autograd.grad(m(x, cu), (x, m.weight), go)
    x64, w64 = x.detach().double().requires_grad_(), m.weight.detach().double().requires_grad_()
    rx, rw = torch.autograd.grad(definition(w64, x64, [0, 4]), (x64, w64), go.double())
    assert rel_err(gx, rx) < 1e-5 and rel_err(gw, rw) < 1e-5


def seq_inputs(B, T, P, dtype, device="cpu", seed=0):
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


def run_seq(fn, x, weight, dy, cu_seqlens):
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
def test_seq_reference_matches_float64_convolution(B, T, P, cu):
    x, weight, _ = seq_inputs(B, T, P, torch.float32, seed=T)
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
def test_seq_interpreted_matches_reference(dtype, B, T, P, cu):
    from kimik3.ops.shortconv import triton as fast

    x, weight, dy = seq_inputs(B, T, P, dtype, seed=T + P)
    cu_seqlens = None if cu is None else torch.tensor(cu)
    out, dx, dw = run_seq(fast.short_conv, x, weight, dy, cu_seqlens)
    ref_out, ref_dx, ref_dw = run_seq(reference.short_conv, x, weight, dy, cu_seqlens)
    assert out.dtype == dx.dtype == dtype and dw.dtype == torch.float32 and dw.shape == weight.shape
    assert rel_err(out, ref_out) <= TOL[dtype]
    assert rel_err(dx, ref_dx) <= GRAD_TOL[dtype]
    assert rel_err(dw, ref_dw) <= GRAD_TOL[torch.float32]  # fp32 in both cases


@needs_interpreter
def test_seq_interpreted_rejects_bad_shapes():
    from kimik3.ops.shortconv import triton as fast

    x, weight, _ = seq_inputs(2, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="cu_seqlens needs packed rows"):
        fast.short_conv(x, weight, torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="expected x"):
        fast.short_conv(x, weight[:8])


def test_seq_dispatches_to_reference_on_the_cpu():
    x, weight, _ = seq_inputs(1, 9, 32, torch.float32)
    assert torch.equal(shortconv.short_conv(x, weight), reference.short_conv(x, weight))


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cu", [None, [0, 100, 101, 1500, 2048]])
def test_seq_matches_reference_gpu(dtype, cu):
    """K3's KDA width (96 heads x 128), 2,048 tokens, the fused kernels against the reference on the GPU."""
    x, weight, dy = seq_inputs(1, 2048, 12288, dtype, device="cuda", seed=3)
    cu_seqlens = None if cu is None else torch.tensor(cu, device="cuda")
    out, dx, dw = run_seq(shortconv.short_conv, x, weight, dy, cu_seqlens)
    with use_backend("torch"):
        ref_out, ref_dx, ref_dw = run_seq(shortconv.short_conv, x, weight, dy, cu_seqlens)
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
def test_gathered_matches_reference_gpu(dtype):
    ext, index, weight, _ = gathered_case(777, 12288, dtype, device="cuda", seed=5)
    got = shortconv.gathered_short_conv(ext, index, weight)
    with use_backend("torch"):
        want = shortconv.gathered_short_conv(ext, index, weight)
    assert rel_err(got, want) <= TOL[dtype]


def decode_inputs(N, S, P, dtype, device="cpu", seed=0):
    """x [N, P], tails [S, W-1, P], weight [P, W] fp32 (ShortConvolution's init range)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(N, P, generator=gen).to(device, dtype)
    tails = torch.randn(S, W - 1, P, generator=gen).to(device, dtype)
    weight = ((torch.rand(P, W, generator=gen) * 2 - 1) * W**-0.5).to(device)
    return x, tails, weight


def test_a_decode_row_is_its_prefill_row_in_bf16():
    """Enough bf16 rows that a different summation order shows (summed oldest tap first, 4 of these 131,072 outputs
    differ): the decode op sums as `short_conv` does, so speculative greedy equals plain greedy."""
    x, tails, weight = decode_inputs(32, 40, 4096, torch.bfloat16)
    slots = torch.randperm(40, generator=torch.Generator().manual_seed(1))[:32]
    window = torch.cat([tails[slots], x[:, None]], dim=1)
    out, _ = run_decode(reference.decode_short_conv, x, tails, slots, weight)
    assert torch.equal(out, reference.short_conv(window, weight)[:, -1])


def run_decode(fn, x, tails, slots, weight):
    """(output, tails after) of `fn` on a copy of the tails."""
    tails = tails.clone()
    return fn(x, tails, slots, weight), tails


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_reference_is_the_prefill_row_bitwise(dtype):
    """A decode row is bit for bit the same token's row of `short_conv` over its window (the newest tap summed
    first, as prefill and verification steps sum; summed oldest first, as `last` does, bf16 rows differ and
    speculation changed greedy tokens), and the tails move on as cat + shift would move them."""
    N, S, P = 5, 9, 1000
    x, tails, weight = decode_inputs(N, S, P, dtype)
    slots = torch.tensor([7, 0, 3, 8, 5])
    mod = ShortConvolution(P, W)
    with torch.no_grad():
        mod.weight.copy_(weight[:, None])
    window = torch.cat([tails[slots], x[:, None]], dim=1)
    want_tails = tails.clone()
    want_tails[slots] = window[:, 1:]
    out, got_tails = run_decode(reference.decode_short_conv, x, tails, slots, mod.weight.squeeze(1))
    assert out.dtype == dtype and out.shape == (N, P)
    prefill = reference.short_conv(window, weight)[:, -1]
    # in fp32 torch's vectorized silu and its scalar tail loop can differ in the last bit, by a row's lane
    assert torch.equal(out, prefill) if dtype == torch.bfloat16 else rel_err(out, prefill) < 1e-6
    assert rel_err(out, last(mod.weight, window)[:, 0].detach()) < (1e-6 if dtype == torch.float32 else 1e-2)
    assert torch.equal(got_tails, want_tails)
    untouched = torch.tensor([1, 2, 4, 6])
    assert torch.equal(got_tails[untouched], tails[untouched])


def test_decode_dispatches_to_reference_on_the_cpu():
    x, tails, weight = decode_inputs(3, 4, 64, torch.float32)
    slots = torch.tensor([2, 0, 3])
    (out, t), (ref, t_ref) = (run_decode(fn, x, tails, slots, weight)
                              for fn in (shortconv.decode_short_conv, reference.decode_short_conv))
    assert torch.equal(out, ref) and torch.equal(t, t_ref)


def check_decode(x, tails, slots, weight):
    from kimik3.ops.shortconv import triton as fast

    (out, t), (ref, t_ref) = (run_decode(fn, x, tails, slots, weight)
                              for fn in (fast.decode_short_conv, reference.decode_short_conv))
    err = rel_err(out, ref)
    print(f"decode_short_conv {x.dtype} N={x.shape[0]} P={x.shape[1]}: {err:.1e}")
    assert out.dtype == x.dtype and err < TOL[x.dtype], err
    assert torch.equal(t, t_ref)  # moved rows and untouched slots alike


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N, slots", [(1, [2]), (5, [6, 0, 3, 2, 5])])  # distinct, out of order, gaps
@pytest.mark.parametrize("P", [256, 1000])  # one block, and a partial last block
def test_decode_interpreted_matches_reference(dtype, N, slots, P):
    x, tails, weight = decode_inputs(N, 7, P, dtype)
    check_decode(x, tails, torch.tensor(slots), weight)


@needs_interpreter
def test_decode_interpreted_edge_cases():
    from kimik3.ops.shortconv import triton as fast

    x, tails, weight = decode_inputs(3, 4, 300, torch.float32)
    check_decode(x[:, :150], tails[:, :, :150], torch.tensor([3, 1, 0]), weight[:150])  # row strides past P
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
def test_decode_matches_reference_gpu(dtype, N, P):
    x, tails, weight = decode_inputs(N, 2 * N + 3, P, dtype, "cuda")
    slots = torch.randperm(2 * N + 3, generator=torch.Generator().manual_seed(N))[:N].cuda()
    check_decode(x, tails, slots, weight)


@pytest.mark.gpu
@requires_cuda
def test_decode_graph_replay_matches_eager_gpu():
    """Captured once, replayed over new inputs and slots: the same outputs and tails as the reference."""
    N, S, P = 8, 20, 8192
    x, tails, weight = decode_inputs(N, S, P, torch.bfloat16, "cuda")
    slots = torch.arange(N, device="cuda") * 2
    graph_tails = tails.clone()
    shortconv.decode_short_conv(x, graph_tails.clone(), slots, weight)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = shortconv.decode_short_conv(x, graph_tails, slots, weight)
    ref_tails = tails.clone()
    for step in range(3):
        new_x, _, _ = decode_inputs(N, 1, P, torch.bfloat16, "cuda", seed=step + 1)
        x.copy_(new_x)
        slots.copy_(torch.randperm(S, generator=torch.Generator().manual_seed(step))[:N].cuda())
        graph.replay()
        with use_backend("torch"):
            ref = shortconv.decode_short_conv(x, ref_tails, slots, weight)
        assert rel_err(out, ref) < TOL[torch.bfloat16]
        assert torch.equal(graph_tails, ref_tails)


@pytest.mark.gpu
@requires_cuda
def test_decode_dispatch_follows_backend_gpu():
    x, tails, weight = decode_inputs(4, 6, 8192, torch.bfloat16, "cuda")
    slots = torch.tensor([5, 1, 0, 3], device="cuda")
    with use_backend("torch"):
        ref, t_ref = run_decode(shortconv.decode_short_conv, x, tails, slots, weight)
    out, t = run_decode(shortconv.decode_short_conv, x, tails, slots, weight)
    assert rel_err(out, ref) < TOL[torch.bfloat16] and torch.equal(t, t_ref)
