"""Router load balancing: quantile balancing (QB, what K3 trains with) and the DeepSeek sign rule.

Spec: shared/spec/quantile-balancing.md. Legend: N tokens, E routed experts (n), A = k experts per token,
B histogram bins, M MoE layers. Per MoE layer and optimizer step t, with the bias b(t) in force:

    s      = sigmoid(router logits)                   fp32 [N, E], captured by a forward hook on `Router`
    alpha  = (k+1)-th largest of s + b(t)             per token: the cutoff (one Top-(k+1))
    r      = alpha - s                                the bias expert j would need to enter token i's top-k
    qb:    b~_j = the (k/n)-quantile of r[:, j] over the GLOBAL batch, read from a histogram of r on
           [min(b) - 1, max(b) + 1] (B bins, linear interpolation in the target bin; App. D)
    qb_exact: b~_j = the (floor(q) + 1)-th smallest r[:, j]      (single process; tests)
    b(t+1) = b~ - mean(b~)                            replace, then centre (Eq. 14); optional EMA
    sign:  b(t+1) = centre(b + gamma * sign(mean(load) - load))   (DeepSeek loss-free, gamma 1e-3)

The bias is the `e_score_correction_bias` buffer: it selects experts only, never gets a gradient, and is
saved with the weights, so it is the whole balancing state. Statistics are accumulated during training
forwards only (inside `Balancer.collecting()`; never in eval or in an activation-checkpoint recompute, which
runs during backward), reduced with ONE all_reduce(SUM) per step over the data-parallel group, and every rank
derives the same bias from the same integer counts.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from kimik3.model.moe import Router

METHODS = ("qb", "qb_exact", "sign", "frozen")
_CHUNK = 4096  # tokens binned at a time: the bin-index tensor is [chunk, E]


def route_with_cutoff(scores_NE: Tensor, bias_E: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """One Top-(k+1) of s + b: (experts [N, k] int64, cutoff alpha [N] = the (k+1)-th value, fp32 or fp64)."""
    if not 0 < k < scores_NE.shape[-1]:
        raise ValueError(f"balancing needs 0 < k < experts, got k={k}, experts={scores_NE.shape[-1]}")
    dtype = torch.promote_types(scores_NE.dtype, torch.float32)  # fp32, or fp64 in tests
    vals, idx = torch.topk(scores_NE.to(dtype) + bias_E.to(dtype), k + 1, dim=-1, sorted=True)
    return idx[:, :k], vals[:, k]


def centre(b: Tensor) -> Tensor:
    """Remove the common offset (it cannot change any top-k)."""
    return b - b.mean()


def exact_quantile(required_NE: Tensor, k: int) -> Tensor:
    """b~_j = the (floor(q)+1)-th smallest r[:, j] of required biases r [N, E], q = N k / E (not centred)."""
    N, E = required_NE.shape
    order = (N * k) // E + 1  # floor(q) + 1 <= N because k < E
    return torch.kthvalue(required_NE, order, dim=0).values


def qb_update_exact(required_NE: Tensor, k: int) -> Tensor:
    """Eq. 14 with the exact order statistic: centre(exact_quantile(r, k))."""
    return centre(exact_quantile(required_NE, k))


def qb_histogram(scores_NE: Tensor, cutoff_N: Tensor, lo: float | Tensor, hi: float | Tensor, bins: int,
                 out_EB: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Add each r = alpha - s to its expert's histogram on [lo, hi) with `bins` equal bins.

    Returns (counts [E, bins], the number of r outside [lo, hi) that were clamped into an end bin, an int64
    device scalar). Every row gains exactly N counts. `out_EB` (int64 or int32) is accumulated into in place
    when given. `lo` and `hi` may be device scalars: nothing here waits on the host (it runs in a forward hook).
    """
    N, E = scores_NE.shape
    out_EB = torch.zeros(E, bins, dtype=torch.int64, device=scores_NE.device) if out_EB is None else out_EB
    width = (hi - lo) / bins
    clamped = torch.zeros((), dtype=torch.int64, device=scores_NE.device)
    offsets_E = torch.arange(E, device=scores_NE.device) * bins
    for start in range(0, N, _CHUNK):
        r_nE = cutoff_N[start:start + _CHUNK, None].float() - scores_NE[start:start + _CHUNK].float()
        raw = torch.floor((r_nE - lo) / width)
        clamped += ((raw < 0) | (raw > bins - 1)).sum()
        flat = (raw.clamp(0, bins - 1).long() + offsets_E).flatten()
        out_EB.view(-1).add_(torch.bincount(flat, minlength=E * bins).to(out_EB.dtype))
    return out_EB, clamped


