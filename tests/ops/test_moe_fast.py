"""Fast routed-expert paths against the per-expert reference loop.

CPU: the bf16 grouped-GEMM path (torch._grouped_mm runs on CPU since torch 2.8), forward and gradients; the
Triton MXFP4 kernels under Triton's interpreter (TRITON_INTERPRET=1, set here before triton is imported) when
triton is installed, else skipped. GPU (`-m gpu`): both paths at K3's latent dims, the bf16 decode bit for bit.
"""

import importlib.util

import pytest
import torch

from kimik3.ops import moe
from kimik3.ops.backend import use_backend
from kimik3.ops.moe import grouped, reference
from kimik3.ops.mxfp4 import decode, encode
from tests.helpers import interpret_triton, rel_err

HAS_TRITON = importlib.util.find_spec("triton") is not None
if HAS_TRITON and not torch.cuda.is_available():
    assert interpret_triton(), "Triton's interpreter must be on before triton is imported (tests/conftest.py)"

BETA, LINEAR_BETA = 4.0, 25.0
K3_DIMS = dict(E=32, L=3584, F=3072)  # latent width and expert width of K3, fewer experts
TINY_DIMS = dict(E=24, L=96, F=160)




def routing(N, A, E, gen, device="cpu", empty=(1,)):
    """Distinct experts per token, random weights; experts in `empty` receive no token."""
    scores = torch.rand(N, E, generator=gen)
    scores[:, list(empty)] = -1.0
    idx = scores.topk(A, dim=1).indices
    w = torch.rand(N, A, generator=gen) + 0.1
    return idx.to(device), (w / w.sum(1, keepdim=True)).to(device)


def mx_experts(E, L, F, gen, device="cpu"):
    """(packed, scales) of random normal experts at unit-gain scale, encoded on `device`."""
    packed, scales = [], []
    for shape in ((E, F, L), (E, F, L), (E, L, F)):
        w = torch.randn(*shape, generator=gen).to(device) / shape[-1] ** 0.5
        p, s = encode(w)
        packed.append(p)
        scales.append(s)
    return tuple(packed), tuple(scales)


def poison_allocator(device, nbytes):
    """Fill freed cached blocks with NaN so that an op's `torch.empty` outputs start poisoned."""
    torch.full((nbytes // 4,), float("nan"), device=device).fill_(float("nan"))
    torch.cuda.synchronize()



@pytest.mark.parametrize("N,A", [(1, 2), (9, 3), (40, 4)])
def test_grouped_matches_reference_cpu(N, A):
    gen = torch.Generator().manual_seed(N)
    E, L, F = 6, 64, 96
    z = torch.randn(N, L, generator=gen).bfloat16().requires_grad_()
    idx, tw = routing(N, A, E, gen)
    tw.requires_grad_()
    ws = [(torch.randn(*s, generator=gen) / s[-1] ** 0.5).bfloat16().requires_grad_()
          for s in ((E, F, L), (E, F, L), (E, L, F))]
    dout = torch.randn(N, L, generator=gen)

    def run(fn):
        out = fn(z, idx, tw, *ws, BETA, LINEAR_BETA)
        grads = torch.autograd.grad((out.float() * dout).sum(), [z, tw, *ws])
        return out, grads

    out, grads = run(grouped.routed_experts)
    ref, ref_grads = run(reference.routed_experts)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, ref) < 1e-2
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) < 2e-2
    assert (grads[2][1] == 0).all()  # expert 1 received no token


def test_dispatch_cpu_is_reference():
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(5, 64, generator=gen)
    idx, tw = routing(5, 2, 4, gen)
    packed, scales = mx_experts(4, 64, 96, gen)
    out = moe.routed_experts(z, idx, tw, moe.PackedWeights(packed, scales), BETA, LINEAR_BETA)
    ref = reference.routed_experts_mxfp4(z, idx, tw, packed, scales, BETA, LINEAR_BETA)
    assert torch.equal(out, ref)



