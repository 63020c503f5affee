"""Optimizers (AdamW, or Muon for hidden matrices + AdamW for the rest) and the learning-rate schedule.

Parameter groups, by name and shape:
    muon   (optim.name = "muon"): 2-D weights with both dims > 1, except the embedding and the LM head
           (Muon orthogonalizes whole matrices; embeddings/heads and vectors are not hidden-layer maps)
    decay  : the remaining matrices and stacked experts (ndim >= 2), AdamW with weight decay
    plain  : norms, KDA A_log / dt_bias / short-conv kernels, AttnRes pseudo-queries: AdamW, no decay
Muon uses torch.optim.Muon with `adjust_lr_fn="match_rms_adamw"` (Moonlight's scaling), so one `optim.lr`
serves both optimizers. The stacked routed experts [E, F, L] are 3-D and stay with AdamW.

AdamW over plain (unsharded) tensors is `AdamW` below: torch's optimizer -- its hyper-parameters, states and
state_dict, so checkpoints move between the two both ways -- whose step is `kimik3.ops.optim.adamw_update_`,
one pass per parameter that reads param, grad and both moments once and writes param and the moments once.
Gradient clipping folds into that pass: `Optimizers.step(grad_scale=max(1, norm / max_norm))` divides each
gradient by the scale inside the update, read on the device. (torch's fused AdamW takes the same `grad_scale`
but writes every unscaled gradient back; docs/training.md has the two measured against each other.) Sharded
(DTensor) parameters keep torch's foreach AdamW.

Schedule (step = 1-based optimizer step, S = train.steps, W = warmup_steps, m = min_lr_ratio):
    warmup:  lr * step / W                                         for step <= W
    cosine:  lr * (m + (1 - m) * (1 + cos(pi * p)) / 2), p = (step - W) / (S - W)
    wsd:     lr until the last decay_fraction of S, then linear down to lr * m
    constant: lr
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kimik3.ops.optim import adamw_update_

NO_DECAY_SUFFIXES = ("norm.weight", "A_log", "dt_bias", "conv1d.weight", "_res_proj.weight")
NOT_MUON = ("embed_tokens.weight", "lm_head.weight")


class AdamW(torch.optim.AdamW):
    """torch's AdamW (decoupled weight decay; no amsgrad, maximize, capturable) whose step is one
    `adamw_update_` per parameter: the Triton pass on CUDA, its torch reference elsewhere.

    States are torch's non-fused ones (`step` a CPU fp32 scalar, the moments in the parameter's dtype), so
    `state_dict()` loads into torch's AdamW and back. A step counter resumed from a fused or capturable
    checkpoint (a device tensor) is moved to the host once, at the first step. `grad_scale` (set by
    `Optimizers.step`) divides every gradient inside the update.
    """

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float, weight_decay: float = 0.01):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)
        self.grad_scale: torch.Tensor | None = None

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group.get("amsgrad") or group.get("maximize") or group.get("capturable"):
                raise ValueError("kimik3's AdamW has no amsgrad, maximize or capturable mode")
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                elif state["step"].device.type != "cpu":
                    state["step"] = state["step"].to("cpu", torch.float32)
                state["step"] += 1
                adamw_update_(p, p.grad, state["exp_avg"], state["exp_avg_sq"], step=int(state["step"]),
                              lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"],
                              weight_decay=group["weight_decay"], grad_scale=self.grad_scale)
        return loss


def param_groups(model: nn.Module, use_muon: bool) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """Named trainable parameters split into "muon", "decay" and "plain" (see the module docstring)."""
    groups: dict[str, list[tuple[str, nn.Parameter]]] = {"muon": [], "decay": [], "plain": []}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if use_muon and p.ndim == 2 and min(p.shape) > 1 and not name.endswith(NOT_MUON):
            groups["muon"].append((name, p))
        elif p.ndim >= 2 and not name.endswith(NO_DECAY_SUFFIXES):
            groups["decay"].append((name, p))
        else:
            groups["plain"].append((name, p))
    return groups


class Optimizers:
    """One or two torch optimizers behind the few methods the trainer uses; groups carry `base_lr`."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def folds_clipping(self) -> bool:
        """Whether `step(grad_scale=...)` applies the scale inside the update (every optimizer is our `AdamW`
        over plain tensors); otherwise the caller clips the gradients first."""
        return all(isinstance(o, AdamW) for o in self.optimizers)

    def step(self, grad_scale: torch.Tensor | None = None) -> None:
        """One update of every optimizer. `grad_scale` (a scalar tensor on the parameters' device, needs
        `folds_clipping`): every gradient is divided by it inside the fused update, as if clipped beforehand."""
        if grad_scale is not None and not self.folds_clipping:
            raise ValueError("grad_scale needs kimik3 AdamW optimizers over unsharded parameters (folds_clipping)")
        for o in self.optimizers:
            o.grad_scale = grad_scale  # read by AdamW.step; None: unscaled
            try:
                o.step()
            finally:
                o.grad_scale = None

    def zero_grad(self) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=True)

    def state_dict(self) -> list[dict]:
        return [o.state_dict() for o in self.optimizers]

    def load_state_dict(self, states: list[dict]) -> None:
        if len(states) != len(self.optimizers):
            raise ValueError(f"checkpoint holds {len(states)} optimizer states, this run builds "
                             f"{len(self.optimizers)} (optim.name changed?)")
        for o, s in zip(self.optimizers, states):
            o.load_state_dict(s)

    def set_lr(self, factor: float) -> None:
        for g in self.param_groups:
            g["lr"] = g["base_lr"] * factor


