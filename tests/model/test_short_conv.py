"""The KDA short convolution: its definition, document boundaries, and the decode form (`last`)."""

import torch

from kimik3.model.kda import ShortConvolution
from tests.helpers import rel_err


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


def conv(P=6, W=4, seed=0):
    torch.manual_seed(seed)
    m = ShortConvolution(P, W)
    torch.nn.init.normal_(m.weight)
    return m


def test_matches_its_definition_with_and_without_documents():
    m = conv()
    x = torch.randn(2, 11, 6)
    assert rel_err(m(x), definition(m.weight, x, [0])) < 1e-6
    cu = torch.tensor([0, 1, 4, 9, 11])
    assert rel_err(m(x[:1], cu), definition(m.weight, x[:1], cu.tolist())) < 1e-6
    assert rel_err(m(x[:, :2]), definition(m.weight, x[:, :2], [0])) < 1e-6  # shorter than the window


def test_last_is_the_newest_output_of_the_window():
    m = conv()
    x = torch.randn(3, 4, 6)
    assert rel_err(m.last(x), m(x)[:, -1:]) < 1e-6
    assert m.last(x.bfloat16()).dtype == torch.bfloat16


def test_gradients_match_the_definition():
    m = conv(P=3)
    x = torch.randn(1, 9, 3, requires_grad=True)
    cu = torch.tensor([0, 4, 9])
    go = torch.randn(1, 9, 3)
    gx, gw = torch.autograd.grad(m(x, cu), (x, m.weight), go)
    x64, w64 = x.detach().double().requires_grad_(), m.weight.detach().double().requires_grad_()
    rx, rw = torch.autograd.grad(definition(w64, x64, [0, 4]), (x64, w64), go.double())
    assert rel_err(gx, rx) < 1e-5 and rel_err(gw, rw) < 1e-5
