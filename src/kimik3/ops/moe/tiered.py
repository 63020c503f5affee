"""Routed experts in two tiers: every expert of the layer in host memory, the hot ones in the device's cache slots.

Legend: N tokens, A active experts per token, M = N * A routed rows, E experts, S cache slots of the layer,
W staging slots (shared by the layers), U distinct experts of a step, L latent width.

One call (one layer, one step):
    1. idx -> host (the step's one wait for the device in this layer); the cache counts the use (`cache.py`) and
       splits the U experts into hits (in a slot) and misses
    2. misses, one way per step by measured cost (`HostTier.choose`; `misses="host"|"copy"` forces one):
         host  z's rows go to the host, `host.expert_rows` computes them on the host's cores from the pinned weights
               while the device computes the hits; then they come back. Afterwards the hottest misses are copied
               into slots on the copy stream, ready for the next step (the cache's admission rule)
         copy  misses the cache admits are copied into their slots; the rest stream through the staging slots,
               W at a time, double-buffered (the copy of one wave overlaps the compute of the one before): what a
               prefill chunk that touches most experts does, layer by layer
    3. y [M, L]: each expert's rows computed in one piece by the device's kernel (`triton_mxfp4.rows`, whose
       tiles are picked from the full layer's rows per expert, or `reference.rows`), or by the host
    4. the combine of the all-resident path on this device (`combine.slot_sum` / `reference.combine`)
So with misses copied (or on the CPU, where both tiers are host memory and the "device" kernel is the reference)
every row is the one the all-resident layer computes, bit for bit, whatever the budget; host-computed rows differ
from them by the order of fp32 sums (fp32) or not at all after rounding, mostly (bf16).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from kimik3.ops.backend import has_triton, to_device, use_fast
from kimik3.ops.moe import PackedWeights, reference
from kimik3.ops.moe.cache import ExpertCache

MISSES = ("auto", "host", "copy")
# set while a CUDA graph of a step is captured in pieces (`graph_holes`): what a tiered layer cuts the capture with
_capture: ContextVar = ContextVar("kimik3_tiered_capture", default=None)


@contextmanager
def graph_holes(capture) -> Iterator[list[Callable[[], None]]]:
    """Within the block a tiered layer met under CUDA-graph capture is not captured: it calls `capture.end()`,
    appends to the yielded list a call that computes it (to run between the graph before it and the one after,
    on the tensors the first left), and calls `capture.begin()` for the next graph. Routing read on the host cannot
    be captured; the rest of the step can (`kimik3.inference.engine.graphs.capture`)."""
    holes: list[Callable[[], None]] = []
    token = _capture.set((capture, holes))
    try:
        yield holes
    finally:
        _capture.reset(token)
PROMOTE = 2  # experts a layer may copy into its slots after a step whose misses ran on the host


def _alloc_like(t: Tensor, n: int, device: torch.device, pin: bool = False) -> Tensor:
    return torch.empty(n, *t.shape[1:], dtype=t.dtype, device=device, pin_memory=pin)


def empty_experts(like: PackedWeights, n: int, device: torch.device, pin: bool = False) -> PackedWeights:
    """n experts' worth of uninitialized tensors shaped as `like`'s, on `device` (pinned host memory with `pin`)."""
    return PackedWeights(tuple(_alloc_like(t, n, device, pin) for t in like.packed),
                         tuple(_alloc_like(t, n, device, pin) for t in like.scales))


def expert_nbytes(w: PackedWeights) -> int:
    return sum(t[0].nbytes for t in (*w.packed, *w.scales))


def _tensors(w: PackedWeights, e: int) -> tuple[Tensor, ...]:
    """Expert e's six tensors in the host kernel's order: w1 codes, w1 scales, w3 ..., w2 ..."""
    return tuple(t[e] for pair in zip(w.packed, w.scales) for t in pair)


@dataclass
class HostTier:
    """What a model's tiered layers share: the device, the copy stream, the staging slots, the measured rates, the
    counters behind /metrics, and the miss policy."""
    device: torch.device
    staging: list[PackedWeights]  # two buffers of W experts each (double buffering)
    misses: str = "auto"
    link_bytes_per_s: float | None = None  # host -> device copy, measured on first use
    host_seconds: tuple[float, float] | None = None  # host kernel per expert at 1 and at 8 rows
    # hits / misses: routed rows; missed_experts: distinct per layer and step, over `steps` layer-steps; seconds:
    # wall time in the tiered layers (from the routing read to the combine launched) and in the host kernel
    counters: dict = field(default_factory=lambda: dict(hits=0, misses=0, bytes_copied=0, host_rows=0,
                                                        missed_experts=0, steps=0, layer_seconds=0.0,
                                                        host_seconds=0.0))

    def __post_init__(self):
        if self.misses not in MISSES:
            raise ValueError(f"misses must be one of {MISSES}, got {self.misses!r}")
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.pending: list = []  # (cache, [(expert, slot)], event): promotions in flight
        from kimik3.ops.moe import host as kernel

        self.threads = kernel.set_threads(kernel.default_threads())

    @property
    def wave(self) -> int:
        return self.staging[0].num_experts

    def copy(self, src: PackedWeights, e: int, dst: PackedWeights, slot: int) -> None:
        """Expert e of `src` into slot `slot` of `dst` (on the current stream; the copy stream's callers set it)."""
        for a, b in zip((*src.packed, *src.scales), (*dst.packed, *dst.scales)):
            b[slot].copy_(a[e], non_blocking=True)
        self.counters["bytes_copied"] += expert_nbytes(src)

    def calibrate(self, host: PackedWeights, beta: float, linear_beta: float, dtype: torch.dtype) -> None:
        """Measure the copy rate and the host kernel's time per expert on the first call (tens of milliseconds):
        the median of three rounds, each over other experts than the last (a round over experts read just before
        finds them in the CPU's cache and measured 4x the rate misses then got, on the device machine)."""
        from kimik3.ops.moe import host as kernel

        n = min(8, self.wave, max(1, host.num_experts // 3))
        rounds = [[(k * n + e) % host.num_experts for e in range(n)] for k in range(3)]
        nbytes = n * expert_nbytes(host)
        copies = []
        for experts in rounds:
            self._sync()
            t0 = time.perf_counter()
            for j, e in enumerate(experts):
                for a, b in zip((*host.packed, *host.scales), (*self.staging[0].packed, *self.staging[0].scales)):
                    b[j].copy_(a[e], non_blocking=True)
            self._sync()
            copies.append(time.perf_counter() - t0)
        self.link_bytes_per_s = nbytes / max(sorted(copies)[1], 1e-9)
        times = []
        for rows in (1, 8):
            x = torch.randn(n * rows, 2 * host.packed[0].shape[2]).to(dtype)
            spent = []
            for experts in rounds:
                jobs = [_tensors(host, e) for e in experts]
                t0 = time.perf_counter()
                kernel.expert_rows(x, jobs, [rows] * n, beta, linear_beta, dtype)
                spent.append(time.perf_counter() - t0)
            times.append(sorted(spent)[1] / n)
        self.host_seconds = (times[0], times[1])

    def choose(self, rows_per_miss: np.ndarray, nbytes: int) -> str:
        """"host" or "copy" for misses with these row counts (one expert each), by the measured costs."""
        if self.misses != "auto":
            return self.misses
        one, eight = self.host_seconds
        per_row = max(eight - one, 0.0) / 7
        host = float(np.sum(one + per_row * np.maximum(rows_per_miss - 1, 0)))
        return "host" if host < len(rows_per_miss) * nbytes / self.link_bytes_per_s else "copy"

    def observe_host(self, seconds: float, experts: int, rows: int) -> None:
        """The host kernel's time in a step (`experts` experts, `rows` rows in all) corrects the per-expert cost
        `choose` uses: half the old estimate, half this step's (the cost per extra row stays the calibrated one).
        In a decode the host kernel ran 3x slower than on its calibration's experts on the device machine (fewer
        cache-warm reads, the device's traffic beside it), so `auto` kept computing misses on the host where
        copying them was faster; the step's own time corrects that after one step."""
        one, eight = self.host_seconds
        per_row = max(eight - one, 0.0) / 7
        seen = max(seconds - per_row * (rows - experts), 0.0) / experts
        one = (one + seen) / 2
        self.host_seconds = (one, one + 7 * per_row)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def settle(self, cache: ExpertCache) -> None:
        """Promotions of this layer's cache still in flight become usable: the compute stream waits for them."""
        keep = []
        for owner, moves, event in self.pending:
            if owner is not cache:
                keep.append((owner, moves, event))
                continue
            if event is not None:
                torch.cuda.current_stream(self.device).wait_event(event)
            for e, s in moves:
                owner.place(e, s)
        self.pending = keep


@dataclass(frozen=True)
class TieredWeights:
    """A layer's experts in two tiers (see the module docstring): `host` all E of them (pinned host memory),
    `slots` the device's S cache slots, `cache` which expert is in which slot, `tier` the shared machinery."""
    host: PackedWeights
    slots: PackedWeights
    cache: ExpertCache
    tier: HostTier

    @property
    def num_experts(self) -> int:
        return self.host.num_experts

    def routed(self, z: Tensor, topk_idx: Tensor, topk_weight: Tensor, beta: float, linear_beta: float) -> Tensor:
        N, A = topk_idx.shape
        if N == 0:
            return torch.zeros_like(z)
        pieces = _capture.get()
        if pieces is not None and torch.cuda.is_current_stream_capturing():
            capture, holes = pieces
            capture.end()
            out = torch.empty_like(z)  # outside any graph: the hole writes it, the next graph reads it

            def hole():
                out.copy_(self.routed(z, topk_idx, topk_weight, beta, linear_beta))

            holes.append(hole)
            capture.begin()
            return out
        tier, cache = self.tier, self.cache
        if tier.host_seconds is None:
            tier.calibrate(self.host, beta, linear_beta, z.dtype)
        tier.settle(cache)
        idx = topk_idx.cpu().numpy()  # waits for the router: which experts this step needs
        start = time.perf_counter()
        experts, counts = np.unique(idx, return_counts=True)
        hits, misses = cache.observe(experts, counts)
        tier.counters["hits"] += hits
        tier.counters["misses"] += misses
        missed = experts[cache.slot_of[experts] < 0]
        tier.counters["missed_experts"] += len(missed)
        tier.counters["steps"] += 1
        way = tier.choose(counts[cache.slot_of[experts] < 0], expert_nbytes(self.host)) if len(missed) else None
        z_host = z.cpu() if way == "host" else None
        y = torch.empty(N * A, z.shape[1], dtype=z.dtype, device=z.device)
        fast = use_fast(z, "moe") and z.dtype in (torch.bfloat16, torch.float16) and has_triton()
        full = N * A / self.num_experts  # the all-resident layer's rows per expert: its kernel tiles

        def rows(lookup: np.ndarray, weights: PackedWeights) -> None:
            """y's rows of the experts `lookup` [E] maps to a slot of `weights` (others: -1, skipped)."""
            local = lookup[idx]
            local = np.where(local < 0, weights.num_experts, local)
            sel = to_device(torch.from_numpy(local), z.device)
            if fast:
                from kimik3.ops.moe import triton_mxfp4

                triton_mxfp4.rows(z, sel, weights.packed, weights.scales, beta, linear_beta, full, out=y)
            else:
                reference.rows(z, sel, weights.num_experts, reference.packed_weights(weights.packed, weights.scales,
                                                                                      z.dtype),
                               beta, linear_beta, out=y)

        if way == "copy":
            admitted = cache.admissions(missed, busy=experts)
            for e, s in admitted:
                tier.copy(self.host, e, self.slots, s)
                cache.place(e, s)
            missed = missed[cache.slot_of[missed] < 0]
        if self.slots.num_experts:
            rows(cache.slot_of, self.slots)
        if way == "copy" and len(missed):
            self._stream(missed, rows)
        elif way == "host":
            self._on_host(z_host, idx, missed, y, beta, linear_beta)
            promote = cache.admissions(missed, busy=experts, limit=PROMOTE)
            if promote:
                self._promote(promote)
        if fast:
            from kimik3.ops.moe.combine import slot_sum

            out = slot_sum(y, topk_weight)
        else:
            out = reference.combine(y, topk_idx, topk_weight)
        tier.counters["layer_seconds"] += time.perf_counter() - start
        return out

    def _stream(self, missed: np.ndarray, rows) -> None:
        """The misses no slot takes, through the staging slots W at a time: wave k+1's copy (copy stream) overlaps
        wave k's compute."""
        tier = self.tier
        W = tier.wave
        waves = [missed[i:i + W] for i in range(0, len(missed), W)]
        stream = tier.copy_stream
        done = [None, None]  # the compute's last use of each staging buffer
        for k, wave in enumerate(waves):
            buf = tier.staging[k % 2]
            if stream is not None:
                with torch.cuda.stream(stream):
                    if done[k % 2] is not None:
                        stream.wait_event(done[k % 2])
                    for j, e in enumerate(wave):
                        tier.copy(self.host, int(e), buf, j)
                    ready = stream.record_event()
                torch.cuda.current_stream(tier.device).wait_event(ready)
            else:
                for j, e in enumerate(wave):
                    tier.copy(self.host, int(e), buf, j)
            lookup = np.full(self.num_experts, -1, dtype=np.int64)
            lookup[wave] = np.arange(len(wave))
            rows(lookup, buf)
            if stream is not None:
                done[k % 2] = torch.cuda.current_stream(tier.device).record_event()

    def _on_host(self, z_host: Tensor, idx: np.ndarray, missed: np.ndarray, y: Tensor, beta: float,
                 linear_beta: float) -> None:
        """The missed experts' rows computed on the host's cores, written into y."""
        from kimik3.ops.moe import host as kernel

        flat = idx.reshape(-1)
        pos = np.flatnonzero(np.isin(flat, missed))
        pos = pos[np.argsort(flat[pos], kind="stable")]  # grouped by expert, tokens ascending
        experts, counts = np.unique(flat[pos], return_counts=True)
        A = idx.shape[1]
        x = z_host[torch.from_numpy(pos // A)]
        start = time.perf_counter()
        out = kernel.expert_rows(x, [_tensors(self.host, int(e)) for e in experts], counts.tolist(), beta,
                                 linear_beta, y.dtype)
        spent = time.perf_counter() - start
        self.tier.counters["host_seconds"] += spent
        self.tier.observe_host(spent, len(experts), len(pos))
        y[to_device(torch.from_numpy(pos), y.device)] = out.to(y.device, non_blocking=True)
        self.tier.counters["host_rows"] += len(pos)

    def _promote(self, moves: list[tuple[int, int]]) -> None:
        """Copy experts into slots for the next steps: now (CPU), or on the copy stream after this step's reads
        of the slots (CUDA); the slots leave the cache until then and rejoin it in `settle`."""
        tier, cache = self.tier, self.cache
        for _, s in moves:  # the outgoing experts are misses from now on
            old = cache.expert_in[s]
            if old >= 0:
                cache.slot_of[old] = -1
                cache.expert_in[s] = -1
        stream = tier.copy_stream
        if stream is None:
            for e, s in moves:
                tier.copy(self.host, e, self.slots, s)
                cache.place(e, s)
            return
        stream.wait_stream(torch.cuda.current_stream(tier.device))
        with torch.cuda.stream(stream):
            for e, s in moves:
                tier.copy(self.host, e, self.slots, s)
            event = stream.record_event()
        tier.pending.append((cache, moves, event))
