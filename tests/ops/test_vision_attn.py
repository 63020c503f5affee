"""Vision attention: the SDPA path against the fp32 per-image reference, isolation of images, errors."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from kimik3.ops.vision_attn import reference, sdpa, vision_attention
from tests.helpers import rel_err

LENGTHS = [24, 1, 96, 35]


def _inputs(lengths, H=3, K=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    q, k, v = (torch.randn(T, H, K, generator=g, dtype=torch.float64).to(dtype).requires_grad_() for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return q, k, v, cu


def _dense(q, k, v, cu, scale):
    """Written independently: one softmax over all packed tokens with a block-diagonal mask, fp64."""
    img = torch.repeat_interleave(torch.arange(len(cu) - 1), cu.diff())
    s = torch.einsum("thk,shk->hts", q.double(), k.double()) * scale
    s = s.masked_fill(img[:, None] != img[None, :], float("-inf"))
    return torch.einsum("hts,shk->thk", s.softmax(-1), v.double())


@pytest.mark.parametrize("impl", [reference.vision_attention, sdpa.vision_attention, vision_attention])
def test_matches_masked_softmax(impl):
    q, k, v, cu = _inputs(LENGTHS)
    assert rel_err(impl(q, k, v, cu, scale=0.25), _dense(q, k, v, cu, 0.25)) < 1e-6


def test_sdpa_matches_reference_fwd_bwd():
    q, k, v, cu = _inputs(LENGTHS, seed=1)
    out = sdpa.vision_attention(q, k, v, cu, scale=16**-0.5)
    ref = reference.vision_attention(q, k, v, cu, scale=16**-0.5)
    assert out.dtype == ref.dtype == torch.float32
    assert rel_err(out, ref) < 1e-5
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    grads_ref = torch.autograd.grad(ref, (q, k, v), do)
    for g, gr in zip(grads, grads_ref):
        assert rel_err(g, gr) < 1e-5


def test_bf16_close_to_fp32_reference():
    q, k, v, cu = _inputs(LENGTHS, seed=2)
    ref = reference.vision_attention(q, k, v, cu, scale=0.25)
    for impl in (sdpa.vision_attention, vision_attention):
        out = impl(q.bfloat16(), k.bfloat16(), v.bfloat16(), cu, scale=0.25)
        assert out.dtype == torch.bfloat16 and rel_err(out, ref) < 2e-2


def test_images_do_not_see_each_other():
    q, k, v, cu = _inputs(LENGTHS, seed=3)
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[cu[2]:], v2[cu[2]:] = torch.randn_like(k2[cu[2]:]), torch.randn_like(v2[cu[2]:])
    for impl in (reference.vision_attention, sdpa.vision_attention):
        out, out2 = impl(q, k, v, cu, scale=0.25), impl(q, k2, v2, cu, scale=0.25)
        assert torch.equal(out[: cu[2]], out2[: cu[2]])
        assert not torch.equal(out[cu[2]:], out2[cu[2]:])


@pytest.mark.parametrize("impl", [reference.vision_attention, sdpa.vision_attention])
def test_errors(impl):
    q, k, v, cu = _inputs([4, 5])
    with pytest.raises(ValueError, match="cu_seqlens"):
        impl(q, k, v, torch.tensor([0, 4, 8]), scale=1.0)
    with pytest.raises(ValueError, match="k must have the shape"):
        impl(q, k[:3], v, cu, scale=1.0)
    with pytest.raises(ValueError, match=r"q must be \[T, H, K\]"):
        impl(q[None], k, v, cu, scale=1.0)


@pytest.mark.gpu
def test_sdpa_cuda_bf16_matches_reference_gpu():
    q, k, v, cu = _inputs([1024, 49, 3136], H=12, K=128, seed=4)
    q, k, v = (x.detach().cuda() for x in (q, k, v))
    ref = reference.vision_attention(q, k, v, cu, scale=128**-0.5)
    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    with sdpa_kernel(fused):  # the public function takes SDPA on CUDA, and no math fallback (25x slower)
        out = vision_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), cu.cuda(), scale=128**-0.5)
    assert rel_err(out.cpu(), ref.cpu()) < 2e-2
