"""Optimizers (AdamW, or Muon for hidden matrices + AdamW for the rest) and the learning-rate schedule.

Parameter groups, by name and shape:
    muon   (optim.name = "muon"): 2-D weights with both dims > 1, except the embedding and the LM head
           (Muon orthogonalizes whole matrices; embeddings/heads and vectors are not hidden-layer maps)
    decay  : the remaining matrices and stacked experts (ndim >= 2), AdamW with weight decay
    plain  : norms, KDA A_log / dt_bias / short-conv kernels, AttnRes pseudo-queries: AdamW, no decay
Muon uses torch.optim.Muon with `adjust_lr_fn="match_rms_adamw"` (Moonlight's scaling), so one `optim.lr`
serves both optimizers. The stacked routed experts [E, F, L] are 3-D and stay with AdamW.

AdamW is torch's fused implementation: one kernel pass per parameter chunk reads param, grad and both moments
once (measured on the 4-layer real-dims slice, H200: 95.7 ms against 235 ms for the foreach default). Gradient
clipping folds into that pass: the fused kernel divides each gradient by its `grad_scale` (the hook
GradScaler uses), so `Optimizers.step(grad_scale=max(1, norm / max_norm))` clips without a pass of its own.

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

NO_DECAY_SUFFIXES = ("norm.weight", "A_log", "dt_bias", "conv1d.weight", "_res_proj.weight")
NOT_MUON = ("embed_tokens.weight", "lm_head.weight")


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
        """Whether `step(grad_scale=...)` applies the scale inside the update (every optimizer is a fused AdamW
        over plain tensors, groups resumed from a foreach checkpoint included); otherwise the caller clips the
        gradients first."""
        return all(isinstance(o, torch.optim.AdamW) and all(g.get("fused") for g in o.param_groups)
                   for o in self.optimizers)

    def step(self, grad_scale: torch.Tensor | None = None) -> None:
        """One update of every optimizer. `grad_scale` (a scalar tensor on the parameters' device, needs
        `folds_clipping`): every gradient is divided by it inside the fused update, as if clipped beforehand."""
        if grad_scale is not None and not self.folds_clipping:
            raise ValueError("grad_scale needs fused AdamW optimizers over unsharded parameters (folds_clipping)")
        for o in self.optimizers:
            o.grad_scale = grad_scale  # read by fused AdamW's step (torch.optim.adam._fused_adam); None: unscaled
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
    opts: list[torch.optim.Optimizer] = [torch.optim.AdamW(adam_groups, lr=lr, betas=betas, eps=eps,
                                                           fused=_fused_ok(adam_groups))]
    if groups["muon"]:
        opts.append(torch.optim.Muon([p for _, p in groups["muon"]], lr=lr, weight_decay=weight_decay,
                                     momentum=muon_momentum, adjust_lr_fn="match_rms_adamw"))
    for o in opts:
        for g in o.param_groups:
            g["base_lr"] = g["lr"]
    return Optimizers(opts)


def _is_sharded(p: torch.Tensor) -> bool:
    return hasattr(p, "full_tensor")  # a DTensor (FSDP2 / tensor parallel)


def _fused_ok(groups: list[dict]) -> bool:
    """Fused AdamW for floating-point parameters on CUDA or CPU. Sharded (DTensor) parameters keep the foreach
    default: the fused kernel's DTensor support is not exercised by any test or device run here yet."""
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
