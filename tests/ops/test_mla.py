"""The MLA reference ops on the CPU: expanded attention against its definition (loops in float64: causal, packed
documents, an explicit mask) and absorbed latent attention against expanded attention over the up-projected keys and
values (the identity the absorbed decode rests on). The fast paths are tested against these in test_mla_gpu.py,
the paged op in test_mla_paged.py.

Legend: B batch, T queries, S keys, H heads, N nope dims, R shared-key dims, C latent rank, V value dims.
"""

import math

import pytest
import torch

from kimik3.ops.mla import mla_attention, mla_latent_attention
from tests.helpers import rel_err

H, N, R, C, V = 3, 8, 4, 12, 6  # pairwise distinct: a swapped dimension is a shape error
SCALE = (N + R) ** -0.5


def definition(q, k, v, allowed):
    """out[b, t, h] = sum_s softmax_s(q . k * scale over allowed s) v, one query at a time in float64."""
    B, T, _, _ = q.shape
    out = torch.zeros(B, T, q.shape[2], v.shape[-1], dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            keys = [s for s in range(k.shape[1]) if allowed(b, t, s)]
            for h in range(q.shape[2]):
                scores = [float(q[b, t, h].double() @ k[b, s, h].double()) * SCALE for s in keys]
                top = max(scores)
                w = [math.exp(x - top) for x in scores]
                out[b, t, h] = sum(wi * v[b, s, h].double() for wi, s in zip(w, keys)) / sum(w)
    return out


def qkv(B, T, S, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, T, H, N + R, generator=g), torch.randn(B, S, H, N + R, generator=g),
            torch.randn(B, S, H, V, generator=g))


def test_expanded_is_causal_attention():
    q, k, v = qkv(2, 7, 7)
    want = definition(q, k, v, lambda b, t, s: s <= t)
    assert rel_err(mla_attention(q, k, v, scale=SCALE), want) < 1e-6


def test_packed_documents_never_see_each_other():
    q, k, v = qkv(1, 9, 9, seed=1)
    cu = torch.tensor([0, 2, 3, 9])
    doc = torch.repeat_interleave(torch.arange(3), cu.diff())
    want = definition(q, k, v, lambda b, t, s: s <= t and doc[s] == doc[t])
    assert rel_err(mla_attention(q, k, v, scale=SCALE, cu_seqlens=cu), want) < 1e-6


def test_an_explicit_mask_over_a_cache():
    """New queries over cached + new keys (a prefill chunk after a cached prefix): the mask replaces causality."""
    q, k, v = qkv(2, 3, 8, seed=2)
    mask = torch.rand(2, 3, 8, generator=torch.Generator().manual_seed(3)) > 0.4
    mask[..., 0] = True  # every query sees a key
    want = definition(q, k, v, lambda b, t, s: bool(mask[b, t, s]))
    assert rel_err(mla_attention(q, k, v, scale=SCALE, mask=mask), want) < 1e-6


@pytest.mark.parametrize("T", [1, 4])
def test_absorbed_is_expanded_attention_over_the_up_projection(T):
    """q . [W_kb c ; k_r] and sum p W_vb c: the up-projections folded into the query and the output give the
    expanded attention's output (fp32 reference both ways)."""
    g = torch.Generator().manual_seed(4 + T)
    B, S = 2, 10
    q = torch.randn(B, T, H, N + R, generator=g)
    latent = torch.randn(B, S, C + R, generator=g)
    kv_b = torch.randn(H * (N + V), C, generator=g) * C**-0.5
    mask = torch.ones(B, T, S, dtype=torch.bool).tril(S - T)  # the T new queries sit at the cache's end
    c, k_r = latent.split([C, R], dim=-1)
    k_n, v = (c @ kv_b.T).view(B, S, H, N + V).split([N, V], dim=-1)
    k = torch.cat([k_n, k_r[:, :, None].expand(B, S, H, R)], dim=-1)
    want = mla_attention(q, k, v, scale=SCALE, mask=mask)
    got = mla_latent_attention(q, latent, kv_b, qk_nope_head_dim=N, scale=SCALE, mask=mask)
    assert got.shape == (B, T, H, V) and rel_err(got, want) < 1e-5


def test_expanded_gradients_match_float64():
    """d q, d k, d v of the (fp32) reference against causal softmax attention written out in float64."""
    q, k, v = qkv(2, 6, 6, seed=6)
    go = torch.randn(2, 6, H, V, generator=torch.Generator().manual_seed(7))
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    got = torch.autograd.grad(mla_attention(*ins, scale=SCALE), ins, go)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    s = torch.einsum("bthk,bshk->bhts", q64, k64) * SCALE
    p = s.masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
    want = torch.autograd.grad(torch.einsum("bhts,bshv->bthv", p, v64), (q64, k64, v64), go.double())
    for name, a, b in zip("qkv", got, want):
        assert rel_err(a, b) < 1e-5, name
