"""Kimi Delta Attention (KDA) in plain PyTorch: a per-token recurrence and a chunked (WY/UT) form.

Both functions compute the same thing; ``recurrent_kda`` is the definition, ``chunk_kda`` is the
parallel form used for prefill and training. Everything is differentiable with autograd.

Shape legend:
    B batch, T tokens, H heads, K key dim, V value dim, N sequences (B, or len(cu_seqlens) - 1),
    C chunk length (CHUNK_SIZE, the last chunk of a sequence may be shorter).

Per (sequence, head) the state S is K x V and each token t does
    S <- diag(exp(g_t)) S;  u_t = beta_t (v_t - S^T k_t);  S <- S + k_t u_t^T;  o_t = S^T (scale q_t).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kimik3.ops.varlen import check_cu_seqlens

CHUNK_SIZE = 64


def _validate(q, k, v, g, beta, initial_state, cu_seqlens) -> list[int] | None:
    """Raise ValueError on malformed input; return cu_seqlens as Python ints (None when not packed)."""
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must have the shape of q {tuple(q.shape)}, got {tuple(k.shape)}")
    if g.shape != q.shape:
        raise ValueError(f"g must have the shape of q {tuple(q.shape)}, got {tuple(g.shape)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [B, T, H, V] = [{B}, {T}, {H}, V], got {tuple(v.shape)}")
    if beta.shape != q.shape[:3]:
        raise ValueError(f"beta must be [B, T, H] = [{B}, {T}, {H}], got {tuple(beta.shape)}")
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a floating point tensor, got {x.dtype}")

    if cu_seqlens is None:
        bounds = None
        N = B
    else:
        check_cu_seqlens(cu_seqlens, T, B)
        bounds = [int(x) for x in cu_seqlens.tolist()]
        N = len(bounds) - 1

    if initial_state is not None:
        want = (N, H, K, v.shape[-1])
        if tuple(initial_state.shape) != want:
            raise ValueError(f"initial_state must be [N, H, K, V] = {list(want)}, got {tuple(initial_state.shape)}")
        if not initial_state.is_floating_point():
            raise ValueError(f"initial_state must be a floating point tensor, got {initial_state.dtype}")
    return bounds


def _recurrent_core(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, S: Tensor) -> tuple[Tensor, Tensor]:
    """q, k, g: [B, H, T, K] (q already scaled); v: [B, H, T, V]; beta: [B, H, T]; S: [B, H, K, V]."""
    outs = []
    for t in range(q.shape[2]):
        S = S * g[:, :, t, :, None].exp()
        # [B, H, 1, K] @ [B, H, K, V], not einsum: einsum takes another kernel when B = 1, so a sequence's state
        # would differ in its last bits between a step it runs alone and one it shares (batch invariance)
        u = beta[:, :, t, None] * (v[:, :, t] - (k[:, :, t, None, :] @ S)[:, :, 0])
        S = S + k[:, :, t, :, None] * u[:, :, None, :]
        outs.append((q[:, :, t, None, :] @ S)[:, :, 0])
    o = torch.stack(outs, dim=2) if outs else v.new_zeros(v.shape)
    return o, S


def _chunk_core(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, S: Tensor,
                marks: frozenset[int] = frozenset(), states: list[Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """Same contract as _recurrent_core, computed chunk by chunk with the WY/UT transform.

    The state after each chunk whose end offset is in `marks` is appended to `states` (a serving engine's
    prefix-cache snapshots: the forward computes them anyway, so exporting them costs a copy, not a forward).
    """
    T = q.shape[2]
    outs = []
    for start in range(0, T, CHUNK_SIZE):
        window = slice(start, min(start + CHUNK_SIZE, T))
        qc, kc, vc, bc = q[:, :, window], k[:, :, window], v[:, :, window], beta[:, :, window, None]
        G = g[:, :, window].cumsum(dim=2)  # [B, H, C, K], inclusive log decay from the chunk start
        C = G.shape[2]

        # Pairwise decay exp(G_t - G_s) for s <= t. G falls to about -320 inside a chunk, so factoring
        # this as exp(G_t) * exp(-G_s) would overflow; only differences G_t - G_s with s <= t (all <= 0)
        # are exponentiated, and exp(G_t) alone is the decay from the chunk start (it may underflow to 0,
        # which is the right answer). The s > t half is set to -inf before exp: exp(+320) would be inf
        # there and turn the masked-out zeros into NaN gradients.
        causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        diff = G[:, :, :, None, :] - G[:, :, None, :, :]  # [B, H, C(t), C(s), K]
        decay = torch.where(causal[:, :, None], diff, float("-inf")).exp()
        kk = torch.einsum("bhtd,bhsd,bhtsd->bhts", kc, kc, decay)
        qk = torch.einsum("bhtd,bhsd,bhtsd->bhts", qc, kc, decay)  # includes s == t

        # The intra-chunk part of the recurrence is u_t + sum_{s<t} A[t,s] u_s = beta_t (v_t - S_t0^T k_t),
        # a unit lower-triangular system; solving it once for both right-hand sides gives
        # w = T(beta k exp(G)) and u = T(beta v) with T = (I + A)^-1.
        A = (bc * kk).tril(-1)
        eye = torch.eye(C, dtype=A.dtype, device=A.device)
        rhs = torch.cat([bc * kc * G.exp(), bc * vc], dim=-1)
        wu = torch.linalg.solve_triangular(A + eye, rhs, upper=False, unitriangular=True)
        w, u = wu.split([k.shape[-1], v.shape[-1]], dim=-1)
        U = u - w @ S  # [B, H, C, V], the delta-rule updates with the carried state folded in

        outs.append((qc * G.exp()) @ S + qk @ U)
        G_last = G[:, :, -1:]  # [B, H, 1, K]
        S = G_last.transpose(-1, -2).exp() * S + (kc * (G_last - G).exp()).transpose(-1, -2) @ U
        if start + C in marks:
            states.append(S)
    o = torch.cat(outs, dim=2) if outs else v.new_zeros(v.shape)
    return o, S


def _run(core, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, offsets=None):
    bounds = _validate(q, k, v, g, beta, initial_state, cu_seqlens)
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    # fp32 math for fp32/bf16/fp16 inputs; fp64 inputs stay fp64 (tests, gradcheck).
    dtype = torch.float64 if torch.float64 in (q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype) else torch.float32

    # Work in [B, H, T, *]: batch and heads lead, so every per-chunk product is one batched matmul.
    qf, kf, vf, gf = (x.to(dtype).transpose(1, 2) for x in (q, k, v, g))
    qf = qf * scale
    bf = beta.to(dtype).transpose(1, 2)
    N = B if bounds is None else len(bounds) - 1
    S0 = q.new_zeros(N, H, K, V, dtype=dtype) if initial_state is None else initial_state.to(dtype)
    marked: list[Tensor] = []  # checkpoint states (chunked core only), in (sequence, offset) order

    def extra(i: int) -> tuple:
        return () if offsets is None else (frozenset(offsets[i]), marked)

    if bounds is None:
        if offsets is not None:  # batch rows: one core call per row keeps the exported states in order
            pieces, states = [], []
            for i in range(B):
                oi, Si = core(qf[i:i + 1], kf[i:i + 1], vf[i:i + 1], gf[i:i + 1], bf[i:i + 1], S0[i:i + 1],
                              *extra(i))
                pieces.append(oi)
                states.append(Si)
            o, S = torch.cat(pieces), torch.cat(states)
        else:
            o, S = core(qf, kf, vf, gf, bf, S0)
    else:
        # Each packed sequence runs on its own with its own state row, so no token sees another sequence.
        pieces, states = [], []
        for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            seq = slice(lo, hi)
            oi, Si = core(qf[:, :, seq], kf[:, :, seq], vf[:, :, seq], gf[:, :, seq], bf[:, :, seq], S0[i : i + 1],
                          *extra(i))
            pieces.append(oi)
            states.append(Si)
        o, S = torch.cat(pieces, dim=2), torch.cat(states, dim=0)
    # contiguous [B, T, H, V] like fla's output: a transposed view would differ from the CUDA path in layout,
    # which `view` and `*_like` (memory-order draws) expose
    o = o.transpose(1, 2).contiguous().to(v.dtype)
    if offsets is not None:
        return o, S, (torch.cat(marked) if marked else S.new_empty(0, H, K, V))
    return o, (S if output_final_state else None)


def recurrent_kda(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, scale: float | None = None,
                  initial_state: Tensor | None = None, output_final_state: bool = False,
                  cu_seqlens: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """Token-by-token KDA; the definition. See kimik3.ops.kda.recurrent_kda for the contract."""
    return _run(_recurrent_core, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)


def chunk_kda(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, scale: float | None = None,
              initial_state: Tensor | None = None, output_final_state: bool = False,
              cu_seqlens: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """Chunked KDA (CHUNK_SIZE tokens per step, WY/UT transform). See kimik3.ops.kda.chunk_kda."""
    return _run(_chunk_core, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)


def gate_inputs(q: Tensor, k: Tensor, g: Tensor, beta: Tensor, A_log: Tensor, dt_bias: Tensor,
                lower_bound: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """K3's activations before the delta rule, in fp32 (spec 2.4 steps 4-6).

    q, k -> x / sqrt(sum(x^2) + 1e-6) over K;  g -> lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias));
    beta -> sigmoid(beta). `A_log` may be stored longer than H (the released [128]); the first H are used.
    """
    H, K = q.shape[2], q.shape[3]

    def l2(x: Tensor) -> Tensor:
        x = x.float()
        return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)

    a_H1 = A_log[:H].float().exp().view(H, 1)
    g = lower_bound * torch.sigmoid(a_H1 * (g.float() + dt_bias.float().view(H, K)))
    return l2(q), l2(k), g, torch.sigmoid(beta.float())


def chunk_kda_checkpoints(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, offsets: list[list[int]],
                          scale: float | None = None, initial_state: Tensor | None = None,
                          cu_seqlens: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """`chunk_kda` that also returns the state at chunk-grid offsets inside each sequence.

    `offsets[i]` lists offsets from sequence i's start (multiples of CHUNK_SIZE, at most its length) after
    which the state is wanted. Returns (o, final_state [N, H, K, V], checkpoints [M, H, K, V]) with the M
    checkpoint states in (sequence, increasing offset) order. Offsets off the grid raise ValueError.
    """
    for i, offs in enumerate(offsets):
        if any(o <= 0 or o % CHUNK_SIZE for o in offs) or list(offs) != sorted(set(offs)):
            raise ValueError(f"offsets[{i}] must be increasing positive multiples of {CHUNK_SIZE}, got {offs}")
    return _run(_chunk_core, q, k, v, g, beta, scale, initial_state, True, cu_seqlens, offsets)