needs_interpreter = pytest.mark.skipif(not HAS_TRITON or torch.cuda.is_available(),
                                       reason="needs triton (CPU: run under Triton's interpreter)")

CONFIGS = {  # (BM, BN, BK, SWAP, num_warps, num_stages), small enough for the interpreter's dims
    "bm16": (16, 32, 64, False, 4, 2),
    "bm16-swap": (16, 32, 64, True, 4, 2),
    "bm32": (32, 64, 32, False, 4, 2),
}


@needs_interpreter
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("N,A,E,L,F", [(3, 2, 5, 64, 96), (20, 4, 6, 96, 160), (1, 1, 3, 32, 32)])
def test_triton_mxfp4_interpreter(config, N, A, E, L, F):
    from kimik3.ops.moe import triton_mxfp4

    gen = torch.Generator().manual_seed(N * 7 + E)
    z = torch.randn(N, L, generator=gen).bfloat16()
    idx, tw = routing(N, A, E, gen)
    packed, scales = mx_experts(E, L, F, gen)
    c = CONFIGS[config]
    out = triton_mxfp4.routed_experts_mxfp4(z, idx, tw, packed, scales, BETA, LINEAR_BETA, configs=(c, c))
    ref = reference.routed_experts_mxfp4(z, idx, tw, packed, scales, BETA, LINEAR_BETA)
    # the interpreter multiplies the (exactly decoded) bf16 values in fp32, as the CPU reference does
    assert rel_err(out, ref) < 1e-3


@needs_interpreter
def test_triton_mxfp4_interpreter_fp16_and_many_rows_per_expert():
    from kimik3.ops.moe import triton_mxfp4

    gen = torch.Generator().manual_seed(3)
    N, A, E, L, F = 40, 2, 3, 64, 64  # ~27 rows per expert: several 16-row tiles each
    idx, tw = routing(N, A, E, gen, empty=())
    packed, scales = mx_experts(E, L, F, gen)
    for dtype in (torch.bfloat16, torch.float16):
        z = torch.randn(N, L, generator=gen).to(dtype)
        out = triton_mxfp4.routed_experts_mxfp4(z, idx, tw, packed, scales, BETA, LINEAR_BETA,
                                                 configs=(CONFIGS["bm16"], CONFIGS["bm16"]))
        ref = reference.routed_experts_mxfp4(z, idx, tw, packed, scales, BETA, LINEAR_BETA)
        assert out.dtype == dtype
        assert rel_err(out, ref) < 1e-3


@needs_interpreter
def test_triton_mxfp4_tiles_in_batch_invariant_mode(monkeypatch):
    """In `batch_invariant_mode` the tiles are the decode's whatever the rows per expert, given (a tiered layer
    passes the all-resident model's figure) or not; outside it they follow the figure."""
    from kimik3.ops.backend import use_backend
    from kimik3.ops.moe import triton_mxfp4

    seen = []
    monkeypatch.setattr(triton_mxfp4, "_pick", lambda r: seen.append(r) or (CONFIGS["bm16"], CONFIGS["bm16"]))
    gen = torch.Generator().manual_seed(4)
    N, A, E, L, F = 40, 2, 3, 64, 64
    z = torch.randn(N, L, generator=gen).bfloat16()
    idx, _ = routing(N, A, E, gen, empty=())
    packed, scales = mx_experts(E, L, F, gen)
    for rows_per_expert in (None, 30.0):
        triton_mxfp4.rows(z, idx, packed, scales, BETA, LINEAR_BETA, rows_per_expert)
        with use_backend(batch_invariant=True):
            triton_mxfp4.rows(z, idx, packed, scales, BETA, LINEAR_BETA, rows_per_expert)
    assert seen == [N * A / E, 0.0, 30.0, 0.0]


