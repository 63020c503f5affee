"""Batched LoRA (`kimik3.ops.lora`): the grouped GEMMs against the reference loop, and each against one adapter's
rows computed alone; the routed-experts op with per-token adapters against the single-adapter op."""

from __future__ import annotations

import pytest
import torch

from kimik3.ops.lora import AdapterWeights, LoraWeights, grouped, reference
from kimik3.ops.moe import PackedWeights, routed_experts
from kimik3.ops.moe import reference as moe_reference
from tests.helpers import rel_err
from tests.ops.test_moe_fast import mx_experts, routing

N, IN, OUT, K, R = 37, 48, 40, 3, 8


def _batch(gen, dtype=torch.float32):
    x = torch.randn(N, IN, generator=gen).to(dtype)
    adapter = torch.randint(-1, K, (N,), generator=gen)
    adapter[:4] = torch.tensor([-1, 0, 1, 2])  # every adapter and the base present
    a = torch.randn(K, R, IN, generator=gen) / IN ** 0.5
    b = torch.randn(K, OUT, R, generator=gen)
    a[1, R // 2:] = 0  # adapter 1 has rank R/2, zero-padded
    b[1, :, R // 2:] = 0
    scale = torch.tensor([0.5, 2.0, 1.25])
    return x, adapter, a, b, scale


def test_reference_is_each_adapter_alone_and_zero_for_the_base():
    x, adapter, a, b, scale = _batch(torch.Generator().manual_seed(0))
    y = reference.lora_delta(x, adapter, a, b, scale)
    assert torch.equal(y[adapter == -1], torch.zeros_like(y[adapter == -1]))
    for k in range(K):
        rows = adapter == k
        want = ((x[rows] @ a[k].T) @ b[k].T) * scale[k].item()
        assert torch.equal(y[rows], want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_equals_the_reference_loop(dtype):
    x, adapter, a, b, scale = _batch(torch.Generator().manual_seed(1), dtype)
    ref = reference.lora_delta(x.float(), adapter, a, b, scale)
    got = grouped.lora_delta(x, adapter, a, b, scale)
    assert got.dtype == dtype and torch.isfinite(got).all()
    assert rel_err(got.float(), ref) < (1e-5 if dtype == torch.float32 else 1e-2)
    base = adapter == -1
    assert torch.equal(got[base], torch.zeros_like(got[base]))  # never a stale or NaN row for the base


def test_grouped_with_no_adapter_rows_and_with_no_base_rows():
    x, adapter, a, b, scale = _batch(torch.Generator().manual_seed(2))
    none = torch.full_like(adapter, -1)
    assert torch.equal(grouped.lora_delta(x, none, a, b, scale), torch.zeros(N, OUT))
    full = adapter.clamp(min=0)
    assert rel_err(grouped.lora_delta(x, full, a, b, scale), reference.lora_delta(x, full, a, b, scale)) < 1e-5


def test_experts_with_per_token_adapters_equal_each_adapter_alone():
    """Tokens of two adapters and of none in one call == the single-adapter op on each adapter's tokens; the base's
    tokens are the packed reference's over the same batch bit for bit (the base GEMM is shared, they add exact
    zeros)."""
    gen = torch.Generator().manual_seed(3)
    n, A, E, L, F, r = 24, 3, 5, 64, 96, 4
    z = torch.randn(n, L, generator=gen)
    idx, tw = routing(n, A, E, gen)
    packed, scales = mx_experts(E, L, F, gen)
    dims = ((F, L), (F, L), (L, F))
    a = [torch.randn(2, E, r, inp, generator=gen) / inp ** 0.5 for _, inp in dims]
    b = [torch.randn(2, E, out, r, generator=gen) * 0.1 for out, _ in dims]
    scale = torch.tensor([1.5, 0.75])
    adapter = torch.arange(n) % 3 - 1  # -1, 0, 1, ...
    served = AdapterWeights(PackedWeights(packed, scales), lambda rows: adapter, a, b, scale)
    out = routed_experts(z, idx, tw, served, 4.0, 25.0)
    base = adapter == -1
    want = moe_reference.routed_experts_mxfp4(z, idx, tw, packed, scales, 4.0, 25.0)
    assert torch.equal(out[base], want[base]) and not torch.equal(out[~base], want[~base])
    for k in range(2):
        rows = adapter == k
        one = LoraWeights(PackedWeights(packed, scales), tuple(t[k] for t in a), tuple(t[k] for t in b),
                          scale[k].item())
        alone = routed_experts(z[rows], idx[rows], tw[rows], one, 4.0, 25.0)
        assert rel_err(out[rows], alone) < 1e-6
