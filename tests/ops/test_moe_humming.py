"""The Humming backend of `kimik3.ops.moe.routed_experts` on packed experts and the W4A16 backend choice.

CPU: the choice (`mxfp4_backend`: triton without CUDA, or when forced; a forced humming that cannot run is an
error), Humming's routing tables, and the path's own code (tables, Triton SiTU and combine, under Triton's
interpreter) with Humming's GEMM emulated in torch. GPU (`-m gpu`, an H200 with humming-kernels installed): the
path against the reference at K3's widths, CUDA-graph replay against eager, and the cached weight re-layout.
"""

import importlib.util
import json
import sys

import pytest
import torch

from kimik3.ops import moe
from kimik3.ops.backend import moe_backend, moe_backend_from_env, use_backend
from kimik3.ops.moe import reference
from kimik3.ops.mxfp4 import decode
from tests.helpers import patch_interpreter_index, rel_err, requires_cuda
from tests.ops.test_moe_fast import mx_experts, poison_allocator, routing

HAS_TRITON = importlib.util.find_spec("triton") is not None
BETA, LINEAR_BETA = 4.0, 25.0
K3_DIMS = dict(E=32, L=3584, F=3072)  # K3's latent and expert widths, fewer experts
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs triton (CPU: Triton's interpreter)")


@pytest.fixture(autouse=True)
def _interpreter_loops(monkeypatch):
    """The one-program routing tables loop over runtime sizes: under Triton's interpreter (no CUDA) that needs
    `patch_interpreter_index`."""
    if HAS_TRITON and not torch.cuda.is_available():
        patch_interpreter_index(monkeypatch)


def test_backend_choice_cpu(monkeypatch, set_moe):
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(4, 64, generator=gen).bfloat16()
    idx, tw = routing(4, 2, 3, gen)
    packed, scales = mx_experts(3, 64, 96, gen)
    monkeypatch.delenv("KIMIK3_MOE_BACKEND", raising=False)
    assert moe_backend() == moe_backend_from_env() == "auto"  # the default
    assert moe.mxfp4_backend(z, packed) == "triton"
    set_moe("triton")
    assert moe.mxfp4_backend(z, packed) == "triton"
    set_moe("auto")  # Humming where it can run: not on a CPU tensor
    assert moe.mxfp4_backend(z, packed) == "triton"
    assert moe.experts_backend(z.device, torch.bfloat16, 3584, 3072) == "triton"
    set_moe("humming")
    with pytest.raises(ValueError, match="KIMIK3_MOE_BACKEND=humming"):
        moe.mxfp4_backend(z, packed)
    with pytest.raises(ValueError, match="KIMIK3_MOE_BACKEND=humming"):
        moe.experts_backend(z.device, torch.bfloat16, 3584, 3072)
    # the choice is made on the fast path only: a CPU call takes the reference whatever is forced
    out = moe.routed_experts(z, idx, tw, moe.PackedWeights(packed, scales), BETA, LINEAR_BETA)
    assert torch.equal(out, reference.routed_experts_mxfp4(z, idx, tw, packed, scales, BETA, LINEAR_BETA))
    with pytest.raises(ValueError, match="moe backend must be one of"):
        with use_backend(moe="cuda"):
            pass
    monkeypatch.setenv("KIMIK3_MOE_BACKEND", "cuda")  # the CLI's one read of the variable checks it
    with pytest.raises(ValueError, match="KIMIK3_MOE_BACKEND must be one of"):
        moe_backend_from_env()


@needs_triton
def test_unsupported_names_the_reason():
    from kimik3.ops.moe import humming

    packed = (torch.empty(2, 3072, 1792, dtype=torch.uint8),)
    assert "compute capability 9" in humming.unsupported(torch.empty(1, 3584, dtype=torch.bfloat16), packed)


def emulate_indexed(x, w, tables, top_k, out):
    """What Humming's INDEXED GEMM computes: each bm-row block below the padded length gives its rows r (sentinels
    >= the routed row count skipped) x[r // top_k] @ w[expert of the block]^T, rounded to out's dtype."""
    sorted_ids, expert_ids, ntp = tables
    bm = sorted_ids.numel() // expert_ids.numel()
    for b in range(int(ntp[0]) // bm):
        r = sorted_ids[b * bm:(b + 1) * bm].long()
        r = r[r < out.shape[0]]
        out[r] = (x[r // top_k].float() @ w[int(expert_ids[b])].float().T).to(out.dtype)


@needs_triton
def test_tables_cover_each_row_once_in_its_experts_blocks():
    from kimik3.ops.moe import humming

    gen = torch.Generator().manual_seed(1)
    for N, A, E, bm in [(1, 1, 4, 16), (37, 3, 5, 16), (64, 8, 300, 32), (50, 2, 2, 64), (300, 2, 3, 128)]:
        idx, _ = routing(N, A, E, gen, empty=())
        M = N * A
        sorted_ids, expert_ids, ntp = humming._tables(idx, E, bm)
        flat = idx.reshape(-1)
        counts = torch.bincount(flat, minlength=E)
        assert int(ntp[0]) == int(((counts + bm - 1) // bm * bm).sum())
        assert sorted_ids.numel() % bm == 0 and sorted_ids.numel() >= int(ntp[0])
        assert expert_ids.numel() == sorted_ids.numel() // bm
        valid = sorted_ids[:int(ntp[0])].long()
        assert torch.equal(valid[valid < M].sort().values, torch.arange(M))
        assert (sorted_ids[int(ntp[0]):] == M).all()
        for b in range(int(ntp[0]) // bm):
            rows = sorted_ids[b * bm:(b + 1) * bm].long()
            rows = rows[rows < M]
            assert rows.numel() > 0 and (flat[rows] == expert_ids[b]).all() and (rows.diff() > 0).all()


TABLE_CASES = [(1, 1, 4, 16), (1, 16, 896, 16), (4, 16, 896, 8), (37, 3, 5, 16), (16, 16, 896, 32),
               (64, 16, 896, 64), (50, 2, 2, 128), (9, 16, 20, 16)]


def _check_fused_tables(N, A, E, bm, device):
    from kimik3.ops.moe import humming

    gen = torch.Generator().manual_seed(N * 131 + E + bm)
    for trial in range(3):
        idx, _ = routing(N, A, E, gen, device=device, empty=() if trial else tuple(range(0, E, 3)))
        if trial == 2:  # many rows on few experts: long runs, several blocks per expert
            idx = torch.randint(0, min(E, 3), (N * A,), generator=gen).view(N, A).to(device)
        assert N * A <= humming.FUSED_TABLES_MAX_ROWS
        got, want = humming._tables(idx, E, bm), humming._tables_reference(idx, E, bm)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype == torch.int32 and torch.equal(g, w)


@needs_triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors run Triton only under its interpreter")
@pytest.mark.parametrize("N,A,E,bm", TABLE_CASES)
def test_fused_tables_equal_reference(N, A, E, bm):
    """The one-program tables (up to 1,024 routed rows: decode) equal the torch reference's, entry for entry."""
    _check_fused_tables(N, A, E, bm, "cpu")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("N,A,E,bm", TABLE_CASES)
def test_fused_tables_equal_reference_gpu(N, A, E, bm):
    _check_fused_tables(N, A, E, bm, "cuda")


@needs_triton
@pytest.mark.parametrize("N,A,E", [(3, 2, 5), (20, 4, 6), (1, 1, 3)])
def test_humming_path_emulated_matches_reference(monkeypatch, N, A, E):
    """The path's own code (tables, SiTU, combine) with Humming's re-layout and GEMM replaced by the torch emulation."""
    from kimik3.ops.moe import humming

    gen = torch.Generator().manual_seed(N * 7 + E)
    L, F = 64, 96
    z = torch.randn(N, L, generator=gen).bfloat16()
    idx, tw = routing(N, A, E, gen)
    packed, scales = mx_experts(E, L, F, gen)
    w1, w3, w2 = (decode(p, s, torch.bfloat16) for p, s in zip(packed, scales))
    relaid = moe.RelaidWeights(torch.cat([w1, w3], dim=1), w2, E, F)
    monkeypatch.setattr(humming, "_prepared", lambda packed, scales: relaid)
    monkeypatch.setattr(humming, "_tuning", lambda layer, rows, device: ("{}", 16))
    monkeypatch.setattr(humming, "_gemm", lambda w, x, out, tables, top_k, tuning:
                        emulate_indexed(x, w, tables, top_k, out))
    out = humming.routed_experts_mxfp4(z, idx, tw, packed, scales, BETA, LINEAR_BETA)
    ref = reference.routed_experts_mxfp4(z, idx, tw, packed, scales, BETA, LINEAR_BETA)
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) < 1e-3


def _humming_ready() -> bool:
    return (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9 and HAS_TRITON
            and moe.has_humming())


gpu = pytest.mark.gpu
needs_humming = pytest.mark.skipif(not _humming_ready(), reason="needs humming-kernels and a compute capability 9.x")


def _gpu_case(N, A, E, seed):
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(N, K3_DIMS["L"], generator=gen).bfloat16().cuda()
    idx, tw = routing(N, A, E, gen, device="cuda", empty=(1, 2))
    packed, scales = mx_experts(E, K3_DIMS["L"], K3_DIMS["F"], gen, device="cuda")
    return z, idx, tw, packed, scales


@gpu
@requires_cuda
@needs_humming
@pytest.mark.parametrize("N", [16, 256, 1024])
def test_humming_matches_reference_gpu(N, monkeypatch, record_property, set_moe):
    z, idx, tw, packed, scales = _gpu_case(N, 16, K3_DIMS["E"], seed=N)
    set_moe("auto")
    # stored bytes run Triton unless humming is forced (a second copy of the weights); auto (the default) gives
    # Humming the experts that `relayout_experts` re-lays out
    assert moe.mxfp4_backend(z, packed) == "triton"
    assert moe.experts_backend(z.device, z.dtype, z.shape[1], packed[0].shape[1]) == "humming"
    set_moe("humming")
    assert moe.mxfp4_backend(z, packed) == "humming"
    with use_backend("torch"):
        ref = moe.routed_experts(z, idx, tw, moe.PackedWeights(packed, scales), BETA, LINEAR_BETA)
    poison_allocator("cuda", 64 * N * 16 * K3_DIMS["L"] * 2)
    out = moe.routed_experts(z, idx, tw, moe.PackedWeights(packed, scales), BETA, LINEAR_BETA)
    err = rel_err(out, ref)
    record_property("rel_err", err)
    print(f"mxfp4 humming N={N} A=16 {K3_DIMS}: rel err {err:.2e}")
    assert out.dtype == torch.bfloat16 and err < 1e-2
    # forced, the same kernels; forced triton, ours (the two agree to bf16 level)
    set_moe("humming")
    assert torch.equal(moe.routed_experts(z, idx, tw, moe.PackedWeights(packed, scales), BETA, LINEAR_BETA), out)
    set_moe("triton")
    assert rel_err(moe.routed_experts(z, idx, tw, moe.PackedWeights(packed, scales), BETA, LINEAR_BETA), ref) < 1e-2


@gpu
@requires_cuda
@needs_humming
def test_humming_cuda_graph_replay_equals_eager_gpu():
    from kimik3.ops.moe import humming

    N, A = 64, 16
    z, idx, tw, packed, scales = _gpu_case(N, A, K3_DIMS["E"], seed=5)

    def run():
        return humming.routed_experts_mxfp4(z, idx, tw, packed, scales, BETA, LINEAR_BETA)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()  # warm-up: re-layout, tile choice, JIT
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    gen = torch.Generator().manual_seed(6)
    new_idx, new_tw = routing(N, A, K3_DIMS["E"], gen, device="cuda")
    z.copy_(torch.randn(z.shape, generator=gen).bfloat16())
    idx.copy_(new_idx)
    tw.copy_(new_tw)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    eager = run()
    assert torch.equal(out, eager)
    ref = reference.routed_experts_mxfp4(z, idx, tw, packed, scales, BETA, LINEAR_BETA)
    assert rel_err(out, ref) < 1e-2


@gpu
@requires_cuda
@needs_humming
def test_humming_relayout_once_and_again_after_an_update_gpu():
    from kimik3.ops.moe import humming

    N, A, E = 16, 4, 8
    z, idx, tw, packed, scales = _gpu_case(N, A, E, seed=7)
    humming.routed_experts_mxfp4(z, idx, tw, packed, scales, BETA, LINEAR_BETA)
    layers = getattr(packed[0], humming._CACHE)[1]
    humming.routed_experts_mxfp4(z, idx, tw, packed, scales, BETA, LINEAR_BETA)
    assert getattr(packed[0], humming._CACHE)[1] is layers
    new_packed, new_scales = mx_experts(E, K3_DIMS["L"], K3_DIMS["F"], torch.Generator().manual_seed(8), device="cuda")
    for old, new in zip((*packed, *scales), (*new_packed, *new_scales)):
        old.copy_(new)  # as the checkpoint loader fills the buffers
    out = humming.routed_experts_mxfp4(z, idx, tw, packed, scales, BETA, LINEAR_BETA)
    assert getattr(packed[0], humming._CACHE)[1] is not layers
    assert rel_err(out, reference.routed_experts_mxfp4(z, idx, tw, packed, scales, BETA, LINEAR_BETA)) < 1e-2


def _packed_moe(cfg, dtype, seed, device="cpu"):
    """A LatentMoE of `cfg` with random weights and its experts MXFP4-packed."""
    from kimik3.model.moe import LatentMoE
    from kimik3.quant import pack_experts
    from tests.helpers import randomize

    return pack_experts(randomize(LatentMoE(cfg, dtype), seed=seed).to(device)).eval()


def test_relayout_experts_leaves_what_humming_cannot_run(tiny_config, monkeypatch, set_moe):
    """On the CPU (or with the MoE backend triton) nothing is re-laid out; forced humming says why it cannot."""
    from kimik3.model.moe import MXFP4Experts
    from kimik3.quant import relayout_experts

    m = _packed_moe(tiny_config.text, torch.bfloat16, seed=3)
    # nothing to hand over imports nothing: the Humming module imports triton, which a CPU install may lack
    monkeypatch.setitem(sys.modules, "kimik3.ops.moe.humming", None)  # importing it now raises ImportError
    for choice in ("auto", "triton"):
        set_moe(choice)
        assert relayout_experts(m) == 0 and isinstance(m.experts, MXFP4Experts)
    set_moe("humming")
    with pytest.raises(ValueError, match=r"KIMIK3_MOE_BACKEND=humming\): Humming's MoE GEMM"):
        relayout_experts(m)


@needs_triton
def test_relayout_experts_one_copy_emulated(tiny_config, monkeypatch):
    """`relayout_experts` with Humming's re-layout and GEMM emulated in torch: the stored codes are gone (one copy),
    the layer computes what it did, saving it and running it where Humming cannot both raise and say why."""
    from kimik3.model.moe import MXFP4Experts, RelaidExperts
    from kimik3.ops.moe import humming
    from kimik3.quant import relayout_experts

    cfg = tiny_config.text
    m = _packed_moe(cfg, torch.bfloat16, seed=4)
    x = torch.randn(5, cfg.hidden_size).bfloat16()
    before = m(x)
    stored = m.experts
    monkeypatch.setattr("kimik3.quant.experts_backend", lambda device, dtype, L, F: "humming")

    def emulated_relayout(packed, scales):
        w1, w3, w2 = (decode(p, s, torch.bfloat16) for p, s in zip(packed, scales))
        return moe.RelaidWeights(torch.cat([w1, w3], dim=1), w2, w1.shape[0], w1.shape[1])

    monkeypatch.setattr(humming, "relayout", emulated_relayout)
    assert relayout_experts(m) == 1 and isinstance(m.experts, RelaidExperts)
    assert not any(isinstance(x, MXFP4Experts) for x in m.modules())
    assert sys.getrefcount(stored) == 2  # this test's name and getrefcount's argument: the module let it go
    with pytest.raises(RuntimeError, match="re-laid out for Humming.*cannot be saved"):
        m.state_dict()
    with pytest.raises(ValueError, match="re-laid out for Humming: its MoE GEMM needs a CUDA device"):
        m(x)  # the real check: a CPU tensor
    monkeypatch.setattr(humming, "unsupported_for", lambda device, dtype, L, F: None)
    monkeypatch.setattr(humming, "_tuning", lambda layer, rows, device: ("{}", 16))
    monkeypatch.setattr(humming, "_gemm", lambda w, x, out, tables, top_k, tuning:
                        emulate_indexed(x, w, tables, top_k, out))
    with torch.no_grad():
        assert rel_err(m(x), before) < 1e-2
    with pytest.raises(ValueError, match="inference only"):
        m(x)  # with autograd recording: z requires grad through the trainable projections
    assert "layout=humming" in repr(m.experts)


@gpu
@requires_cuda
@needs_humming
def test_relayout_experts_gpu(k3_config, monkeypatch, set_moe):
    """A K3-width MoE layer (32 experts) re-laid out in place: expert memory does not grow, the output equals the
    two-copy Humming path bit for bit and the reference to bf16 level."""
    import dataclasses

    from kimik3.model.moe import RelaidExperts
    from kimik3.quant import relayout_experts

    set_moe("auto")
    text = k3_config.text
    cfg = dataclasses.replace(text, moe=dataclasses.replace(text.moe, num_experts=K3_DIMS["E"]))
    m = _packed_moe(cfg, torch.bfloat16, seed=11, device="cuda")
    x = torch.randn(64, cfg.hidden_size, device="cuda").bfloat16()
    with torch.no_grad():
        with use_backend("torch"):
            ref = m(x)
        set_moe("humming")  # the two-copy path on the stored bytes
        two_copies = m(x)
        set_moe("auto")
        for t in m.experts.buffers():
            if hasattr(t, "_kimik3_humming"):
                del t._kimik3_humming
        torch.cuda.synchronize()
        stored = sum(t.nbytes for t in m.experts.buffers())
        before = torch.cuda.memory_allocated()
        assert relayout_experts(m) == 1 and isinstance(m.experts, RelaidExperts)
        torch.cuda.synchronize()
        grown = torch.cuda.memory_allocated() - before
        print(f"stored experts {stored / 1e6:.1f} MB, Humming's layout {m.experts.relaid.nbytes() / 1e6:.1f} MB, "
              f"allocated after - before {grown / 1e6:.1f} MB")
        assert grown <= 0.05 * stored  # one copy: the stored codes were freed (Humming may add a small scale table)
        out = m(x)
    assert torch.equal(out, two_copies)
    assert rel_err(out, ref) < 1e-2


def test_tiling_token_counts_meet_every_tile_config(monkeypatch):
    """With a stand-in for Humming's heuristics (tiles change at row counts 48, 200 and 900), the counts cover every
    config a call of 1..max_tokens tokens picks, and every routing-table size, each at its smallest count."""
    from kimik3.ops.moe import humming

    bounds = (48, 200, 900)
    monkeypatch.setattr(humming, "_tuning", lambda layer, rows, device: (str(sum(rows > b for b in bounds)), 16))
    relaid = moe.RelaidWeights(None, None, 8, 64)
    counts = humming.tiling_token_counts(relaid, 100, 4, torch.device("cpu"))
    assert counts == sorted(counts) and counts[0] == 1
    key = lambda n: (sum(4 * n > b for b in bounds), max(16, 1 << (4 * n - 1).bit_length())  # noqa: E731
                     if 4 * n <= humming.FUSED_TABLES_MAX_ROWS else 0)
    assert {key(n) for n in counts} == {key(n) for n in range(1, 101)}
    assert len({key(n) for n in counts}) == len(counts)
    assert all(key(n) not in {key(m) for m in range(1, n)} for n in counts)  # the smallest count of each


@gpu
@requires_cuda
@needs_humming
@pytest.mark.parametrize("invariant", [False, True])
def test_tile_decisions_by_row_sample_are_humming_own_gpu(invariant):
    """`_tuning` decides once per Humming row sample (`_row_sample`): at K3's widths, for row counts across a
    serve warm-up's range (1 to 4,096 tokens x 16 routed rows), each decision is the one Humming's heuristics make
    for that exact count."""
    from humming.tune import get_heuristics_config

    from kimik3.ops.moe import humming

    gen = torch.Generator().manual_seed(5)
    packed, scales = mx_experts(K3_DIMS["E"], K3_DIMS["L"], K3_DIMS["F"], gen, device="cuda")
    relaid = humming.relayout(packed, scales)
    dev = torch.device("cuda")
    rows = sorted({1, 7, 8, 9, 1023, 1024, 1025, 2049, 4097, 16385, 65535, 65536}
                  | set(torch.randint(1, 4096 * 16 + 1, (150,), generator=gen).tolist()))
    with use_backend(batch_invariant=invariant):
        for layer in (relaid.w13, relaid.w2):
            for m in rows:
                want = dict(get_heuristics_config(layer_config=layer.config, shape_m=m, gemm_type="indexed",
                                                  device=dev.index or 0, use_batch_invariant=invariant),
                            use_stream_k=False)
                tuning, bm = humming._tuning(layer, m, dev)
                # compared as the JSON the kernels are handed (Humming's tuples come back from it as lists)
                assert tuning == json.dumps(want) and bm == want["block_shape"][0], m


@gpu
@requires_cuda
@needs_humming
def test_warm_relaid_leaves_nothing_to_compile_gpu(monkeypatch):
    """After `warm_relaid` up to 512 tokens, calls at other token counts up to 512 meet only compiled kernels
    (Humming's in-process kernel cache gains no entry)."""
    from humming.kernel.humming import HummingKernel

    from kimik3.ops.moe import humming

    monkeypatch.setattr(HummingKernel, "_str2kernel_cache", {})
    gen = torch.Generator().manual_seed(3)
    E, A = K3_DIMS["E"], 16
    packed, scales = mx_experts(E, K3_DIMS["L"], K3_DIMS["F"], gen, device="cuda")
    relaid = humming.relayout(packed, scales)
    calls = moe.warm_relaid(relaid, 512, A, torch.bfloat16, torch.device("cuda"))
    compiled = set(HummingKernel._str2kernel_cache)
    print(f"warm_relaid: {calls} calls, {len(compiled)} kernels")
    assert calls >= 2 and compiled
    for n in torch.randint(1, 513, (40,), generator=gen).tolist():
        z = torch.randn(n, K3_DIMS["L"], generator=gen).bfloat16().cuda()
        idx, tw = routing(n, A, E, gen, device="cuda")
        humming.routed_experts_relaid(z, idx, tw, relaid, BETA, LINEAR_BETA)
    assert set(HummingKernel._str2kernel_cache) == compiled


@gpu
@requires_cuda
@needs_humming
def test_humming_rows_are_batch_invariant_gpu():
    """Humming's batch-invariant kernels inside `batch_invariant`, at K3's widths: the tiles still follow the row
    count, the sums do not: a token's output is the same bits at 1 to 300 tokens; near the reference. Their
    kernels compile first, side by side (`compile_tiles` in the mode)."""
    from kimik3.ops.matmul import batch_invariant
    from kimik3.ops.moe import humming
    from tests.ops.test_moe_fast import _invariant_rows

    z, idx, tw, packed, scales = _gpu_case(300, 16, K3_DIMS["E"], seed=9)
    relaid = humming.relayout(packed, scales)
    with batch_invariant():
        assert humming.compile_tiles(relaid, [1, 2, 7, 64, 65, 235, 300], 16, z.device) > 0

    def run(z, idx, tw):
        return humming.routed_experts_relaid(z, idx, tw, relaid, BETA, LINEAR_BETA)

    full = _invariant_rows(run, z, idx, tw)
    ref = reference.routed_experts_mxfp4(z, idx, tw, packed, scales, BETA, LINEAR_BETA)
    assert rel_err(full, ref) < 1e-2
