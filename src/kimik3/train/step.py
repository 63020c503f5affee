"""One optimizer step (accumulated micro-batches, clipping, update, balancing) and evaluation.

Loss normalization: each rank's micro-batch loss is its SUM of token CE times W / N, with N the number of
target tokens in the whole global batch (all ranks, all micro-batches; one all-reduce before the forwards)
and W the ranks. FSDP averages gradients over ranks (divides by W), so the update is exactly that of the
global-batch mean loss, independent of how rows are split over ranks and micro-batches.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from kimik3.distributed.env import all_reduce
from kimik3.distributed.expert_parallel import clip_grad_norm_ as ep_clip_grad_norm_
from kimik3.distributed.expert_parallel import expert_group_size
from kimik3.model.moe import Router
from kimik3.ops.optim import grad_norm
from kimik3.train.balancing import Balancer
from kimik3.train.data import MicroBatch
from kimik3.train.optim import Optimizers


@dataclass
class StepResult:
    loss: float  # global-batch mean CE
    grad_norm: float  # before clipping
    tokens: int  # global input tokens of the step
    balance: dict  # Balancer.step() metrics


def autocast(device: torch.device, precision: str):
    """bf16 autocast (fp32 master weights) or nothing."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def keep_routers_fp32(model: nn.Module) -> nn.Module:
    """Run every Router with autocast disabled. Returns `model`.

    Autocast would compute the router's fp32 matmul (`x.float() @ W.float().T`) in bf16; the spec keeps the
    router an fp32 island, and quantile balancing reads its scores, cutoffs and biases in fp32. Like
    activation checkpointing, this replaces the instance's forward and leaves names and hooks unchanged.
    """
    for router in [m for m in model.modules() if isinstance(m, Router)]:
        inner = router.forward

        def forward(x: Tensor, _inner=inner):
            with torch.autocast(x.device.type, enabled=False):
                return _inner(x)

        router.forward = forward
    return model


def clip_and_update(model: nn.Module, optimizers: Optimizers, max_norm: float) -> Tensor:
    """Clip the global gradient norm (over all ranks' shards) to `max_norm` (<= 0: no limit), step the
    optimizers and clear the gradients. Returns the norm before clipping, a device scalar (read it after the
    update is queued, so the host never waits in between).

    With our AdamW (`optimizers.folds_clipping`) the clip costs one read of the gradients for the norm
    (`kimik3.ops.optim.grad_norm`): the update divides each gradient by max(1, (norm + 1e-6) / max_norm),
    torch's clip coefficient inverted, inside its own pass. Otherwise (Muon, sharded parameters, expert
    parallelism) the gradients are clipped in place first, as `torch.nn.utils.clip_grad_norm_` does.
    """
    limit = max_norm if max_norm > 0 else float("inf")
    if expert_group_size(model) is not None:  # expert-parallel: each expert's gradient lives on one rank
        norm = torch.as_tensor(ep_clip_grad_norm_(model, limit))
        optimizers.step()
    else:
        params = [p for p in model.parameters() if p.grad is not None]
        if optimizers.folds_clipping:  # plain tensors only
            norm = grad_norm([p.grad for p in params])
            optimizers.step(grad_scale=((norm + 1e-6) / limit).clamp(min=1.0))
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)  # a DTensor when sharded
            torch.nn.utils.clip_grads_with_norm_(params, limit, norm)
            optimizers.step()
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    optimizers.zero_grad()
    return norm


def optimizer_phase(model: nn.Module, optimizers: Optimizers, balancer: Balancer, max_norm: float
                    ) -> tuple[float, dict]:
    """What follows the last backward of a step: clip + update, then the balancing update (before the next
    forward, spec 4.3). Returns (gradient norm before clipping, balancing metrics); `bench/bench_train.py`
    times exactly this."""
    norm = clip_and_update(model, optimizers, max_norm)
    balance = balancer.step()
    return float(norm), balance


def train_step(model: nn.Module, batches: list[MicroBatch], optimizers: Optimizers, balancer: Balancer, *,
               device: torch.device, precision: str, clip_grad_norm: float, world_size: int) -> StepResult:
    """Forward/backward every micro-batch of this rank, then clip, step the optimizers and the balancer."""
    counts = torch.tensor([sum(b.num_targets for b in batches), sum(b.input_ids.numel() for b in batches)],
                          dtype=torch.float64, device=device)
    all_reduce(counts)
    targets, tokens = max(float(counts[0]), 1.0), int(counts[1])
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    sync = getattr(model, "set_requires_gradient_sync", None)
    for i, mb in enumerate(batches):
        mb = mb.to(device)
        if sync is not None:  # FSDP: reduce-scatter gradients once, after the last micro-batch
            sync(i == len(batches) - 1)
        with balancer.collecting(), autocast(device, precision):
            loss = model(mb.input_ids, mb.labels, mb.cu_seqlens)
        (loss * (world_size / targets)).backward()
        loss_sum += loss.detach().double()
    grad_norm, balance = optimizer_phase(model, optimizers, balancer, clip_grad_norm)
    return StepResult(float(all_reduce(loss_sum)) / targets, grad_norm, tokens, balance)


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[MicroBatch], *, device: torch.device, precision: str) -> dict:
    """Mean CE and perplexity over every rank's validation micro-batches (no balancing statistics).

    Both are NaN when the batches hold no target tokens (e.g. chat rows without an assistant turn): a mean over
    nothing is not a loss, and 0 (ppl 1.0) would read as a perfect model. The trainer logs the NaN and goes on.
    """
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    try:
        for mb in batches:
            mb = mb.to(device)
            with autocast(device, precision):
                total[0] += model(mb.input_ids, mb.labels, mb.cu_seqlens).double()
            total[1] += mb.num_targets
    finally:
        model.train()
    all_reduce(total)
    loss = float(total[0] / total[1]) if total[1] > 0 else math.nan
    return {"eval_loss": loss, "eval_ppl": float(torch.tensor(loss).exp()), "eval_tokens": int(total[1])}
