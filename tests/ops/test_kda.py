"""KDA: recurrent form against a naive loop, chunked form against recurrent, varlen, gradients, dtypes, errors."""

import pytest
import torch
import torch.nn.functional as F

from kimik3.ops import kda
from kimik3.ops.kda import reference

FNS = {"chunk": kda.chunk_kda, "recurrent": kda.recurrent_kda}


def rel_err(a, b):
    """||a - b|| / ||b|| in fp64; NaN if a is not finite, so it never passes a bound."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item() if torch.isfinite(a).all() else float("nan")


def make_inputs(B, T, H, K, V, dtype=torch.float32, seed=0, with_state=False, N=None):
    gen = torch.Generator().manual_seed(seed)

    def r(*shape):  # drawn in fp64 then cast, so every dtype sees the same numbers
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = F.normalize(r(B, T, H, K), dim=-1)
    k = F.normalize(r(B, T, H, K), dim=-1)
    v = r(B, T, H, V)
    g = -5 * torch.sigmoid(r(B, T, H, K))  # strong decays: G reaches ~ -160..-320 inside a 64-token chunk
    beta = torch.sigmoid(r(B, T, H))
    out = [x.to(dtype) for x in (q, k, v, g, beta)]
    S0 = r(B if N is None else N, H, K, V).to(dtype) if with_state else None
    return (*out, S0)


def naive_kda(q, k, v, g, beta, scale, S0):
    """Written independently of the module: one (batch, head) at a time, explicit matrices per token."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    o = torch.empty(B, T, H, V, dtype=q.dtype)
    states = torch.empty(B, H, K, V, dtype=q.dtype)
    for b in range(B):
        for h in range(H):
            S = S0[b, h].clone() if S0 is not None else torch.zeros(K, V, dtype=q.dtype)
            for t in range(T):
                S = torch.diag(torch.exp(g[b, t, h])) @ S
                u = beta[b, t, h] * (v[b, t, h] - S.T @ k[b, t, h])
                S = S + torch.outer(k[b, t, h], u)
                o[b, t, h] = S.T @ (scale * q[b, t, h])
            states[b, h] = S
    return o, states


@pytest.mark.parametrize("with_state", [False, True])
def test_recurrent_matches_naive_loop_fp64(with_state):
    q, k, v, g, beta, S0 = make_inputs(2, 23, 2, 8, 6, torch.float64, seed=1, with_state=with_state)
    ref_o, ref_S = naive_kda(q, k, v, g, beta, 8**-0.5, S0)
    o, S = kda.recurrent_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    assert o.dtype == S.dtype == torch.float64
    assert rel_err(o, ref_o) < 1e-12
    assert rel_err(S, ref_S) < 1e-12
    # an explicit scale is applied instead of the default
    o2, _ = kda.recurrent_kda(q, k, v, g, beta, scale=0.3, initial_state=S0)
    assert rel_err(o2, naive_kda(q, k, v, g, beta, 0.3, S0)[0]) < 1e-12


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("T", [1, 63, 64, 65, 200])
def test_chunk_matches_recurrent_fp32(T, with_state):
    q, k, v, g, beta, S0 = make_inputs(2, T, 3, 32, 16, seed=T, with_state=with_state)
    o_r, S_r = kda.recurrent_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    o_c, S_c = kda.chunk_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    assert o_c.shape == (2, T, 3, 16) and S_c.shape == (2, 3, 32, 16)
    assert o_c.dtype == S_c.dtype == torch.float32
    assert torch.isfinite(o_c).all() and torch.isfinite(S_c).all()
    assert rel_err(o_c, o_r) < 1e-5
    assert rel_err(S_c, S_r) < 1e-5


def test_weak_decay_chunk_matches_recurrent():
    # Near-zero decay keeps the whole history alive, so the intra-chunk solve does real work.
    q, k, v, _, beta, S0 = make_inputs(1, 150, 2, 16, 8, seed=7, with_state=True)
    g = -0.01 * torch.rand(q.shape, generator=torch.Generator().manual_seed(8))
    o_r, S_r = kda.recurrent_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    o_c, S_c = kda.chunk_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    assert rel_err(o_c, o_r) < 1e-5 and rel_err(S_c, S_r) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_output_is_contiguous(dtype):
    """[B, T, H, V] in memory order, like fla's output: the CUDA and CPU paths must not differ in layout (a
    transposed view once made a test's `randn_like(o)` draw different cotangents on the two paths)."""
    q, k, v, g, beta, _ = make_inputs(2, 9, 3, 4, 5, dtype)
    for fn in FNS.values():
        o = fn(q, k, v, g, beta)[0]
        assert o.shape == (2, 9, 3, 5) and o.is_contiguous()
    o = kda.chunk_kda_with_gate(q, k, v, g, beta.logit(), torch.zeros(3), torch.zeros(12), lower_bound=-5.0)[0]
    assert o.is_contiguous()


