"""The optimizer's passes (`kimik3.ops.optim`): the AdamW update against torch's AdamW and the Triton kernel
against its reference, the gradient norm against torch's, and our `AdamW` optimizer's state_dict against torch's.

Bounds: the reference computes torch's fused math in fp32 with each scalar rounded to fp32 once (torch forms
some products in double): fp32 weights within 1e-6 relative of torch's after several steps, bf16 within one
bf16 ulp. The Triton kernel is the reference's to the bit (same order, correctly rounded sqrt and division, no
FMA). The norm within 4e-6 of a float64 truth (fp32 sums of up to 2^15 terms: ~log2(n) ulps).
"""

import pytest
import torch

from kimik3.ops import optim
from kimik3.ops.backend import use_backend
from kimik3.ops.optim import reference
from kimik3.train.optim import AdamW
from tests.helpers import needs_interpreter, rel_err, requires_cuda

HYPER = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8)


def tensors(n, dtype, device="cpu", seed=0):
    """param, grad, exp_avg, exp_avg_sq of n elements (moments as after a few steps: v >= 0)."""
    gen = torch.Generator().manual_seed(seed)
    p, g, m = (torch.randn(n, generator=gen).to(device, dtype) for _ in range(3))
    v = (torch.randn(n, generator=gen) ** 2 * 1e-2).to(device, dtype)
    return p, g * 0.1, m * 1e-2, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [None, 3.0])
def test_reference_follows_torch_adamw(dtype, scale):
    """Four steps of the reference against torch's fused AdamW (CPU) with the same grad_scale; the gradient is
    left as it was (torch's writes the unscaled one back)."""
    p, g, _, _ = tensors(10_000, dtype)
    q = p.clone().requires_grad_()
    opt = torch.optim.AdamW([q], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                            weight_decay=0.1, fused=True)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    gs = torch.tensor(scale) if scale is not None else None
    for step in range(1, 5):
        grad = g * step
        kept = grad.clone()
        optim.adamw_update_(p, grad, m, v, step=step, weight_decay=0.1, grad_scale=gs, **HYPER)
        assert torch.equal(grad, kept)
        q.grad = grad.clone()
        opt.grad_scale = gs
        opt.step()
    tol = 1e-6 if dtype == torch.float32 else 2**-8
    assert rel_err(p, q.detach()) < tol
    assert (p.float() - q.detach().float()).abs().max() <= tol * p.float().abs().max()


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale,decay", [(None, 0.0), (2.5, 0.1)])
def test_kernel_equals_reference(dtype, scale, decay):
    from kimik3.ops.optim import triton as fast

    a = tensors(10_000 + 7, dtype)  # a partial last block
    b = [t.clone() for t in a]
    gs = torch.tensor(scale) if scale is not None else None
    for step in (1, 2, 10):
        fast.adamw_update_(*a, step=step, weight_decay=decay, grad_scale=gs, **HYPER)
        reference.adamw_update_(*b, step=step, weight_decay=decay, grad_scale=gs, **HYPER)
        for x, y in zip(a, b):
            assert torch.equal(x, y)


@needs_interpreter
def test_norm_kernel_against_torch():
    from kimik3.ops.optim import triton as fast

    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(n, generator=gen).to(dt) for n, dt in
             [(20_000, torch.bfloat16), (5, torch.bfloat16), (0, torch.bfloat16), (9_000, torch.float32)]]
    grads.append(torch.randn(40, 30, generator=gen).t())  # not contiguous
    truth = torch.stack([g.double().square().sum() for g in grads]).sum().sqrt()
    assert rel_err(fast.grad_norm(grads), truth) < 4e-6
    assert rel_err(reference.grad_norm(grads), truth) < 4e-6
    # torch's own rounds each bf16 tensor's norm to bf16 first: ours is the better of the two
    assert rel_err(torch.nn.utils.get_total_norm(grads, 2.0), truth) > 1e-5


def test_adamw_state_dict_moves_to_torch_and_back():
    """Ours and torch's AdamW load each other's state_dict and go on as one: a checkpoint written before the
    trainer had its own AdamW resumes, and ours resumes in torch's."""
    torch.manual_seed(0)
    w0 = torch.randn(64, 32)
    grads = [torch.randn(64, 32) * 0.1 for _ in range(6)]

    def run(kinds):
        w = torch.nn.Parameter(w0.clone())
        state = None
        for i, kind in enumerate(kinds):
            opt = (AdamW([w], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1) if kind == "ours" else
                   torch.optim.AdamW([w], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True))
            if state is not None:
                opt.load_state_dict(state)
            for g in grads[3 * i: 3 * i + 3]:
                w.grad = g.clone()
                opt.step()
            state = opt.state_dict()
        return w.detach()

    torch_only = run(["torch", "torch"])
    assert rel_err(run(["torch", "ours"]), torch_only) < 1e-6
    assert rel_err(run(["ours", "torch"]), torch_only) < 1e-6
    assert rel_err(run(["ours", "ours"]), torch_only) < 1e-6


def test_adamw_refuses_modes_it_does_not_have():
    w = torch.nn.Parameter(torch.randn(4))
    w.grad = torch.ones(4)
    opt = AdamW([w], lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    opt.param_groups[0]["amsgrad"] = True
    with pytest.raises(ValueError, match="amsgrad"):
        opt.step()


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_reference_gpu(dtype):
    a = tensors(3_000_001, dtype, "cuda")
    b = [t.clone() for t in a]
    gs = torch.tensor(1.7, device="cuda")
    for step in (1, 5):
        optim.adamw_update_(*a, step=step, weight_decay=0.1, grad_scale=gs, **HYPER)
        with use_backend("torch"):
            optim.adamw_update_(*b, step=step, weight_decay=0.1, grad_scale=gs, **HYPER)
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    grads = [a[1], b[0], torch.randn(1000, device="cuda")]
    truth = torch.stack([g.double().square().sum() for g in grads]).sum().sqrt()
    assert rel_err(optim.grad_norm(grads), truth) < 4e-6
