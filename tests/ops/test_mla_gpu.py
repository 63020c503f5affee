"""Fast MLA (SDPA prefill, masked SDPA over a cache, bf16 latent decode) vs its reference, on the device."""

import pytest
import torch

from kimik3.ops.backend import use_backend
from kimik3.ops.mla import mla_attention, mla_latent_attention
from tests.helpers import rel_err, requires_cuda

pytestmark = [pytest.mark.gpu, requires_cuda]

DEV = "cuda"


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
def test_mla_sdpa_prefill(dtype, tol):
    q, k = (torch.randn(2, 77, 16, 192, device=DEV, dtype=dtype) for _ in range(2))
    v = torch.randn(2, 77, 16, 128, device=DEV, dtype=dtype)
    out = mla_attention(q, k, v, scale=192**-0.5)
    with use_backend("torch"):
        ref = mla_attention(q, k, v, scale=192**-0.5)
    print(f"mla sdpa {dtype}: {rel_err(out, ref):.2e}")
    assert rel_err(out, ref) < tol
    cu = torch.tensor([0, 30, 77], device=DEV)
    out = mla_attention(q[:1], k[:1], v[:1], scale=192**-0.5, cu_seqlens=cu)
    with use_backend("torch"):
        ref = mla_attention(q[:1], k[:1], v[:1], scale=192**-0.5, cu_seqlens=cu)
    assert rel_err(out, ref) < tol


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
def test_mla_sdpa_over_a_cache_mask(dtype, tol):
    """A prefill of T=150 new tokens over S=200 cache rows (50 cached; row 1 has 20 pad rows): explicit mask."""
    B, T, S, H = 2, 150, 200, 16
    q = torch.randn(B, T, H, 192, device=DEV, dtype=dtype)
    k = torch.randn(B, S, H, 192, device=DEV, dtype=dtype)
    v = torch.randn(B, S, H, 128, device=DEV, dtype=dtype)
    pos = torch.arange(S - T, S, device=DEV)
    mask = (torch.arange(S, device=DEV)[None, None] <= pos[None, :, None]).expand(B, T, S).clone()
    mask[1, :, :20] = False
    out = mla_attention(q, k, v, scale=192**-0.5, mask=mask)
    with use_backend("torch"):
        ref = mla_attention(q, k, v, scale=192**-0.5, mask=mask)
    print(f"mla sdpa masked {dtype}: {rel_err(out, ref):.2e}")
    assert rel_err(out, ref) < tol


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-5)])
@pytest.mark.parametrize("T", [1, 3])
def test_mla_latent_decode(dtype, tol, T):
    q = torch.randn(4, T, 16, 192, device=DEV, dtype=dtype)
    latent = torch.randn(4, 333, 576, device=DEV, dtype=dtype)
    w = torch.randn(16 * 256, 512, device=DEV, dtype=dtype) / 512**0.5
    mask = torch.rand(4, T, 333, device=DEV) > 0.2
    mask[..., 0] = True
    out = mla_latent_attention(q, latent, w, qk_nope_head_dim=128, scale=192**-0.5, mask=mask)
    with use_backend("torch"):
        ref = mla_latent_attention(q, latent, w, qk_nope_head_dim=128, scale=192**-0.5, mask=mask)
    print(f"mla latent {dtype}: {rel_err(out, ref):.2e}")
    assert rel_err(out, ref) < tol
