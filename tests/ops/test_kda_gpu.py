"""Fast KDA (fla with K3's flags) vs its reference, on the device: outputs, final states, varlen, gradients."""

import pytest
import torch

from kimik3.ops.backend import use_backend
from kimik3.ops.kda import chunk_kda_with_gate, recurrent_kda_with_gate
from tests.helpers import rel_err, requires_cuda

# fla's Triton kernels leave `tl.dot`'s precision to Triton, which runs fp32 operands as TF32 on Hopper; the fp32
# cases check the algorithm at fp32, so tests/conftest.py makes Triton's fp32 dots IEEE in GPU sessions
pytestmark = [pytest.mark.gpu, requires_cuda]

DEV = "cuda"


def kda_inputs(B, T, H, K, dtype, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    r = lambda *s: torch.randn(*s, device=DEV, generator=g)  # noqa: E731
    return dict(q=r(B, T, H, K).to(dtype), k=r(B, T, H, K).to(dtype), v=r(B, T, H, K).to(dtype),
                g=r(B, T, H, K).to(dtype), beta=r(B, T, H).float(), A_log=(torch.rand(128, device=DEV) * 2 - 1),
                dt_bias=0.5 * r(H * K))


def run_both(fn, args, **kw):
    fast = fn(**args, lower_bound=-5.0, **kw)
    with use_backend("torch"):
        ref = fn(**args, lower_bound=-5.0, **kw)
    return fast, ref


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2e-2), (torch.float32, 2e-3)])
@pytest.mark.parametrize("T", [1, 63, 64, 65, 1000])
def test_chunk_kda_fwd_state(dtype, tol, T):
    x = kda_inputs(2, T, 4, 128, dtype)
    h0 = torch.randn(2, 4, 128, 128, device=DEV)
    (o, s), (o_ref, s_ref) = run_both(chunk_kda_with_gate, x, initial_state=h0, output_final_state=True)
    assert o.dtype == dtype and s.dtype == torch.float32
    print(f"chunk T={T} {dtype}: o {rel_err(o, o_ref):.2e} state {rel_err(s, s_ref):.2e}")
    assert rel_err(o, o_ref) < tol and rel_err(s, s_ref) < tol


def test_chunk_kda_varlen():
    x = kda_inputs(1, 300, 4, 128, torch.bfloat16)
    cu = torch.tensor([0, 37, 38, 200, 300], device=DEV)
    h0 = torch.randn(4, 4, 128, 128, device=DEV)
    (o, s), (o_ref, s_ref) = run_both(chunk_kda_with_gate, x, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    assert rel_err(o, o_ref) < 2e-2 and rel_err(s, s_ref) < 2e-2


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2e-2), (torch.float32, 2e-3)])
def test_recurrent_kda_decode_with_state(dtype, tol):
    x = kda_inputs(8, 1, 4, 128, dtype)
    h0 = torch.randn(8, 4, 128, 128, device=DEV)
    (o, s), (o_ref, s_ref) = run_both(recurrent_kda_with_gate, x, initial_state=h0, output_final_state=True)
    print(f"decode {dtype}: o {rel_err(o, o_ref):.2e} state {rel_err(s, s_ref):.2e}")
    assert rel_err(o, o_ref) < tol and rel_err(s, s_ref) < tol


def test_chunk_kda_gradients():
    x = kda_inputs(1, 130, 2, 128, torch.bfloat16)
    h0 = torch.randn(1, 2, 128, 128, device=DEV)
    # the cotangents, drawn once by shape: `randn_like(o)` would follow each output's memory layout, and the
    # reference's o is a transposed view, so the two backends were weighted by different (permuted) draws
    w_o, w_s = torch.randn(1, 130, 2, 128, device=DEV), torch.randn(1, 2, 128, 128, device=DEV)
    grads, outs = [], []
    for backend in ("auto", "torch"):
        leaves = {k: v.detach().clone().requires_grad_(v.is_floating_point() and k not in ("A_log",))
                  for k, v in x.items()}
        h = h0.clone().requires_grad_()
        with use_backend(backend):
            o, s = chunk_kda_with_gate(**leaves, lower_bound=-5.0, initial_state=h, output_final_state=True)
        outs.append((o.detach(), s.detach()))
        ((o.float() * w_o).sum() + (s * w_s).sum()).backward()
        grads.append({k: v.grad for k, v in {**leaves, "h0": h}.items() if v.grad is not None})
    errors = {name: rel_err(grads[0][name], grads[1][name]) for name in grads[1]}
    (o, s), (o_ref, s_ref) = outs
    print(f"forward: o {rel_err(o, o_ref):.2e} state {rel_err(s, s_ref):.2e}")
    print("grads:", " ".join(f"{name} {e:.2e}" for name, e in errors.items()))
    assert max(errors.values()) < 3e-2, errors


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_in_the_pool_is_the_gathered_decode_bit_for_bit(dtype):
    """fla's continuous-batching mode (each row's state read from and written to its slot of the pool) against the
    recurrent kernel on the gathered states, written back by `index_copy_`: the engine's decode before it."""
    from kimik3.ops.kda import decode_kda_with_gate

    x = kda_inputs(6, 1, 4, 128, dtype, seed=3)
    pool = torch.randn(10, 4, 128, 128, device=DEV)
    slots = torch.tensor([7, 0, 3, 9, 4, 1], device=DEV)
    o_ref, s_ref = recurrent_kda_with_gate(**x, lower_bound=-5.0, initial_state=pool[slots], output_final_state=True)
    want = pool.clone().index_copy_(0, slots, s_ref)
    o = decode_kda_with_gate(**x, lower_bound=-5.0, states=pool, slots=slots)
    assert torch.equal(o, o_ref) and torch.equal(pool, want)  # the other slots (2, 5, 6, 8) untouched too
