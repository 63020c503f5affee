"""Which implementation an op runs: the fast GPU path on CUDA tensors, the pure-torch reference elsewhere.

Tests (and curious users) force the reference on a GPU with `with use_backend("torch"): ...`. The choice is
a context variable, not module state: it is scoped to the `with` block and to the current thread/task.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from functools import cache

from torch import Tensor

BACKENDS = ("auto", "torch")
_backend: ContextVar[str] = ContextVar("kimik3_backend", default="auto")


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


@contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Run the block with `name` ("torch" = references everywhere, "auto" = fast paths on CUDA)."""
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    token = _backend.set(name)
    try:
        yield
    finally:
        _backend.reset(token)