def histogram_quantile(counts_EB: Tensor, k: int, lo: float, hi: float) -> Tensor:
    """App. D recovery: per expert, the first bin whose cumulative count reaches ceil(q), interpolated.

    b~_j = lo + (l_j + clip((q - c_j) / max(h_j, 1), 0, 1)) * w, with c_j the count below bin l_j, h_j its
    count, q = m k / E, m the tokens (row sum). Returns b~ fp64 [E], not centred. Arithmetic in fp64: q and
    the counts of a global batch exceed fp32's exact integers.
    """
    E, bins = counts_EB.shape
    H = counts_EB.double()
    m = counts_EB[0].sum()  # int64 device scalar: no host read
    q = (m * k).double() / E
    cum_EB = H.cumsum(-1)
    target = torch.div(m * k + E - 1, E, rounding_mode="floor").double().expand(E, 1).contiguous()  # ceil(q)
    ell = torch.searchsorted(cum_EB, target).clamp(max=bins - 1)  # [E, 1]
    h = H.gather(-1, ell)
    c = cum_EB.gather(-1, ell) - h
    frac = ((q - c) / h.clamp(min=1)).clamp(0, 1)
    width = (hi - lo) / bins
    return (lo + (ell + frac) * width).squeeze(-1)


def qb_update_from_histogram(counts_EB: Tensor, k: int, lo: float, hi: float) -> Tensor:
    """Eq. 14 with the histogram estimate: centre(histogram_quantile(...)), fp32 [E]."""
    return centre(histogram_quantile(counts_EB, k, lo, hi)).float()


def sign_update(loads_E: Tensor, bias_E: Tensor, gamma: float) -> Tensor:
    """DeepSeek loss-free: b + gamma * sign(mean(load) - load), centred (spec 7.12)."""
    loads = loads_E.double()
    return centre(bias_E.double() + gamma * torch.sign(loads.mean() - loads)).float()


LOAD_METRICS = ("max_mean", "maxvio", "min_mean", "cv", "dead")


def load_stats(loads_E: Tensor) -> Tensor:
    """`load_metrics` as one fp64 device vector, in LOAD_METRICS order (no host read)."""
    loads = loads_E.double()
    mean = loads.mean().clamp(min=1e-12)
    mx = loads.max() / mean
    return torch.stack([mx, mx - 1, loads.min() / mean, loads.std(unbiased=False) / mean, (loads_E == 0).sum()])


def load_metrics(loads_E: Tensor) -> dict[str, float]:
    """Spec 5.1 from global routed counts: max/mean, MaxVio, min/mean, coefficient of variation, dead experts."""
    out = dict(zip(LOAD_METRICS, load_stats(loads_E).tolist()))
    out["dead"] = int(out["dead"])
    return out


@dataclass
class _LayerStats:
    """One MoE layer's statistics for the current step (transient, zeroed after each update)."""

    name: str
    router: Router
    hist: Tensor | None = None  # [E, B] counts of r
    loads: Tensor | None = None  # [E] routed counts
    required: list[Tensor] = field(default_factory=list)  # qb_exact: r chunks [n, E]
    clamped: Tensor | int = 0  # int64 device scalar once counted
    lo: Tensor | None = None  # the histogram range (device scalars), fixed for the step from the bias in force
    hi: Tensor | None = None