def build_optimizer(model: nn.Module, name: str, lr: float, weight_decay: float, betas: tuple[float, float],
                    eps: float, muon_momentum: float = 0.95) -> Optimizers:
    """AdamW, or Muon + AdamW, over `param_groups`; every group remembers its peak lr as `base_lr`."""
    if name not in ("adamw", "muon"):
        raise ValueError(f"optim.name must be 'adamw' or 'muon', got {name!r}")
    groups = param_groups(model, use_muon=name == "muon")
    adam_groups = [{"params": [p for _, p in groups["decay"]], "weight_decay": weight_decay},
                   {"params": [p for _, p in groups["plain"]], "weight_decay": 0.0}]
    adam_groups = [g for g in adam_groups if g["params"]]
    adamw = AdamW if _plain(adam_groups) else torch.optim.AdamW  # sharded: torch's foreach default
    opts: list[torch.optim.Optimizer] = [adamw(adam_groups, lr=lr, betas=betas, eps=eps)]
    if groups["muon"]:
        opts.append(torch.optim.Muon([p for _, p in groups["muon"]], lr=lr, weight_decay=weight_decay,
                                     momentum=muon_momentum, adjust_lr_fn="match_rms_adamw"))
    for o in opts:
        for g in o.param_groups:
            g["base_lr"] = g["lr"]
    return Optimizers(opts)


def _is_sharded(p: torch.Tensor) -> bool:
    return hasattr(p, "full_tensor")  # a DTensor (FSDP2 / tensor parallel)


def _plain(groups: list[dict]) -> bool:
    """Our AdamW for floating-point parameters on CUDA or CPU. Sharded (DTensor) parameters keep torch's foreach
    AdamW: the update indexes each parameter as one local flat array."""
    params = [p for g in groups for p in g["params"]]
    return bool(params) and all(p.is_floating_point() and p.device.type in ("cuda", "cpu") and not _is_sharded(p)
                                for p in params)


def lr_factor(step: int, total: int, warmup: int, schedule: str, min_ratio: float, decay_fraction: float) -> float:
    """The multiplier of the peak lr at 1-based optimizer `step` (see the module docstring)."""
    if warmup > 0 and step <= warmup:
        return step / warmup
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        p = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * p))
    if schedule == "wsd":
        decay_steps = max(1, round(decay_fraction * total))
        start = total - decay_steps
        if step <= start:
            return 1.0
        return 1.0 - (1 - min_ratio) * min(1.0, (step - start) / decay_steps)
    raise ValueError(f"optim.schedule must be 'cosine', 'wsd' or 'constant', got {schedule!r}")
