"""The latent mixture of experts (`block_sparse_moe`, layers 1..92).

Legend: N tokens, D hidden, L latent width, F expert width, E experts, A active experts per token.

    scores = sigmoid(x @ gate.weight^T)               fp32, on the full-width hidden state
    idx    = top-A of (scores + e_score_correction_bias)   the bias only selects
    w      = scores[idx] / sum * routed_scaling_factor     fp32
    r      = up( norm( sum_i w_i * expert_i( down(x) ) ) )  experts run in the latent width L
    out    = r + shared_experts(x)
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kimik3.config import TextConfig
from kimik3.model.mlp import MLP
from kimik3.model.norm import RMSNorm
from kimik3.ops.moe import (
    DenseWeights,
    ExpertWeights,
    PackedWeights,
    RelaidWeights,
    compile_relaid,
    routed_experts,
    warm_relaid,
)
from kimik3.ops.moe.cache import ExpertCache
from kimik3.ops.moe.tiered import HostTier, TieredWeights
from kimik3.ops.mxfp4 import packed_shapes
from kimik3.ops.router import route, router_logits


class Router(nn.Module):
    """Sigmoid router with a selection-only correction bias (a buffer: balancing updates it, not gradients)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, renormalize: bool, scaling: float,
                 dtype: torch.dtype | None = None):
        super().__init__()
        self.top_k, self.renormalize, self.scaling = top_k, renormalize, scaling
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))

    def forward(self, x_ND: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Returns (topk_idx [N, A] int64, topk_weight [N, A] fp32, scores [N, E] fp32)."""
        # fp32 logits of exact products; with bf16 x and weight on CUDA one tensor-core GEMM adds them in another
        # order than the fp32 reference (the bound: `kimik3.ops.router`). A score moves by at most 1/4 of its
        # logit's error, so routing can differ from the reference's only on near-ties: a token whose A-th and
        # (A+1)-th biased scores lie that close may pick the other expert, as two fp32 summation orders could.
        # The correction bias still only selects, and QB balancing reads these scores as before.
        return route(router_logits(x_ND, self.weight), self.e_score_correction_bias, self.top_k, self.renormalize,
                     self.scaling)


class RoutedExperts(nn.Module):
    """What every holder of a layer's routed experts shares: it owns the tensors under their checkpoint names, and
    its `weights()` hands them to `kimik3.ops.moe.routed_experts` as the container that says how they are held
    (dense, packed, re-laid out, tiered, with adapters). The forward is that one call: PEFT's parameter
    targets and expert parallelism hook the module or its `weights`, never a forward of their own."""

    def weights(self) -> ExpertWeights:
        raise NotImplementedError

    def forward(self, z_NL: Tensor, idx_NA: Tensor, w_NA: Tensor, beta: float, linear_beta: float) -> Tensor:
        return routed_experts(z_NL, idx_NA, w_NA, self.weights(), beta, linear_beta)


class Experts(RoutedExperts):
    """The E routed experts, stacked: w1 (gate) and w3 (up) [E, F, L], w2 (down) [E, L, F].

    The checkpoint stores them per expert (`experts.{e}.w1.weight_packed` ...); the key map unstacks them.
    """

    def __init__(self, num_experts: int, latent: int, width: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, width, latent, dtype=dtype))
        self.w3 = nn.Parameter(torch.empty(num_experts, width, latent, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty(num_experts, latent, width, dtype=dtype))

    def weights(self) -> ExpertWeights:
        return DenseWeights(self.w1, self.w3, self.w2)


class MXFP4Experts(RoutedExperts):
    """The routed experts kept MXFP4-packed in memory (W4A16): `w{1,3,2}_packed` uint8 [E, out, in/2] and
    `w{1,3,2}_scale` uint8 E8M0 [E, out, in/32], buffers (packed weights are not trained).

    Same math as `Experts` on the exactly dequantized weights; built by `kimik3.quant.pack_experts`.
    """

    def __init__(self, num_experts: int, latent: int, width: int):
        super().__init__()
        for name, (out, inp) in (("w1", (width, latent)), ("w3", (width, latent)), ("w2", (latent, width))):
            (p_shape, s_shape) = packed_shapes(out, inp)
            self.register_buffer(f"{name}_packed", torch.empty(num_experts, *p_shape, dtype=torch.uint8))
            self.register_buffer(f"{name}_scale", torch.empty(num_experts, *s_shape, dtype=torch.uint8))

    def weights(self) -> PackedWeights:
        return packed_weights(self)


def packed_weights(module: nn.Module) -> PackedWeights:
    """The `w{1,3,2}_packed` / `w{1,3,2}_scale` buffers of `module` (an expert holder over packed experts)."""
    return PackedWeights(tuple(getattr(module, f"{p}_packed") for p in ("w1", "w3", "w2")),
                         tuple(getattr(module, f"{p}_scale") for p in ("w1", "w3", "w2")))


class RelaidExperts(RoutedExperts):
    """The routed experts in Humming's MoE GEMM layout (`kimik3.ops.moe.RelaidWeights`), built by
    `kimik3.quant.relayout_experts` from an `MXFP4Experts` whose stored codes it replaces: inference only, bf16
    on Hopper.

    Not a checkpoint layout (Humming has no inverse transform): saving it raises instead of writing something
    `kimik3.load` could not read.
    """

    def __init__(self, relaid: RelaidWeights):
        super().__init__()
        self.relaid = relaid

    def weights(self) -> RelaidWeights:
        return self.relaid

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        raise RuntimeError(f"{prefix or 'experts.'}: the routed experts were re-laid out for Humming's kernels "
                           "(relayout_experts, for inference) and cannot be saved; load the checkpoint again to "
                           "save or convert it")

    def extra_repr(self) -> str:
        return f"experts={self.relaid.num_experts}, width={self.relaid.width}, layout=humming"


class TieredExperts(RoutedExperts):
    """The routed experts in two tiers (`kimik3.ops.moe.tiered`), built by `kimik3.placement.tier_experts`: the
    checkpoint's `w{1,3,2}_packed` / `_scale` buffers hold all E experts in host memory (pinned beside a GPU), and
    `slots` (not saved) the device's cache of S of them; `cache` says which, `tier` is shared by the model's layers.

    The tiers stay where they were placed: moving the model (`.to`, `to_empty`, `allocate`) leaves this module alone.
    """

    def __init__(self, host: PackedWeights, slots: PackedWeights, cache: ExpertCache, tier: HostTier):
        super().__init__()
        for name, p, s in zip(("w1", "w3", "w2"), host.packed, host.scales):
            self.register_buffer(f"{name}_packed", p)
            self.register_buffer(f"{name}_scale", s)
        self.slots, self.cache, self.tier = slots, cache, tier

    def weights(self) -> TieredWeights:
        return TieredWeights(packed_weights(self), self.slots, self.cache, self.tier)

    def _apply(self, fn, recurse=True):
        return self

    def extra_repr(self) -> str:
        return f"experts={self.cache.num_experts}, slots={self.cache.num_slots}, layout=mxfp4, tiered"


class LatentMoE(nn.Module):
    def __init__(self, cfg: TextConfig, dtype: torch.dtype | None = None):
        super().__init__()
        m, D = cfg.moe, cfg.hidden_size
        self.beta, self.linear_beta = cfg.situ_beta, cfg.situ_linear_beta
        self.gate = Router(D, m.num_experts, m.num_experts_per_token, m.renormalize, m.routed_scaling_factor, dtype)
        self.routed_expert_down_proj = nn.Linear(D, m.latent_dim, bias=False, dtype=dtype)
        self.experts = Experts(m.num_experts, m.latent_dim, m.expert_dim, dtype)
        self.routed_expert_norm = RMSNorm(m.latent_dim, cfg.rms_norm_eps, dtype) if m.use_latent_norm else None
        self.routed_expert_up_proj = nn.Linear(m.latent_dim, D, bias=False, dtype=dtype)
        self.shared_experts = MLP(D, m.shared_dim, cfg.situ_beta, cfg.situ_linear_beta, dtype)

    def forward(self, x: Tensor) -> Tensor:
        x_ND = x.reshape(-1, x.shape[-1])
        idx_NA, w_NA, _ = self.gate(x_ND)
        z_NL = self.routed_expert_down_proj(x_ND)
        r_NL = self.experts(z_NL, idx_NA, w_NA, self.beta, self.linear_beta)
        if self.routed_expert_norm is not None:
            r_NL = self.routed_expert_norm(r_NL)
        out_ND = self.routed_expert_up_proj(r_NL) + self.shared_experts(x_ND)
        return out_ND.view(x.shape)


def _relaid(model: nn.Module):
    """(experts, top_k, the layer's dtype and device) of each distinct expert shape in Humming's layout (the
    compiled kernels are shared by the layers)."""
    done = set()
    for m in model.modules():
        if isinstance(m, LatentMoE) and isinstance(m.experts, RelaidExperts):
            r = m.experts.relaid
            key = (r.num_experts, r.width, m.gate.top_k)
            if key not in done:
                done.add(key)
                w = m.routed_expert_down_proj.weight
                yield r, m.gate.top_k, w.dtype, w.device


def compile_experts(model: nn.Module, max_tokens: int) -> int:
    """Compile, without running them, the routed-expert kernels every step of up to `max_tokens` tokens meets
    (`kimik3.ops.moe.compile_relaid`); returns how many were asked for (0: no experts in Humming's layout)."""
    return sum(compile_relaid(r, max_tokens, top_k, device) for r, top_k, _, device in _relaid(model))


def warm_experts(model: nn.Module, max_tokens: int) -> int:
    """Compile side by side, then run once each, the routed-expert kernels every step of up to `max_tokens` tokens
    meets (Humming's tile configs, `kimik3.ops.moe.warm_relaid`); returns the calls made (0: no experts in
    Humming's layout, nothing compiles per row count)."""
    return sum(warm_relaid(r, max_tokens, top_k, dtype, device) for r, top_k, dtype, device in _relaid(model))