class Balancer:
    """Owns per-layer statistics, the forward hooks on every `Router`, the DP reduction and the bias update.

    Use: `with balancer.collecting(): loss = forward(...)` for each training micro-batch (backward outside the
    block), then `metrics = balancer.step()` once per optimizer step, before the next forward.

    Args:
        model: any module containing `Router`s (hooks are attached to each; the model is not modified).
        method: "qb" (histogram, the K3 method), "qb_exact" (order statistic, single process),
            "sign" (DeepSeek), "frozen" (statistics and metrics only).
        bins, ema: QB histogram bins (1000) and the optional EMA weight of the old bias (0 = Eq. 14).
        sign_gamma: the sign rule's step (1e-3).
        group: the process group that holds distinct tokens (default: the world, when initialized).
    """

    def __init__(self, model: nn.Module, method: str = "qb", bins: int = 1000, ema: float = 0.0,
                 sign_gamma: float = 1e-3, group=None):
        if method not in METHODS:
            raise ValueError(f"balancing.method must be one of {METHODS}, got {method!r}")
        if not 0.0 <= ema < 1.0:
            raise ValueError(f"balancing.ema must be in [0, 1), got {ema}")
        if bins < 2:
            raise ValueError(f"balancing.bins must be >= 2, got {bins}")
        self.method, self.bins, self.ema, self.sign_gamma, self.group = method, bins, ema, sign_gamma, group
        if method == "qb_exact" and self._world() > 1:
            raise ValueError("balancing.method 'qb_exact' is single-process only; use 'qb' with data parallel")
        self.layers = [_LayerStats(name, mod) for name, mod in model.named_modules() if isinstance(mod, Router)]
        self._handles = [s.router.register_forward_hook(self._hook(s)) for s in self.layers]
        self._collecting = False
        self._warned = False

    def _world(self) -> int:
        return dist.get_world_size(self.group) if dist.is_available() and dist.is_initialized() else 1

    @contextlib.contextmanager
    def collecting(self) -> Iterator[None]:
        """Accumulate routing statistics for the forwards inside this block (training micro-batches only)."""
        self._collecting = True
        try:
            yield
        finally:
            self._collecting = False

    def _hook(self, st: _LayerStats):
        def hook(module: Router, args, output) -> None:
            if not (self._collecting and module.training and torch.is_grad_enabled()):
                return
            with torch.no_grad():
                self._accumulate(st, module, output[0], output[2].detach())
        return hook

    def _accumulate(self, st: _LayerStats, router: Router, idx_NA: Tensor, scores_NE: Tensor) -> None:
        E, dev = scores_NE.shape[-1], scores_NE.device
        bias = router.e_score_correction_bias
        if st.loads is None:
            st.loads = torch.zeros(E, dtype=torch.int64, device=dev)
        st.loads += torch.bincount(idx_NA.flatten(), minlength=E)
        if self.method not in ("qb", "qb_exact"):
            return
        _, cutoff_N = route_with_cutoff(scores_NE, bias, router.top_k)
        if self.method == "qb_exact":
            st.required.append(cutoff_N[:, None] - scores_NE.float())
            return
        if st.lo is None:  # the range of the bias in force, fixed for the whole step (device scalars: no sync)
            st.lo, st.hi = bias.min().double() - 1.0, bias.max().double() + 1.0
        if st.hist is None:  # int32 halves GPU memory (K3: 896 x 1000 per layer); CPU gloo sums int64 fine
            st.hist = torch.zeros(E, self.bins, dtype=torch.int32 if dev.type == "cuda" else torch.int64, device=dev)
        _, clamped = qb_histogram(scores_NE, cutoff_N, st.lo, st.hi, self.bins, st.hist)
        st.clamped = st.clamped + clamped

    def _reduce(self, active: list[_LayerStats]) -> None:
        """Sum every layer's counts over the group in one collective (counts are additive: shard-invariant)."""
        if self._world() == 1 or not active:
            return
        parts = [s.loads for s in active] + [s.hist.long().flatten() for s in active if s.hist is not None]
        parts.append(torch.stack([torch.as_tensor(s.clamped, device=parts[0].device) for s in active]))
        flat = torch.cat([p.long() for p in parts])
        dist.all_reduce(flat, group=self.group)
        pos = 0
        for s in active:
            s.loads = flat[pos:pos + s.loads.numel()]
            pos += s.loads.numel()
        for s in active:
            if s.hist is not None:
                s.hist = flat[pos:pos + s.hist.numel()].view(s.hist.shape)
                pos += s.hist.numel()
        for i, s in enumerate(active):
            s.clamped = flat[pos + i]

    def step(self) -> dict:
        """Reduce, update every layer's bias for the next step, return metrics; reset the statistics.

        Returns {"layers": {name: {...}}, "max_mean_max", "max_mean_mean", "maxvio_max", "cv_mean"} (empty
        when no training forward happened since the last call).
        """
        active = [s for s in self.layers if s.loads is not None]
        updates = []
        with torch.no_grad():
            self._reduce(active)
            for s in active:
                updates.append(self._update(s))
                s.hist, s.loads, s.required, s.clamped, s.lo, s.hi = None, None, [], 0, None, None
        if not updates:
            return {}
        # every layer's metrics in one device-to-host copy: one wait per step, not ~12 per MoE layer
        values = torch.cat([v for _, v in updates]).tolist()
        per_layer, pos = {}, 0
        for s, (names, _) in zip(active, updates):
            m = dict(zip(names, values[pos:pos + len(names)]))
            pos += len(names)
            for key in ("dead", "tokens", "clamped"):
                if key in m:
                    m[key] = int(m[key])
            per_layer[s.name] = m
        q = min(m["q"] for m in per_layer.values())
        if self.method in ("qb", "qb_exact") and q < 32 and not self._warned:
            self._warned = True
            warnings.warn(f"quantile balancing with q = {q:.1f} tokens per expert per step (< 32) is "
                          "noisy; use a larger global batch, balancing.ema > 0, or method 'frozen'", stacklevel=2)
        vals = list(per_layer.values())
        return {"layers": per_layer, "max_mean_max": max(v["max_mean"] for v in vals),
                "max_mean_mean": sum(v["max_mean"] for v in vals) / len(vals),
                "maxvio_max": max(v["maxvio"] for v in vals), "cv_mean": sum(v["cv"] for v in vals) / len(vals)}

    def _update(self, s: _LayerStats) -> tuple[list[str], Tensor]:
        """Replace one layer's bias on the device; returns its metric names and values (fp64 device vector)."""
        bias = s.router.e_score_correction_bias
        k, E, dev = s.router.top_k, bias.numel(), bias.device
        tokens = s.loads.sum() // k
        names = [*LOAD_METRICS, "tokens", "q"]
        vals = [load_stats(s.loads), torch.stack([tokens.double(), (tokens * k).double() / E])]
        new = bias.float()
        if self.method == "qb":
            new = qb_update_from_histogram(s.hist, k, s.lo, s.hi)
            names += ["bin_width", "clamped"]
            vals.append(torch.stack([((s.hi - s.lo) / self.bins).double(),
                                     torch.as_tensor(s.clamped, device=dev).double()]))
        elif self.method == "qb_exact":
            new = qb_update_exact(torch.cat(s.required), k)
        elif self.method == "sign":
            new = sign_update(s.loads, bias, self.sign_gamma)
        if self.method in ("qb", "qb_exact") and self.ema > 0:
            new = centre(self.ema * bias.float() + (1 - self.ema) * new)
        new = new.to(dev)
        delta = (new - bias).abs().max()
        bias.copy_(new)
        names += ["bias_min", "bias_max", "bias_std", "bias_delta"]
        vals.append(torch.stack([bias.min(), bias.max(), bias.std(unbiased=False), delta]).double())
        return names, torch.cat([v.to(dev) for v in vals])

    def remove(self) -> None:
        """Detach the hooks (the model is left exactly as it was, biases included)."""
        for h in self._handles:
            h.remove()
        self._handles = []
