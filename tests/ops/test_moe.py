"""The routed experts' reference on the CPU: the expert-ordered loop against its definition (token by token in
float64: each of its A experts' SiTU-GLU output rounded to the compute dtype, then the fp32 weighted sum), its
gradients, and the MXFP4 path equal to the dense one on the decoded weights. The grouped and Triton paths are tested
against this reference in test_moe_fast.py.

Legend: N tokens, L latent width, F expert width, E experts, A active experts per token.
"""

import pytest
import torch

from kimik3.ops.moe import reference
from kimik3.ops.mxfp4 import decode, encode
from kimik3.ops.situ.reference import situ_glu
from tests.helpers import rel_err

N, L, F, E, A = 7, 64, 96, 5, 2  # pairwise distinct; L and F multiples of 32 (MXFP4 blocks)
BETA, LINEAR_BETA = 4.0, 25.0


def case(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(N, L, generator=g).to(dtype)
    idx = torch.stack([torch.randperm(E, generator=g)[:A] for _ in range(N)])
    w = torch.rand(N, A, generator=g)
    w1, w3 = (torch.randn(E, F, L, generator=g) * L**-0.5 for _ in range(2))
    w2 = torch.randn(E, L, F, generator=g) * F**-0.5
    return z, idx, w, (w1.to(dtype), w3.to(dtype), w2.to(dtype))


def definition(z, idx, w, w1, w3, w2):
    """r[n] = sum_a w[n, a] * round(w2_e SiTU-GLU(w1_e z_n, w3_e z_n)), e = idx[n, a], one token at a time."""
    rows = []
    for n in range(N):
        r = torch.zeros(L, dtype=torch.float64)
        for a in range(A):
            e = int(idx[n, a])
            h = situ_glu(z[n] @ w1[e].T, z[n] @ w3[e].T, BETA, LINEAR_BETA)
            r = r + w[n, a].double() * (h @ w2[e].T).to(z.dtype).double()
        rows.append(r)
    return torch.stack(rows)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_reference_is_the_definition(dtype, tol):
    z, idx, w, ws = case(dtype)
    got = reference.routed_experts(z, idx, w, *ws, BETA, LINEAR_BETA)
    assert got.dtype == dtype and rel_err(got, definition(z, idx, w, *ws)) < tol


def test_reference_gradients_match_the_definition():
    """Gradients of the inputs, the routing weights and every expert's weights: the fp32 reference's against the
    float64 definition's (autograd through both)."""
    z, idx, w, ws = case(seed=1)
    go = torch.randn(N, L, generator=torch.Generator().manual_seed(3))
    ins = [t.clone().requires_grad_() for t in (z, w, *ws)]
    got = torch.autograd.grad(reference.routed_experts(ins[0], idx, ins[1], *ins[2:], BETA, LINEAR_BETA), ins, go)
    ins64 = [t.double().requires_grad_() for t in (z, w, *ws)]
    want = torch.autograd.grad(definition(ins64[0], idx, ins64[1], *ins64[2:]), ins64, go.double())
    for name, a, b in zip(("z", "w", "w1", "w3", "w2"), got, want):
        assert rel_err(a, b) < 1e-5, name


def test_mxfp4_is_dense_on_the_decoded_weights():
    z, idx, w, ws = case(torch.bfloat16, seed=2)
    packed, scales = zip(*(encode(t.float()) for t in ws))
    dense = tuple(decode(p, s, torch.bfloat16) for p, s in zip(packed, scales))
    got = reference.routed_experts_mxfp4(z, idx, w, packed, scales, BETA, LINEAR_BETA)
    assert torch.equal(got, reference.routed_experts(z, idx, w, *dense, BETA, LINEAR_BETA))
