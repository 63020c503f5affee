"""What a run reports: model FLOPs per token (for MFU), the metrics JSONL file and the progress bar.

FLOPs per trained token (forward + backward = 3 x forward; recomputation is not counted, as usual for MFU):

    6 * P_active                       P_active = parameters a token multiplies by: every Linear of the
                                       attention, the dense MLP, the router, the latent down/up projections,
                                       the shared expert, A of the E routed experts, the LM head (no embedding)
  + 6 * H * (K_qk + V) * T / 2         per MLA layer: q.k and p.v over on average T/2 causal keys, T = seq_len
                                       (an upper bound when rows pack several documents)
  + 18 * H * K * V                     per KDA layer: the recurrent form's three K x V products per token
                                       (S^T k, k u^T, S^T q); the chunked kernel does somewhat more work

MFU = FLOPs per token x global tokens/s / (ranks x peak FLOP/s); reported on CUDA only. The peak is
`log.peak_tflops`, or the dense bf16 peak of a known GPU (H100/H200 989, A100 312 TFLOP/s).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from kimik3.config import TextConfig

PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}


def active_params(cfg: TextConfig) -> int:
    """Matmul parameters one token uses (see the module docstring)."""
    D, k, m, e = cfg.hidden_size, cfg.kda, cfg.mla, cfg.moe
    P = k.proj_dim
    kda = 4 * D * P + P * D + D * k.head_dim + k.head_dim * P + D * k.num_heads
    H = m.num_heads
    mla = (D * m.q_lora_rank + m.q_lora_rank * H * m.qk_head_dim + D * (m.kv_lora_rank + m.qk_rope_head_dim)
           + m.kv_lora_rank * H * (m.qk_nope_head_dim + m.v_head_dim) + 2 * D * H * m.v_head_dim)
    moe = (D * e.num_experts + 2 * D * e.latent_dim + 3 * D * e.shared_dim
           + e.num_experts_per_token * 3 * e.latent_dim * e.expert_dim)
    total = cfg.vocab_size * D
    for kind, is_moe in zip(cfg.layer_types, cfg.moe_layers):
        total += (kda if kind == "kda" else mla) + (moe if is_moe else 3 * D * cfg.intermediate_size)
    return total


def flops_per_token(cfg: TextConfig, seq_len: int) -> float:
    m, k = cfg.mla, cfg.kda
    attn = sum(6 * m.num_heads * (m.qk_head_dim + m.v_head_dim) * seq_len / 2 if kind == "mla"
               else 18 * k.num_heads * k.head_dim * k.head_dim for kind in cfg.layer_types)
    return 6.0 * active_params(cfg) + attn


def peak_flops(device: torch.device, configured: float | None) -> float | None:
    """Per-device peak FLOP/s for MFU, or None (CPU, or an unknown GPU without log.peak_tflops)."""
    if device.type != "cuda":
        return None
    if configured:
        return configured * 1e12
    name = torch.cuda.get_device_name(device)
    return next((v * 1e12 for key, v in PEAK_TFLOPS.items() if key in name), None)


class MetricsLog:
    """Append-only JSONL, one record per logged step or evaluation (rank 0 writes)."""

    def __init__(self, path: Path, enabled: bool, resume_step: int | None):
        self.path, self.enabled = path, enabled
        if not enabled:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        keep = []
        if resume_step is not None and path.exists():  # drop records of steps a killed run did not save
            keep = [line for line in path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= resume_step]
        path.write_text("".join(line + "\n" for line in keep))

    def write(self, record: dict) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(_finite(record), default=str, allow_nan=False) + "\n")


def _finite(x):
    """NaN and infinities as null, at any depth: json.dumps writes them as bare NaN / Infinity, which strict
    readers refuse (an evaluation over no trained tokens reports NaN)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a metrics.jsonl file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _console():
    """A rich console on stderr whose closed pipe is a BrokenPipeError for `Progress` to handle: rich's own
    handling exits the process (SystemExit(1)), which ended a run without saving it."""
    from rich.console import Console

    class StderrConsole(Console):
        def on_broken_pipe(self) -> None:
            self.quiet = True
            raise BrokenPipeError

    return StderrConsole(stderr=True)


class Progress:
    """How a run shows its steps on rank 0, on stderr: `mode` "bar" (rich: step, loss, tokens/s, ETA), "lines" (a
    log line every `every` steps and at the last one, and evaluations: for logs and `--no-progress`) or "off"
    (the other ranks). A bar asked for where stderr is no terminal shows lines (rich would hold everything until
    the run ends). `closed` turns true when the reader of stderr went away (`kimik3 train 2>&1 | head`): the
    display stops and the trainer stops as on Ctrl-C, saving first."""

    def __init__(self, mode: str, total: int, start: int, every: int = 1):
        if mode not in ("bar", "lines", "off"):
            raise ValueError(f"progress mode must be bar, lines or off, got {mode!r}")
        if mode == "bar" and not sys.stderr.isatty():
            mode = "lines"
        self.mode, self.total, self.every, self.bar, self.closed = mode, total, every, None, False
        self.t0 = time.monotonic()
        if mode != "bar":
            return
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
        from rich.progress import Progress as RichProgress

        self.bar = RichProgress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
                                TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                                console=_console())
        self.task = self.bar.add_task("train", total=total, completed=start, loss="-", tps="-")
        self._show(self.bar.start)

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        if self.bar is not None:
            self._show(lambda: self.bar.update(self.task, completed=step, loss=f"{loss:.4f}",
                                               tps=f"{tokens_per_s:,.0f}"))
        elif self.mode == "lines" and (step % self.every == 0 or step == self.total):
            self.print(f"step {step}/{self.total}: loss {loss:.4f}, {tokens_per_s:,.0f} tokens/s, "
                       f"{time.monotonic() - self.t0:.0f} s")

    def print(self, text: str) -> None:
        if self.bar is not None:
            self._show(lambda: self.bar.console.print(text))
        elif self.mode == "lines":
            self._show(lambda: print(f"kimik3 train: {text}", file=sys.stderr, flush=True))

    def close(self) -> None:
        if self.bar is not None:
            self._show(self.bar.stop)

    def _show(self, write) -> None:
        if self.closed:
            return
        try:
            write()
        except BrokenPipeError:
            self.closed = True
            try:  # what is still buffered would fail again at exit
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, sys.stderr.fileno())
                os.close(devnull)
            except (OSError, ValueError):  # not a real file (a test's capture)
                pass