def test_final_state_only_when_asked():
    q, k, v, g, beta, _ = make_inputs(1, 5, 1, 4, 4)
    for fn in FNS.values():
        assert fn(q, k, v, g, beta)[1] is None


@pytest.mark.parametrize("name", list(FNS))
@pytest.mark.parametrize("with_state", [False, True])
def test_varlen_equals_separate_runs(name, with_state):
    fn = FNS[name]
    lens = [37, 1, 91]  # the last one spans two chunks
    cu = torch.tensor([0, 37, 38, 129], dtype=torch.int64)
    q, k, v, g, beta, S0 = make_inputs(1, sum(lens), 2, 16, 8, seed=3, with_state=with_state, N=3)
    o, S = fn(q, k, v, g, beta, initial_state=S0, output_final_state=True, cu_seqlens=cu)
    assert o.shape == v.shape and S.shape == (3, 2, 16, 8)
    for i in range(3):
        lo, hi = cu[i].item(), cu[i + 1].item()
        s0 = None if S0 is None else S0[i : i + 1]
        o_i, S_i = fn(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g[:, lo:hi], beta[:, lo:hi],
                      initial_state=s0, output_final_state=True)
        assert rel_err(o[:, lo:hi], o_i) < 1e-6
        assert rel_err(S[i : i + 1], S_i) < 1e-6


def _grads(fn, inputs):
    leaves = [x.clone().requires_grad_(True) for x in inputs]
    q, k, v, g, beta, S0 = leaves
    o, S = fn(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    # fixed random cotangents so every output element matters
    gen = torch.Generator().manual_seed(11)
    do = torch.randn(o.shape, generator=gen, dtype=o.dtype)
    dS = torch.randn(S.shape, generator=gen, dtype=S.dtype)
    ((o * do).sum() + (S * dS).sum()).backward()
    return [x.grad for x in leaves]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-10)])
def test_chunk_gradients_match_recurrent(dtype, tol):
    inputs = make_inputs(2, 80, 2, 16, 8, dtype, seed=5, with_state=True)  # 80: one full chunk and a partial one
    g_r = _grads(kda.recurrent_kda, inputs)
    g_c = _grads(kda.chunk_kda, inputs)
    for name, a, b in zip(["q", "k", "v", "g", "beta", "initial_state"], g_c, g_r):
        assert torch.isfinite(a).all(), name
        assert rel_err(a, b) < tol, (name, rel_err(a, b))


def test_chunk_gradcheck_fp64(monkeypatch):
    # A chunk of 4 over 9 tokens exercises full chunks, a partial one and the state carried between them.
    monkeypatch.setattr(reference, "CHUNK_SIZE", 4)
    q, k, v, g, beta, S0 = make_inputs(1, 9, 1, 3, 2, torch.float64, seed=9, with_state=True)
    inputs = [x.requires_grad_(True) for x in (q, k, v, g, beta, S0)]

    def f(q, k, v, g, beta, S0):
        return kda.chunk_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True)

    assert torch.autograd.gradcheck(f, inputs)


def test_bf16_inputs():
    q, k, v, g, beta, S0 = make_inputs(1, 70, 2, 16, 8, seed=4, with_state=True)
    q, k, v, beta, S0 = (x.bfloat16() for x in (q, k, v, beta, S0))  # g stays fp32, as the layers pass it
    for fn in FNS.values():
        o, S = fn(q, k, v, g, beta, initial_state=S0, output_final_state=True)
        assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    o_c, S_c = kda.chunk_kda(q, k, v, g.bfloat16(), beta, initial_state=S0, output_final_state=True)
    o_r, S_r = kda.recurrent_kda(q, k, v, g.bfloat16(), beta, initial_state=S0, output_final_state=True)
    assert o_c.dtype == torch.bfloat16 and S_c.dtype == torch.float32
    # identical bf16 inputs, fp32 math inside: the two forms agree to fp32 rounding before the bf16 cast
    assert rel_err(S_c, S_r) < 1e-5
    assert rel_err(o_c.float(), o_r.float()) < 1e-2


