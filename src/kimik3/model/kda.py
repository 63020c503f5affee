"""Kimi Delta Attention (KDA) layer: projections, short convs, decay gate, delta rule, gated norm.

Legend: B batch, T tokens, D hidden, H heads, K = V head dim, P = H*K projection width, W conv window.

    q, k, v = silu(conv(q_proj x)), silu(conv(k_proj x)), silu(conv(v_proj x))      (conv math in fp32)
    g       = lower_bound * sigmoid( exp(A_log[:H]) * (f_b(f_a x) + dt_bias) )      fp32 log-decay in (-5, 0)
    beta    = sigmoid(b_proj x)                                                     fp32
    o       = delta_rule(l2norm(q), l2norm(k), v, g, beta, scale K^-1/2)            kimik3.ops.kda
              (g, beta and the norms are applied inside the op: fla fuses them into its kernels on CUDA)
    out     = o_proj( rms(o) * o_norm.weight * sigmoid(g_proj x) )                  norm + gate in fp32
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from kimik3.config import TextConfig
from kimik3.model.norm import GatedRMSNorm
from kimik3.model.state import KDAStateSpec, KDAView
from kimik3.model.step import KDAStepIO, Step
from kimik3.ops.kda import (
    chunk_kda_with_gate,
    chunk_kda_with_gate_checkpoints,
    decode_kda_with_gate,
    recurrent_kda_with_gate,
)
from kimik3.ops.shortconv import decode_short_conv, gathered_short_conv, short_conv


class ShortConvolution(nn.Module):
    """Causal depthwise conv (no bias) + SiLU; weight [P, 1, W] fp32, zero left padding per document.

    y[t, c] = silu( sum_j weight[c, 0, j] * x[t - (W-1) + j, c] ), tap W-1 being the current token.
    """

    def __init__(self, channels: int, kernel_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size, dtype=torch.float32))

    def forward(self, x_BTP: Tensor, cu_seqlens: Tensor | None = None) -> Tensor:
        return short_conv(x_BTP, self.weight.squeeze(1), cu_seqlens)

    def gathered(self, ext_XP: Tensor, index_WT: Tensor) -> Tensor:
        """Packed sequences with cached tails: `ext` [X, P] holds the new inputs then the tails, and
        `index_WT[j]` the row feeding tap j of each of the T outputs. The same sums in the same order as
        `forward` over a tail-extended row: [T, P]."""
        return gathered_short_conv(ext_XP, index_WT, self.weight.squeeze(1))

    def decode(self, x_NP: Tensor, tails_SWP: Tensor, slots_N: Tensor) -> Tensor:
        """One new token per sequence against its cached tail (moved on in place): [N, P] (`decode_short_conv`)."""
        return decode_short_conv(x_NP, tails_SWP, slots_N, self.weight.float().squeeze(1))


class KimiDeltaAttention(nn.Module):
    def __init__(self, cfg: TextConfig, dtype: torch.dtype | None = None):
        super().__init__()
        c, D = cfg.kda, cfg.hidden_size
        self.num_heads, self.head_dim, self.lower_bound = c.num_heads, c.head_dim, c.gate_lower_bound
        P = c.proj_dim
        self.q_proj = nn.Linear(D, P, bias=False, dtype=dtype)
        self.k_proj = nn.Linear(D, P, bias=False, dtype=dtype)
        self.v_proj = nn.Linear(D, P, bias=False, dtype=dtype)
        self.q_conv1d = ShortConvolution(P, c.short_conv_kernel_size)
        self.k_conv1d = ShortConvolution(P, c.short_conv_kernel_size)
        self.v_conv1d = ShortConvolution(P, c.short_conv_kernel_size)
        self.f_a_proj = nn.Linear(D, c.head_dim, bias=False, dtype=dtype)
        self.f_b_proj = nn.Linear(c.head_dim, P, bias=False, dtype=dtype)
        self.b_proj = nn.Linear(D, c.num_heads, bias=False, dtype=dtype)
        # stored longer than H (released: 128 for 96 heads); only the first H entries are used
        self.A_log = nn.Parameter(torch.empty(c.a_log_size, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(P, dtype=torch.float32))
        self.g_proj = nn.Linear(D, P, bias=False, dtype=dtype)
        self.o_norm = GatedRMSNorm(c.head_dim, cfg.rms_norm_eps)
        self.o_proj = nn.Linear(P, D, bias=False, dtype=dtype)

    def state_spec(self) -> KDAStateSpec:
        """What this layer keeps per sequence (read from the module: a tensor-parallel rank's local heads)."""
        return KDAStateSpec(self.num_heads, self.head_dim, self.q_proj.out_features, self.q_conv1d.weight.shape[-1])

    def forward(self, x_BTD: Tensor, cu_seqlens: Tensor | None = None, state: KDAView | None = None,
                step: Step | None = None) -> Tensor | tuple[Tensor, KDAStepIO | None]:
        """Without state: whole sequences (training, prefill of packed documents), x [B, T, D] -> [B, T, D]. With
        this layer's `state` and a `step`: `cached` (a pair: the output and what the step gave back), through the
        module's call so that hooks and counters see it as this module's."""
        if state is not None:
            return self.cached(x_BTD, state, step)
        B, T, _ = x_BTD.shape
        H, K = self.num_heads, self.head_dim
        q_BTHK, k_BTHK, v_BTHK = (mod(proj(x_BTD), cu_seqlens).view(B, T, H, K) for mod, proj in
                                  ((self.q_conv1d, self.q_proj), (self.k_conv1d, self.k_proj),
                                   (self.v_conv1d, self.v_proj)))
        g_BTHK = self.f_b_proj(self.f_a_proj(x_BTD)).view(B, T, H, K)  # raw: activated inside the op
        beta_BTH = self.b_proj(x_BTD).float()  # logits
        o_BTHK, _ = chunk_kda_with_gate(q_BTHK, k_BTHK, v_BTHK, g_BTHK, beta_BTH, self.A_log, self.dt_bias,
                                        lower_bound=self.lower_bound, scale=K**-0.5, cu_seqlens=cu_seqlens)
        o_BTHK = self.o_norm(o_BTHK, self.g_proj(x_BTD).view(B, T, H, K))
        return self.o_proj(o_BTHK.reshape(B, T, H * K))

    def cached(self, x_1TD: Tensor, pool: KDAView, step: Step) -> tuple[Tensor, KDAStepIO | None]:
        """The step's N packed chunks [1, T, D], each continuing the state in its slot -> ([1, T, D], what the step
        read beyond the slots: `KDAStepIO`, or None when it asked for nothing).

        Uniform steps (every chunk `step.row_len` tokens: decode, graphed verification) run the recurrent kernel
        over [N, row_len] (decode reading and writing each state in its slot, `decode_kda_with_gate`); anything else
        the chunked kernel over the packed row (varlen), each sequence from its slot's state. The slots of
        sequences verifying a draft (`step.verify`) are left as they were: their inputs come back for `commit`."""
        _, T, _ = x_1TD.shape
        H, K = self.num_heads, self.head_dim
        x_TD = x_1TD[0]
        vr = step.verify
        exports, tails_in = [], []
        # this forward writes the state of every sequence, or of those not verifying a draft (maybe none)
        writes = vr is None or vr.others is not None
        own = (lambda x: x) if vr is None else (lambda x: x[vr.others])  # noqa: E731

        def conv(mod: ShortConvolution, proj: nn.Linear, tails: Tensor) -> Tensor:
            if step.decode_only and step.export_pick is None:
                # one token per sequence: its window is the slot's tail and the new input, in one fused op
                return mod.decode(proj(x_TD), tails, step.slots).view(1, T, H, K)
            ext_XP = torch.cat([proj(x_TD), tails[step.slots].flatten(0, 1)])
            out_TP = mod.gathered(ext_XP, step.conv_index)
            if step.export_pick is not None:
                exports.append(ext_XP[step.export_tail_index])
            if vr is not None:
                tails_in.append(ext_XP[vr.tail_rows])
            if writes:
                tails.index_copy_(0, own(step.slots), ext_XP[own(step.tail_index)])
            return out_TP.view(1, T, H, K)

        q, k, v = (conv(m, p, t) for m, p, t in ((self.q_conv1d, self.q_proj, pool.conv_q),
                                                   (self.k_conv1d, self.k_proj, pool.conv_k),
                                                   (self.v_conv1d, self.v_proj, pool.conv_v)))
        g = self.f_b_proj(self.f_a_proj(x_1TD)).view(1, T, H, K)
        beta = self.b_proj(x_1TD).float()
        if step.row_len == 1 and vr is None and step.export_pick is None:
            # decode: each row's state read from its slot and written back there by the kernel itself
            N = step.slots.shape[0]
            o = decode_kda_with_gate(*(t.view(N, 1, *t.shape[2:]) for t in (q, k, v, g, beta)), self.A_log,
                                     self.dt_bias, lower_bound=self.lower_bound, scale=K**-0.5,
                                     states=pool.recurrent, slots=step.slots)
            o = self.o_norm(o.reshape(1, T, H, K), self.g_proj(x_1TD).view(1, T, H, K))
            return self.o_proj(o.reshape(1, T, H * K)), None
        state0 = pool.recurrent[step.slots]
        kw = dict(lower_bound=self.lower_bound, scale=K**-0.5, initial_state=state0)
        if step.row_len:  # N rows of row_len tokens each
            N = step.slots.shape[0]
            o, state = recurrent_kda_with_gate(*(t.view(N, step.row_len, *t.shape[2:]) for t in (q, k, v, g, beta)),
                                               self.A_log, self.dt_bias, output_final_state=True, **kw)
            o = o.reshape(1, T, H, K)
            inner = state.new_empty(0, *state.shape[1:])
        elif step.checkpoints is not None:
            o, state, inner = chunk_kda_with_gate_checkpoints(q, k, v, g, beta, self.A_log, self.dt_bias,
                                                              offsets=step.checkpoints, cu_seqlens=step.cu_seqlens,
                                                              **kw)
        else:
            o, state = chunk_kda_with_gate(q, k, v, g, beta, self.A_log, self.dt_bias, output_final_state=True,
                                           cu_seqlens=step.cu_seqlens, **kw)
            inner = state.new_empty(0, *state.shape[1:])
        io = None
        if step.export_pick is not None or vr is not None:
            io = KDAStepIO(exports=None if step.export_pick is None else
                           (torch.cat([inner, state])[step.export_pick], *exports),
                           saved=None if vr is None else (*(t[0][vr.rows] for t in (k, v, g, beta)), *tails_in))
        if writes:
            pool.recurrent.index_copy_(0, own(step.slots), own(state).float())
        o = self.o_norm(o, self.g_proj(x_1TD).view(1, T, H, K))
        return self.o_proj(o.reshape(1, T, H * K)), io

    def commit(self, pool: KDAView, saved: tuple[Tensor, ...], slots_N: Tensor, keep_N: Tensor) -> None:
        """After verification: each verifying sequence's slot becomes its state after the first `keep_N[n]`
        tokens of its row. The delta rule runs again from the slot (the forward left it as it was) over the
        saved inputs, the positions past keep masked by a log-decay of 0 and a write strength of 0 (logits of
        -inf through the gate's sigmoids), which leave the state unchanged exactly; the conv tails become the
        W-1 pre-conv inputs ending at keep. `saved`: this layer's `KDAStepIO.saved` of the verifying step."""
        k, v, g, beta, *tails_in = saved
        N, L = k.shape[:2]
        live_NL = torch.arange(L, device=keep_N.device) < keep_N[:, None]
        g = g.masked_fill(~live_NL[..., None, None], float("-inf"))
        beta = beta.masked_fill(~live_NL[..., None], float("-inf"))
        _, state = recurrent_kda_with_gate(k, k, v, g, beta, self.A_log, self.dt_bias, lower_bound=self.lower_bound,
                                           scale=self.head_dim**-0.5, initial_state=pool.recurrent[slots_N],
                                           output_final_state=True)
        pool.recurrent.index_copy_(0, slots_N, state.float())
        W1 = tails_in[0].shape[1] - L  # W-1: row c of tails_in is chunk offset c - (W-1)
        pick = (keep_N[:, None] + torch.arange(W1, device=keep_N.device))[..., None].expand(-1, -1,
                                                                                             tails_in[0].shape[-1])
        for tails, x_NCP in zip((pool.conv_q, pool.conv_k, pool.conv_v), tails_in):
            tails.index_copy_(0, slots_N, x_NCP.gather(1, pick))

    @torch.no_grad()
    def reset_kda_parameters(self) -> None:
        """fla-style init of the fp32 islands: A in [1, 16], dt in [1e-3, 1e-1] (through inverse softplus)."""
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())
        dt = torch.exp(torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(1e-1))).clamp(min=1e-4)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        for conv in (self.q_conv1d, self.k_conv1d, self.v_conv1d):
            bound = conv.weight.shape[-1] ** -0.5
            conv.weight.uniform_(-bound, bound)
