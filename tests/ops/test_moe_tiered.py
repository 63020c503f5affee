"""Routed experts in two tiers (`kimik3.ops.moe.tiered`) and the host kernel their misses run on (`.host`).

The definition of exact: with misses copied into slots (or streamed through staging), every budget computes the
all-resident layer's output bit for bit; with misses computed on the host, fp32 rows agree to fp32 rounding and
bf16 rows after their rounding.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kimik3.ops.moe import PackedWeights, reference, routed_experts
from kimik3.ops.moe import host as kernel
from kimik3.ops.moe.cache import ExpertCache
from kimik3.ops.moe.tiered import HostTier, TieredWeights, empty_experts
from tests.helpers import needs_interpreter, rel_err
from tests.ops.test_moe_fast import mx_experts, routing

BETA, LINEAR_BETA = 4.0, 25.0


def _six(packed, scales, e):
    return tuple(t[e] for pair in zip(packed, scales) for t in pair)


@pytest.mark.parametrize("dtype, L, F", [(torch.float32, 96, 160), (torch.bfloat16, 96, 160),
                                         (torch.bfloat16, 128, 192)])
def test_host_kernel_equals_the_reference_rows(dtype, L, F):
    """Three experts with 1, 5 and 11 rows (a row count past the kernel's 8-row passes) at widths with several
    scale groups: fp32 to fp32 rounding, bf16 as the torch computation after rounding (widths that are multiples of
    64 take the bf16 dot products where the CPU has them)."""
    gen = torch.Generator().manual_seed(0)
    E = 3
    packed, scales = mx_experts(E, L, F, gen)
    counts = [1, 5, 11]
    x = torch.randn(sum(counts), L, generator=gen).to(dtype)
    jobs = [_six(packed, scales, e) for e in range(E)]
    y = kernel.expert_rows(x, jobs, counts, BETA, LINEAR_BETA, dtype)
    want = kernel.rows_torch(x, jobs, counts, BETA, LINEAR_BETA, dtype)
    assert y.dtype == dtype and kernel.library() is not None
    assert rel_err(y.float(), want.float()) < (1e-6 if dtype == torch.float32 else 1e-2)
    # and the torch computation is the reference's rows for those experts
    idx = torch.cat([torch.full((n, 1), e) for e, n in enumerate(counts)])
    ref = reference.rows(x, idx, E, reference.packed_weights(packed, scales, dtype), BETA, LINEAR_BETA)
    assert torch.equal(want, ref)


def test_host_kernel_decodes_every_code_and_the_extreme_scales():
    """One expert whose codes take all 16 values under scale bytes 0 (a subnormal power), 1, 127 and 200."""
    L = F = 64
    packed, scales = mx_experts(1, L, F, torch.Generator().manual_seed(1))
    codes = torch.arange(256, dtype=torch.uint8).repeat(F * L // 2 // 256 + 1)[:F * L // 2]
    packed = tuple(codes.view(1, F, L // 2).clone() for _ in range(3))
    pick = torch.tensor([0, 1, 127, 100], dtype=torch.uint8)
    scales = tuple(pick.repeat(F * L // 32 // 4).view(1, F, L // 32) for _ in range(3))
    x = torch.randn(2, L, generator=torch.Generator().manual_seed(2))
    job = [_six(packed, scales, 0)]
    y = kernel.expert_rows(x, job, [2], BETA, LINEAR_BETA, torch.float32)
    assert rel_err(y, kernel.rows_torch(x, job, [2], BETA, LINEAR_BETA, torch.float32)) < 1e-6


def _tiered(packed, scales, slots, misses, wave=2, device="cpu"):
    device = torch.device(device)
    pw = PackedWeights(packed, scales)
    if device.type == "cuda":  # the host tier pinned, as `tier_experts` makes it
        pinned = empty_experts(pw, pw.num_experts, torch.device("cpu"), pin=True)
        for a, b in zip((*pw.packed, *pw.scales), (*pinned.packed, *pinned.scales)):
            b.copy_(a)
        pw = pinned
    tier = HostTier(device, [empty_experts(pw, wave, device) for _ in range(2)], misses)
    cache = ExpertCache(pw.num_experts, slots)
    w = TieredWeights(pw, empty_experts(pw, slots, device), cache, tier)
    for s, e in enumerate(range(slots)):
        tier.copy(pw, e, w.slots, s)
        cache.place(e, s)
    return w


@pytest.mark.parametrize("slots", [0, 1, 3, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copied_misses_equal_the_resident_layer_bit_for_bit(slots, dtype):
    """Several steps of random routing through 0..E-1 slots, misses copied (two-expert staging waves): each step's
    output equals the packed reference's bit for bit, while the cache fills and turns over."""
    gen = torch.Generator().manual_seed(slots)
    E, L, F, A = 7, 64, 96, 3
    packed, scales = mx_experts(E, L, F, gen)
    w = _tiered(packed, scales, slots, "copy")
    for N in (1, 4, 9, 2):
        z = torch.randn(N, L, generator=gen).to(dtype)
        idx, tw = routing(N, A, E, gen)
        out = routed_experts(z, idx, tw, w, BETA, LINEAR_BETA)
        assert torch.equal(out, reference.routed_experts_mxfp4(z, idx, tw, packed, scales, BETA, LINEAR_BETA))
    c = w.tier.counters
    assert c["hits"] + c["misses"] == (1 + 4 + 9 + 2) * A and c["host_rows"] == 0
    assert (c["hits"] > 0) == (slots > 0) and c["bytes_copied"] > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_misses_agree_and_promote_the_hot_experts(dtype):
    """Misses computed on the host: fp32 within fp32 rounding of the resident layer; an expert every token uses
    is promoted into a slot after it missed, and hits from then on."""
    gen = torch.Generator().manual_seed(5)
    E, L, F, A = 8, 64, 96, 2
    packed, scales = mx_experts(E, L, F, gen)
    w = _tiered(packed, scales, 2, "host")
    hot = 6
    for N in (3, 3, 5, 2):
        z = torch.randn(N, L, generator=gen).to(dtype)
        idx = torch.stack([torch.tensor([hot, int(torch.randint(0, 6, (1,), generator=gen))]) for _ in range(N)])
        tw = torch.rand(N, A, generator=gen)
        out = routed_experts(z, idx, tw, w, BETA, LINEAR_BETA)
        ref = reference.routed_experts_mxfp4(z, idx, tw, packed, scales, BETA, LINEAR_BETA)
        assert rel_err(out.float(), ref.float()) < (1e-6 if dtype == torch.float32 else 1e-2)
    assert w.cache.slot_of[hot] >= 0 and w.tier.counters["host_rows"] > 0


def test_auto_picks_the_cheaper_way_by_measured_cost():
    w = _tiered(*mx_experts(4, 64, 96, torch.Generator().manual_seed(3)), 1, "auto")
    tier = w.tier
    tier.link_bytes_per_s, tier.host_seconds = 1e9, (1e-3, 2e-3)
    nbytes = 10**6  # 1 ms to copy an expert
    assert tier.choose(np.array([1, 1]), nbytes) == "copy"  # 1 ms each either way: a tie copies
    tier.host_seconds = (0.5e-3, 1e-3)
    assert tier.choose(np.array([1]), nbytes) == "host"
    assert tier.choose(np.array([60]), nbytes) == "copy"  # many rows: the host's matmuls cost more than the link


def test_auto_corrects_the_host_cost_by_what_the_steps_took():
    """A calibration that found the host kernel fast, while each step's host kernel runs 3x slower (as measured
    on the device machine): after the first such step `auto` copies instead; a fast step brings the host back."""
    w = _tiered(*mx_experts(4, 64, 96, torch.Generator().manual_seed(3)), 1, "auto")
    tier = w.tier
    tier.link_bytes_per_s, tier.host_seconds = 1e9, (0.5e-3, 1.2e-3)  # 1 ms to copy an expert, 0.5 to compute
    nbytes = 10**6
    assert tier.choose(np.array([1, 2]), nbytes) == "host"
    tier.observe_host(2 * 1.5e-3 + 0.1e-3, experts=2, rows=3)  # 1.5 ms an expert, plus the one extra row
    assert tier.host_seconds[0] == pytest.approx(1e-3) and tier.host_seconds[1] - tier.host_seconds[0] == \
        pytest.approx(0.7e-3)
    assert tier.choose(np.array([1, 2]), nbytes) == "copy"
    tier.observe_host(0.2e-3, experts=1, rows=1)
    tier.observe_host(0.2e-3, experts=1, rows=1)
    assert tier.choose(np.array([1, 2]), nbytes) == "host"


@needs_interpreter
def test_triton_rows_skip_experts_past_the_last_and_write_into_out():
    """`triton_mxfp4.rows` leaves the rows of expert E or more as `out` had them and writes the others as a full
    call does (Triton's interpreter)."""
    from kimik3.ops.moe import triton_mxfp4

    gen = torch.Generator().manual_seed(4)
    N, A, E, L, F = 5, 2, 4, 64, 96
    packed, scales = mx_experts(E, L, F, gen)
    z = torch.randn(N, L, generator=gen).bfloat16()
    idx, _ = routing(N, A, E, gen)
    full = triton_mxfp4.rows(z, idx, packed, scales, BETA, LINEAR_BETA)
    skip = idx.clone()
    skip[skip == 2] = E
    out = torch.full_like(full, 7.0)
    triton_mxfp4.rows(z, skip, packed, scales, BETA, LINEAR_BETA, rows_per_expert=N * A / E, out=out)
    kept = (skip == E).reshape(-1)
    assert kept.any() and torch.equal(out[~kept], full[~kept]) and (out[kept] == 7.0).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("misses", ["copy", "host"])
def test_tiers_on_the_gpu_equal_the_resident_triton_layer_gpu(misses):
    """K3's expert widths, 32 experts, bf16 on the GPU: copied misses (slots, staging waves on the copy stream,
    promotions) give the resident Triton layer's output bit for bit, step after step; host misses agree to bf16
    rounding."""
    from kimik3.ops.backend import use_backend

    gen = torch.Generator().manual_seed(11)
    E, L, F, A = 32, 3584, 3072, 16
    packed, scales = mx_experts(E, L, F, gen)
    gpu = PackedWeights(tuple(t.cuda() for t in packed), tuple(t.cuda() for t in scales))
    w = _tiered(packed, scales, 6, misses, wave=4, device="cuda")
    for N in (1, 8, 1, 300, 2):
        z = torch.randn(N, L, generator=gen).bfloat16().cuda()
        idx, tw = (t.cuda() for t in routing(N, A, E, gen))
        out = routed_experts(z, idx, tw, w, BETA, LINEAR_BETA)
        with use_backend(moe="triton"):
            ref = routed_experts(z, idx, tw, gpu, BETA, LINEAR_BETA)
        if misses == "copy":
            assert torch.equal(out, ref), N
        else:
            assert rel_err(out.float(), ref.float()) < 1e-2, N
    assert w.tier.counters["hits"] > 0 and w.tier.copy_stream is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_tiered_model_decodes_in_graphs_cut_at_its_tiered_layers_gpu():
    """Graphed decode steps of a tiered model (each tiered layer a hole between the step's graphs) give the eager
    steps' greedy tokens, bf16, several sequences, misses copied and computed on the host."""
    from kimik3.inference import SamplingParams
    from kimik3.inference.engine import EngineConfig
    from kimik3.inference.generate import generate
    from kimik3.model import K3ForCausalLM
    from kimik3.placement import fill_slots, tier_experts
    from kimik3.presets import load_config
    from kimik3.quant import pack_experts

    prompts = [[3, 5, 7, 11, 13], [17, 19], [23, 29, 31]]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    for misses in ("copy", "host"):
        model = pack_experts(K3ForCausalLM(load_config("tiny").text, torch.bfloat16).init_weights(0)).cuda().eval()
        tier_experts(model, 1, "cuda", misses=misses)
        fill_slots(model)
        with torch.no_grad():
            eager = [c.token_ids for c in generate(model, prompts, greedy, config=EngineConfig(
                max_num_seqs=4, use_cuda_graphs=False))]
            graphed = [c.token_ids for c in generate(model, prompts, greedy, config=EngineConfig(max_num_seqs=4))]
        assert graphed == eager, misses