@pytest.mark.parametrize("name", list(FNS))
def test_value_errors(name):
    fn = FNS[name]
    q, k, v, g, beta, _ = make_inputs(2, 6, 2, 4, 3)
    cases = [
        ("k", dict(k=k[:, :5])),
        ("g", dict(g=g[..., :3])),
        ("v", dict(v=v[:, :, :1])),
        ("beta", dict(beta=beta[..., None])),
        ("q", dict(q=q[0])),
        ("initial_state", dict(initial_state=torch.randn(2, 2, 4, 4))),
        ("initial_state", dict(initial_state=torch.randn(1, 2, 4, 3))),
        ("cu_seqlens", dict(cu_seqlens=torch.tensor([0, 3, 6]))),  # B == 2
    ]
    base = dict(q=q, k=k, v=v, g=g, beta=beta)
    for arg, override in cases:
        args = {**base, **{a: x for a, x in override.items() if a in base}}
        kw = {a: x for a, x in override.items() if a not in base}
        with pytest.raises(ValueError, match=rf"^{arg}\b"):
            fn(args["q"], args["k"], args["v"], args["g"], args["beta"], **kw)

    p = [x[:1] for x in (q, k, v, g, beta)]  # B == 1, T == 6
    for cu in ([0, 3, 5], [1, 3, 6], [0, 4, 2, 6], [[0, 6]]):
        with pytest.raises(ValueError, match=r"^cu_seqlens\b"):
            fn(*p, cu_seqlens=torch.tensor(cu))
    with pytest.raises(ValueError, match=r"^initial_state\b"):  # 2 sequences need 2 state rows
        fn(*p, cu_seqlens=torch.tensor([0, 2, 6]), initial_state=torch.randn(1, 2, 4, 3))


def test_decode_in_the_pool_continues_and_updates_each_slot():
    """`decode_kda_with_gate` (the engine's decode) = `recurrent_kda_with_gate` from each row's slot, the new state
    written back to that slot and no other (the CUDA kernel's version: tests/ops/test_kda_gpu.py)."""
    g = torch.Generator().manual_seed(4)
    N, H, K = 3, 2, 16
    q, k, v, f = (torch.randn(N, 1, H, K, generator=g) for _ in range(4))
    beta = torch.randn(N, 1, H, generator=g)
    A_log, dt_bias = torch.rand(4, generator=g), 0.5 * torch.randn(H * K, generator=g)
    pool = torch.randn(6, H, K, K, generator=g)
    slots = torch.tensor([5, 0, 2])
    o_ref, s_ref = kda.recurrent_kda_with_gate(q, k, v, f, beta, A_log, dt_bias, lower_bound=-5.0,
                                               initial_state=pool[slots], output_final_state=True)
    before = pool.clone()
    want = pool.clone().index_copy_(0, slots, s_ref)
    o = kda.decode_kda_with_gate(q, k, v, f, beta, A_log, dt_bias, lower_bound=-5.0, states=pool, slots=slots)
    assert torch.equal(o, o_ref) and torch.equal(pool, want)  # slots 1, 3, 4 as they were
    assert not torch.equal(pool[slots], before[slots])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recurrent_is_batch_invariant(dtype):
    """A sequence's recurrent KDA outputs and state are bitwise the same alone and beside others (the engine's decode
    and verification steps batch sequences in any number, 1 included; einsum took another kernel at one)."""
    q, k, v, g, beta, S0 = make_inputs(5, 4, 2, 32, 32, dtype=dtype, with_state=True)
    o1, s1 = kda.recurrent_kda(q[:1], k[:1], v[:1], g[:1], beta[:1], initial_state=S0[:1], output_final_state=True)
    for B in (2, 5):
        o, s = kda.recurrent_kda(q[:B], k[:B], v[:B], g[:B], beta[:B], initial_state=S0[:B], output_final_state=True)
        assert torch.equal(o[:1], o1) and torch.equal(s[:1], s1)
