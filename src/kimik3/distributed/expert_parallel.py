"""Expert parallelism (EP) for the latent MoE: each rank holds E/W routed experts; tokens travel by all-to-all.

Legend: W ranks in the EP group, E routed experts, El = E/W per rank, N tokens on this rank, A active experts
per token, M = N*A routed rows sent, R rows received, L MoE latent width (3584 for K3), F expert width.

`apply_expert_parallel(model, group)` keeps rank r's contiguous experts [r*El, (r+1)*El) of every MoE layer
(`kimik3.checkpoint.sharded.slice_experts`: same class, same parameter names, leading dim El) and replaces that
module's `weights` on the instance, as activation checkpointing replaces a forward: the unchanged
`LatentMoE.forward` then hands `routed_experts` an `ExpertParallelWeights` around the local experts' container.
Router, latent down/up projections, latent norm and shared experts stay replicated and run on every rank's own
tokens. Per MoE layer:

    counts [E]   rows this rank sends to each expert          -> all_to_all (equal splits, El per rank)
    splits       rows to / from each rank, read on the host    (the one host sync per layer: the variable
                                                               split sizes of all_to_all_single are Python ints)
    x [M, L]     z[token] of every (token, slot), sorted by expert (so grouped by owning rank)
    x [R, L]     <- all_to_all: the LATENT rows (L wide, not D) for this rank's experts, by (source, expert)
    y [R, L]     local experts, each row through its one expert (weight 1): the output rounded to the compute
                 dtype, exactly what the single-device experts combine
    y [M, L]     <- all_to_all back, in the sent order; un-permuted to (token, slot)
    r [N, L]     sum over the A slots of w * float(y) in fp32, cast to z's dtype (`reference.combine`)

Each token's slots are summed in ascending expert order, the reference's order, as a plain reduction (no
atomics: deterministic on GPU too). Each expert sees the rows of all ranks in rank order, i.e. the rows of the
single-process batch in the same order, so on CPU the logits equal the single-process model's bit for bit
(tests/distributed/test_expert_parallel.py). Both all-to-alls are differentiable (`all_to_all`): backward sends
the gradients the opposite way, so a rank's expert gradients hold the contributions of every rank's tokens,
and the router weights' gradient stays local. Dense `Experts` train and infer; `MXFP4Experts` infer. All ranks
must run every forward (and backward) together, and a host sync per MoE layer breaks CUDA graphs / compile.

Gradient scaling. Rank s holds n_s tokens; with a per-rank loss l_s, autograd gives non-expert weights the
local dl_s/dtheta and expert e (on one rank) the sum over ALL ranks, sum_s dl_s/dtheta_e, through the
all-to-all backward; no all-reduce is needed for experts. With plain losses l_s = CE_s / N (N global targets),
all-reducing (SUM) the non-expert gradients and leaving the expert ones alone gives the global-mean gradient.
The trainer instead scales l_s = W * CE_s / N because FSDP AVERAGES over its W ranks: then the non-expert
gradients come out right and the expert ones W times too large, so `apply_fsdp` divides expert gradients by
the data-parallel size (a hook before accumulation). This needs EP group == FSDP mesh (EP = DP = W); with
EP < DP the expert replicas would also need their gradients all-reduced (not implemented).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import MethodType

import torch
import torch.distributed as dist
from torch import Tensor, nn

from kimik3.checkpoint import load
from kimik3.checkpoint.sharded import ExpertShard, slice_experts
from kimik3.distributed.env import group_rank
from kimik3.model.moe import LatentMoE
from kimik3.ops.moe import ExpertWeights, reference, routed_experts

# this rank's experts as they run on a single device: (z [R, L], idx [R, 1], w [R, 1], beta, linear_beta) -> [R, L]
LocalExperts = Callable[[Tensor, Tensor, Tensor, float, float], Tensor]


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with variable splits whose backward is the all-to-all with the splits swapped."""

    @staticmethod
    def forward(ctx, x: Tensor, send: list[int], recv: list[int], group) -> Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _exchange(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def _exchange(x: Tensor, send: list[int], recv: list[int], group) -> Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


def all_to_all(x: Tensor, send: list[int], recv: list[int], group=None) -> Tensor:
    """Differentiable all-to-all along dim 0: x [sum(send), ...] (send[j] rows to rank j) -> [sum(recv), ...].

    torch.distributed.nn.functional.all_to_all_single does the same but is deprecated in torch 2.13.
    """
    return _AllToAll.apply(x, send, recv, group)


def routed_experts_ep(z_NL: Tensor, idx_NA: Tensor, w_NA: Tensor, local: LocalExperts, shard: ExpertShard,
                      group, beta: float, linear_beta: float) -> Tensor:
    """The routed experts of one MoE layer over the EP group: same contract as `kimik3.ops.moe.routed_experts`.

    Args:
        z_NL: [N, L] latent tokens (compute dtype); idx_NA [N, A] int64 global expert ids; w_NA [N, A] fp32.
        local: this rank's El experts (local ids), as they run on a single device.
        shard: which experts this rank holds; group: the EP process group (W == shard.world ranks).

    Returns:
        [N, L] in z's dtype: sum over slots of w * expert output (rounded to the compute dtype), fp32 sum.
    """
    (N, A), W, El = idx_NA.shape, shard.world, shard.count
    M = N * A
    e_M = idx_NA.reshape(-1)
    counts_E = torch.bincount(e_M, minlength=shard.num_experts)
    recv_counts_E = torch.empty_like(counts_E)
    dist.all_to_all_single(recv_counts_E, counts_E, group=group)  # viewed [W, El]: rows from rank s for expert j
    # the host sync: all_to_all_single takes its variable split sizes as Python ints
    send, recv = torch.stack([counts_E.view(W, El).sum(1), recv_counts_E.view(W, El).sum(1)]).tolist()
    R = sum(recv)

    _, order_M = torch.sort(e_M, stable=True)  # by expert, hence by owning rank
    x_RL = all_to_all(z_NL[order_M // A], send, recv, group)
    if R > 0:
        e_R = torch.repeat_interleave(torch.arange(El, device=z_NL.device).repeat(W), recv_counts_E, output_size=R)
        ones_R1 = torch.ones(R, 1, dtype=torch.float32, device=z_NL.device)
        y_RL = local(x_RL, e_R[:, None], ones_R1, beta, linear_beta)
    else:
        y_RL = x_RL  # empty, but keeps this rank's backward all-to-alls in the graph
    y_ML = all_to_all(y_RL, recv, send, group)
    slot_of_row = torch.empty_like(order_M).scatter_(0, order_M, torch.arange(M, device=z_NL.device))
    return reference.combine(y_ML[slot_of_row], idx_NA, w_NA)


@dataclass(frozen=True)
class ExpertParallelWeights:
    """This rank's experts (`local`, their single-device container) inside the EP group: `routed_experts_ep`."""
    local: ExpertWeights
    shard: ExpertShard
    group: object

    def routed(self, z: Tensor, topk_idx: Tensor, topk_weight: Tensor, beta: float, linear_beta: float) -> Tensor:
        def local(x, idx, w, b, lb):
            return routed_experts(x, idx, w, self.local, b, lb)

        return routed_experts_ep(z, topk_idx, topk_weight, local, self.shard, self.group, beta, linear_beta)


def apply_expert_parallel(model: nn.Module, group=None) -> nn.Module:
    """Shard every MoE layer's routed experts over `group` (default: all ranks) and route tokens to them.

    In place; returns `model`. A model loaded with `expert_shard` for this rank is not cut again; applying
    twice is a no-op. Apply before activation checkpointing and FSDP (`parallelize` keeps that order), and
    pack MXFP4 experts (`pack_experts`) before, not after.

    Raises:
        ValueError: no process group, or num_experts not divisible by the group size.
    """
    slice_experts(model, *group_rank(group, "expert parallelism"))
    for moe in [m for m in model.modules() if isinstance(m, LatentMoE)]:
        if not getattr(moe.experts, "_kimik3_expert_parallel", False):
            # bound to the module (a deepcopy rebinds to the copy's experts); the group rides in the partial,
            # which deepcopy shares (a ProcessGroup cannot be copied)
            moe.experts.weights = MethodType(partial(_weights, group=group), moe.experts)
            moe.experts._kimik3_expert_parallel = True
    return model


def _weights(experts: nn.Module, *, group) -> ExpertParallelWeights:
    # the class's single-device container, on the local slice
    return ExpertParallelWeights(type(experts).weights(experts), experts.expert_shard, group)


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of expert-sharded routed experts (each lives on one rank: not data-parallel)."""
    return [p for m in model.modules() if getattr(m, "expert_shard", None) is not None
            for p in m.parameters(recurse=False)]


def expert_group_size(model: nn.Module) -> int | None:
    """The EP world size of `model`'s sharded experts, or None when they are not sharded."""
    worlds = {m.expert_shard.world for m in model.modules() if getattr(m, "expert_shard", None) is not None}
    assert len(worlds) <= 1, worlds
    return worlds.pop() if worlds else None


def scale_expert_gradients(model: nn.Module, factor: float) -> None:
    """Multiply every gradient reaching a sharded expert parameter by `factor`, before it is accumulated."""
    for p in expert_parameters(model):
        p.register_hook(lambda g, f=factor: g * f)


def clip_grad_norm_(model: nn.Module, max_norm: float, group=None) -> float:
    """Clip the global gradient norm of an EP (+ FSDP) model; returns the norm before clipping.

    torch's clip_grad_norm_ cannot mix FSDP's DTensor gradients with the plain expert gradients, and would
    count only this rank's experts: here the experts' squared norm is summed over the EP `group` first.
    """
    experts = {id(p) for p in expert_parameters(model)}
    params = [p for p in model.parameters() if p.grad is not None]
    dense = [p.grad for p in params if id(p) not in experts]
    local = [p.grad for p in params if id(p) in experts]
    sq = torch.zeros(2, dtype=torch.float64, device=params[0].device if params else None)
    if dense:
        norm = torch.nn.utils.get_total_norm(dense)
        sq[0] = (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).double().square()
    if local:
        sq[1] = torch.nn.utils.get_total_norm(local).double().square()
    dist.all_reduce(sq[1:], group=group)  # each expert's gradient lives on exactly one rank
    total = float(sq.sum().sqrt())
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:
        for g in dense + local:
            g.mul_(coef)
    return total


def load_expert_parallel(path: str | Path, group=None, **load_kwargs) -> nn.Module:
    """`kimik3.checkpoint.load` reading only this rank's experts, then `apply_expert_parallel` (ready to run).

    `load_kwargs` are `load`'s (dtype, device, text_only, keep_experts_packed, quiet).
    """
    shard = group_rank(group, "load_expert_parallel")
    return apply_expert_parallel(load(path, expert_shard=shard, **load_kwargs), group)
