"""Which implementation an op runs: the fast GPU path on CUDA tensors, the pure-torch reference elsewhere.

Tests (and curious users) force the reference on a GPU with `with use_backend("torch"): ...`. Per-op switches
ride along: `use_backend(moe="triton")` picks the W4A16 MoE kernels (see `kimik3.ops.moe`). Each choice is
a context variable, not module state: it is scoped to the `with` block and to the current thread/task, and a
hot path reads it without touching the environment. The CLI reads KIMIK3_MOE_BACKEND once
(`moe_backend_from_env`) and runs the command inside `use_backend(moe=...)`.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from functools import cache

from torch import Tensor

BACKENDS = ("auto", "torch")
MOE_BACKENDS = ("auto", "triton", "humming")  # W4A16 MoE kernels on CUDA (kimik3.ops.moe says what each does)
MOE_ENV = "KIMIK3_MOE_BACKEND"
_backend: ContextVar[str] = ContextVar("kimik3_backend", default="auto")
_moe_backend: ContextVar[str] = ContextVar("kimik3_moe_backend", default="auto")


def use_fast(t: Tensor) -> bool:
    """True when an op on `t` should take its fast path: a CUDA tensor and no "torch" override."""
    return t.is_cuda and _backend.get() == "auto"


@cache
def has_triton() -> bool:
    """Whether Triton is installed (the fused kernels' fast paths need it; it is imported only when used)."""
    return importlib.util.find_spec("triton") is not None


@cache
def has_fla() -> bool:
    """Whether fla-core is installed (KDA's CUDA kernels; imported only when used)."""
    return importlib.util.find_spec("fla") is not None


def moe_backend() -> str:
    """The W4A16 MoE kernels in force: one of MOE_BACKENDS ("auto" unless `use_backend(moe=...)` says otherwise)."""
    return _moe_backend.get()


def moe_backend_from_env() -> str:
    """KIMIK3_MOE_BACKEND checked ("auto" when unset): the one place the environment variable is read.

    Raises:
        ValueError: it is set to something outside MOE_BACKENDS.
    """
    choice = os.environ.get(MOE_ENV, "auto")
    if choice not in MOE_BACKENDS:
        raise ValueError(f"{MOE_ENV} must be one of {MOE_BACKENDS}, got {choice!r}")
    return choice


@contextmanager
def use_backend(name: str | None = None, *, moe: str | None = None) -> Iterator[None]:
    """Run the block with `name` ("torch" = references everywhere, "auto" = fast paths on CUDA) and/or the MoE
    kernels `moe` (one of MOE_BACKENDS); None leaves that choice as it is."""
    if name is not None and name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    if moe is not None and moe not in MOE_BACKENDS:
        raise ValueError(f"moe backend must be one of {MOE_BACKENDS}, got {moe!r}")
    tokens = [(var, var.set(value)) for var, value in ((_backend, name), (_moe_backend, moe)) if value is not None]
    try:
        yield
    finally:
        for var, token in reversed(tokens):
            var.reset(token)