@needs_interpreter
def test_route_orders_rows_and_tiles_cover_each_once():
    from kimik3.ops.moe import triton_mxfp4

    gen = torch.Generator().manual_seed(5)
    for N, A, E, bm in [(1, 1, 4, 16), (37, 3, 5, 16), (64, 8, 300, 32), (50, 2, 2, 16), (300, 2, 3, 128)]:
        idx, _ = routing(N, A, E, gen, empty=())
        order, tiles, T = triton_mxfp4._route(idx, E, bm)
        assert T == N * A // bm + min(E, N * A)
        flat = idx.reshape(-1)
        assert torch.equal(order.sort().values.long(), torch.arange(N * A))
        key = flat[order.long()] * (N * A) + order.long()  # stable sort by expert: (expert, flat row) ascends
        assert (key.diff() > 0).all()
        seen = torch.zeros(N * A, dtype=torch.int64)
        for e, r0, r1 in tiles.T.tolist():
            assert 0 <= r1 - r0 <= bm
            if r1 > r0:
                assert (flat[order[r0:r1].long()] == e).all()
                seen[r0:r1] += 1
        assert (seen == 1).all()



gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@gpu
@needs_cuda
@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_decode_bf16_bit_exact_gpu():
    import triton
    import triton.language as tl

    from kimik3.ops.mxfp4.triton import decode_tile_bf16

    @triton.jit
    def kernel(p_ptr, s_ptr, lo_ptr, hi_ptr, R: tl.constexpr, BKH: tl.constexpr):
        r = tl.arange(0, R)
        j = tl.arange(0, BKH)
        g = tl.arange(0, BKH // 16)
        p = tl.load(p_ptr + r[:, None] * BKH + j[None, :])
        s = tl.load(s_ptr + r[:, None] * (BKH // 16) + g[None, :])
        lo, hi = decode_tile_bf16(p, s, R, BKH)
        tl.store(lo_ptr + r[:, None] * BKH + j[None, :], lo)
        tl.store(hi_ptr + r[:, None] * BKH + j[None, :], hi)

    # every byte value under every interesting scale byte (0 and 1: subnormal results; 255: inf / NaN)
    scale_bytes = torch.tensor([0, 1, 2, 60, 100, 126, 127, 128, 129, 200, 252, 253, 254, 255, 7, 140],
                               dtype=torch.uint8)
    R, BKH = 16 * 16, 256
    packed = torch.arange(256, dtype=torch.uint8).repeat(R, 1)[:, torch.randperm(256)].contiguous()
    scale = scale_bytes.repeat_interleave(16)[:, None].expand(R, BKH // 16).contiguous()
    packed, scale = packed.cuda(), scale.cuda()
    lo = torch.empty(R, BKH, dtype=torch.bfloat16, device="cuda")
    hi = torch.empty_like(lo)
    kernel[(1,)](packed, scale, lo, hi, R=R, BKH=BKH, num_warps=4)
    out = torch.stack((lo, hi), -1).reshape(R, 2 * BKH)
    ref = decode(packed, scale, torch.bfloat16)
    same = (out.view(torch.int16) == ref.view(torch.int16)) | (out.isnan() & ref.isnan())
    assert same.all(), f"{(~same).sum().item()} values differ"


def _gpu_case(N, A, dims, seed):
    gen = torch.Generator().manual_seed(seed)
    E, L, F = dims["E"], dims["L"], dims["F"]
    z = torch.randn(N, L, generator=gen).bfloat16().cuda()
    idx, tw = routing(N, A, E, gen, device="cuda", empty=(1, 2))
    packed, scales = mx_experts(E, L, F, gen, device="cuda")
    return z, idx, tw, packed, scales


@gpu
@needs_cuda
@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("dims", [K3_DIMS, TINY_DIMS], ids=["k3", "tiny"])
@pytest.mark.parametrize("A", [16, 2])
@pytest.mark.parametrize("N", [1, 16, 257])
def test_triton_mxfp4_matches_reference_gpu(N, A, dims, record_property, monkeypatch, set_moe):
    set_moe("triton")  # Humming, where installed, would take K3's widths
    z, idx, tw, packed, scales = _gpu_case(N, A, dims, seed=N + A)
    with use_backend("torch"):
        ref = moe.routed_experts(z, idx, tw, moe.PackedWeights(packed, scales), BETA, LINEAR_BETA)
    poison_allocator("cuda", 64 * N * A * dims["L"] * 2)
    out = moe.routed_experts(z, idx, tw, moe.PackedWeights(packed, scales), BETA, LINEAR_BETA)
    err = rel_err(out, ref)
    record_property("rel_err", err)
    print(f"mxfp4 triton N={N} A={A} {dims}: rel err {err:.2e}")
    assert out.dtype == torch.bfloat16 and err < 1e-2
    z16 = z.half()
    with use_backend("torch"):
        ref16 = moe.routed_experts(z16, idx, tw, moe.PackedWeights(packed, scales), BETA, LINEAR_BETA)
    assert rel_err(moe.routed_experts(z16, idx, tw, moe.PackedWeights(packed, scales), BETA, LINEAR_BETA), ref16) < 1e-2


@gpu
@needs_cuda
@pytest.mark.parametrize("dims", [K3_DIMS, TINY_DIMS], ids=["k3", "tiny"])
@pytest.mark.parametrize("A", [16, 2])
@pytest.mark.parametrize("N", [1, 16, 257])
def test_grouped_matches_reference_gpu(N, A, dims):
    z, idx, tw, packed, scales = _gpu_case(N, A, dims, seed=N * A)
    ws = [decode(p, s, torch.bfloat16).requires_grad_() for p, s in zip(packed, scales)]
    z.requires_grad_()
    tw.requires_grad_()
    dout = torch.randn(z.shape, device="cuda")

    def run():
        out = moe.routed_experts(z, idx, tw, moe.DenseWeights(*ws), BETA, LINEAR_BETA)
        return out, torch.autograd.grad((out.float() * dout).sum(), [z, tw, *ws])

    with use_backend("torch"):
        ref, ref_grads = run()
    poison_allocator("cuda", 64 * N * A * dims["L"] * 2)
    out, grads = run()
    err = rel_err(out, ref)
    print(f"grouped N={N} A={A} {dims}: rel err {err:.2e}, grads " +
          " ".join(f"{rel_err(g, r):.1e}" for g, r in zip(grads, ref_grads)))
    assert err < 1e-2
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) < 2e-2
    assert (grads[2][1] == 0).all() and (grads[4][2] == 0).all()  # experts 1, 2 received no token


def _invariant_rows(run, z, idx, tw, counts=(1, 2, 7, 64, 65)):
    """Inside `batch_invariant`: each call's rows equal the same tokens' rows of one call over all of them."""
    from kimik3.ops.matmul import batch_invariant

    with batch_invariant():
        full = run(z, idx, tw)
        for n in counts:
            for start in (0, z.shape[0] - n):
                rows = slice(start, start + n)
                assert torch.equal(run(z[rows], idx[rows], tw[rows]), full[rows]), (n, start)
    return full


@gpu
@needs_cuda
@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_triton_mxfp4_rows_are_batch_invariant_gpu():
    """Our W4A16 kernels inside `batch_invariant`: one tiling for any row count (by default 1 token and 300 tokens
    take other tiles), so a token's output is the same bits in any call; near the reference."""
    from kimik3.ops.moe import triton_mxfp4

    gen = torch.Generator().manual_seed(11)
    E, L, F = 16, 256, 192
    z = torch.randn(300, L, generator=gen).bfloat16().cuda()
    idx, tw = routing(300, 4, E, gen, device="cuda")
    packed, scales = mx_experts(E, L, F, gen, device="cuda")

    def run(z, idx, tw):
        return triton_mxfp4.routed_experts_mxfp4(z, idx, tw, packed, scales, 4.0, 25.0)

    full = _invariant_rows(run, z, idx, tw)
    ref = reference.routed_experts_mxfp4(z.cpu(), idx.cpu(), tw.cpu(), tuple(p.cpu() for p in packed),
                                         tuple(s.cpu() for s in scales), 4.0, 25.0)
    assert rel_err(full.float().cpu(), ref.float()) < 1e-2
