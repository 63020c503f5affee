"""CPU threads for inference: one for small models, unless the user chose.

A small model's per-token matmuls (the demo K3: hidden 256, 20M parameters) are too short for a second thread
to pay for its synchronization, and on a busy machine every op waits for the slowest, possibly descheduled,
thread (docs/inference.md has the measurement). Large models keep torch's default, where the threads share real
work.
"""

from __future__ import annotations

import os

import torch
from torch import nn

# below this many parameters one thread decodes as fast as several on an idle machine, and far faster on a busy one
SMALL_MODEL_PARAMS = 100_000_000


def check_threads(requested: int | None, flag: str = "threads") -> None:
    """A thread count from 1 to this machine's CPU count, else a ValueError naming `flag` (torch accepts any count,
    and thousands of OpenMP threads crash the process in the first parallel op; more threads than CPUs only wait
    for one another)."""
    cpus = os.cpu_count() or 1
    if requested is not None and not 1 <= requested <= cpus:
        raise ValueError(f"{flag} must be from 1 to {cpus} (this machine's CPUs), got {requested}")


def pick_cpu_threads(model: nn.Module, device: torch.device | str, requested: int | None = None) -> int:
    """Set torch's intra-op thread count for running `model` on `device`; returns the count in force.

    `requested` (a --threads flag) wins; then an OMP_NUM_THREADS the user exported (torch already follows it);
    then one thread for a model under SMALL_MODEL_PARAMS on the CPU. GPU runs are left alone.
    """
    if requested is not None:
        check_threads(requested)
        torch.set_num_threads(requested)
    elif torch.device(device).type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        if sum(p.numel() for p in model.parameters()) < SMALL_MODEL_PARAMS:
            torch.set_num_threads(1)
    return torch.get_num_threads()
