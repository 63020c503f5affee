"""The router's logits on tensor cores (bf16 or fp16 in, fp32 sums and out) against the float64 truth,
elementwise with the bound of `kimik3.ops.router`, forward and backward, at K3's width (D = 7168, E = 896);
and the routing they give against the fp32 reference's."""

import pytest
import torch

from kimik3.model.moe import Router
from kimik3.ops.backend import use_backend
from kimik3.ops.router import router_logits
from tests.helpers import rel_err, requires_cuda
from tests.ops.test_router import K3_D, K3_E, ROUND_U, U, bound_ratio, gamma, operands, truth

pytestmark = [pytest.mark.gpu, requires_cuda]

TC_U = 2 * U  # tensor cores truncate inside their block adds: count round toward zero
FLUSH = K3_D * 2.0 ** -126  # products below fp32's normal range may be flushed


@pytest.mark.parametrize(("N", "dtype"), [(8192, torch.bfloat16), (7, torch.bfloat16), (1, torch.bfloat16),
                                          (64, torch.float16)])
def test_tensor_core_logits_within_the_bound(N, dtype):
    x, w = (t.cuda().requires_grad_() for t in operands(N, K3_E, K3_D, "random", dtype, seed=N))
    out = router_logits(x, w)
    assert type(out.grad_fn).__name__ == "_RouterLogitsBackward"  # the tensor-core path ran
    exact, abs_sum = truth(x.detach(), w.detach().T)
    assert out.dtype == torch.float32 and out.shape == (N, K3_E)
    assert bound_ratio(out, exact, abs_sum + FLUSH / gamma(K3_D, TC_U), gamma(K3_D, TC_U)) <= 1
    with use_backend("torch"):
        ref = router_logits(x.detach(), w.detach())
    assert bound_ratio(ref, exact, abs_sum, gamma(K3_D)) <= 1
    g = torch.randn(N, K3_E, device="cuda", generator=torch.Generator("cuda").manual_seed(N))
    out.backward(g)
    assert x.grad.dtype == dtype and w.grad.dtype == dtype
    slack = 1 + 2.0 ** -7  # |g1| + |g2| + |g3| <= (1 + 2^-7) |g|
    dx, dx_abs = truth(g, w.detach())
    assert bound_ratio(x.grad, dx, slack * dx_abs, gamma(3 * K3_E, TC_U), ROUND_U[dtype]) <= 1
    dw, dw_abs = truth(g.T, x.detach())
    assert bound_ratio(w.grad, dw, slack * dw_abs, gamma(N + 2, TC_U), ROUND_U[dtype]) <= 1


@torch.no_grad()
def test_routing_differs_only_on_near_ties():
    """Tokens whose 16th and 17th biased scores (reference) lie further apart than twice the largest score
    change select the same experts, with the same weights; only the rest may differ."""
    router = Router(K3_D, K3_E, 16, True, 1.0, torch.bfloat16).cuda()
    _, w = operands(1, K3_E, K3_D, "random", seed=3)
    router.weight.copy_(w)
    router.e_score_correction_bias.normal_(0, 1e-3)
    x = torch.randn(8192, K3_D, device="cuda", generator=torch.Generator("cuda").manual_seed(3)).bfloat16()
    idx, weight, scores = router(x)
    with use_backend("torch"):
        idx_ref, weight_ref, scores_ref = router(x)
    vals = (scores_ref + router.e_score_correction_bias).sort(-1, descending=True).values
    clear = vals[:, 15] - vals[:, 16] > 2 * (scores - scores_ref).abs().max()
    assert clear.float().mean() > 0.9
    order, order_ref = idx.argsort(-1), idx_ref.argsort(-1)
    assert torch.equal(idx.gather(-1, order)[clear], idx_ref.gather(-1, order_ref)[clear])
    assert rel_err(weight.gather(-1, order)[clear], weight_ref.gather(-1, order_ref)[clear]) < 1e-5
