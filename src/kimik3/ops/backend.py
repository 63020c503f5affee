"""Which implementation an op runs: the fast GPU path on CUDA tensors, the pure-torch reference elsewhere.

Tests (and curious users) force the reference on a GPU with `with use_backend("torch"): ...`, or one op's with
`use_backend(rmsnorm="torch")` (any op package of `kimik3.ops`: OPS); `use_backend(moe="triton")` picks the
W4A16 MoE kernels (see `kimik3.ops.moe`; "torch" for the reference). Each choice is a context variable, not
module state: it is scoped to the `with` block and to the current thread/task, and a hot path reads it without
touching the environment. The CLI reads KIMIK3_MOE_BACKEND once (`moe_backend_from_env`) and runs the command
inside `use_backend(moe=...)`.

One rule for a fast path's missing dependency: on CUDA it is an error that says what to install (or how to force
the reference), never a silent fall back to a reference that can be orders of magnitude slower (`require`).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from functools import cache

import torch
from torch import Tensor

BACKENDS = ("auto", "torch")
MOE_BACKENDS = ("auto", "triton", "humming", "torch")  # W4A16 MoE kernels on CUDA (kimik3.ops.moe says each)
MOE_ENV = "KIMIK3_MOE_BACKEND"
OPS = ("attnres", "kda", "lora", "mla", "mxfp4", "optim", "rmsnorm", "router", "shortconv", "situ", "vision_attn")
_backend: ContextVar[str] = ContextVar("kimik3_backend", default="auto")
_moe_backend: ContextVar[str] = ContextVar("kimik3_moe_backend", default="auto")
_op_backends: ContextVar[dict[str, str] | None] = ContextVar("kimik3_op_backends", default=None)
_batch_invariant: ContextVar[bool] = ContextVar("kimik3_batch_invariant", default=False)


def use_fast(t: Tensor, op: str) -> bool:
    """True when op `op` (an OPS name, or "moe") on `t` should take its fast path: a CUDA tensor and no "torch"
    override, for all ops or for this one."""
    if not t.is_cuda or _backend.get() != "auto":
        return False
    return (_moe_backend.get() if op == "moe" else (_op_backends.get() or {}).get(op, "auto")) != "torch"


def require(available: bool, what: str, install: str) -> None:
    """The one rule for a missing fast-path dependency on CUDA: an ImportError naming it and the way out."""
    if not available:
        raise ImportError(f"{what} on CUDA runs {install}'s kernels, which are not installed: pip install "
                          f"'kimik3[gpu]', or force the pure-torch reference with "
                          "kimik3.ops.backend.use_backend('torch')")


@cache
def has_triton() -> bool:
    """Whether Triton is installed (the fused kernels' fast paths need it; it is imported only when used)."""
    return importlib.util.find_spec("triton") is not None


@cache
def has_fla() -> bool:
    """Whether fla-core is installed (KDA's CUDA kernels; imported only when used)."""
    return importlib.util.find_spec("fla") is not None


def batch_invariant_mode() -> bool:
    """Whether the ops that pick their tiles or work split by the call's size must pick one for every size (MLA's
    paged decode, the MoE kernels): set by `kimik3.ops.matmul.batch_invariant`, which also routes the products."""
    return _batch_invariant.get()


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
def use_backend(name: str | None = None, *, moe: str | None = None, batch_invariant: bool | None = None,
                **ops: str) -> Iterator[None]:
    """Run the block with `name` ("torch" = references everywhere, "auto" = fast paths on CUDA), the MoE
    kernels `moe` (one of MOE_BACKENDS), `batch_invariant` tiles (`batch_invariant_mode`; the products' half of
    that mode is `kimik3.ops.matmul.batch_invariant`, which sets this) and/or, per op package of OPS, "auto" or
    "torch"; None leaves a choice as it is."""
    if name is not None and name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    if moe is not None and moe not in MOE_BACKENDS:
        raise ValueError(f"moe backend must be one of {MOE_BACKENDS}, got {moe!r}")
    for op, value in ops.items():
        if op not in OPS or value not in BACKENDS:
            raise ValueError(f"use_backend({op}={value!r}): ops are {OPS}, each 'auto' or 'torch'")
    per_op = {**(_op_backends.get() or {}), **ops} if ops else None
    tokens = [(var, var.set(value)) for var, value in ((_backend, name), (_moe_backend, moe), (_op_backends, per_op),
                                                       (_batch_invariant, batch_invariant)) if value is not None]
    try:
        yield
    finally:
        for var, token in reversed(tokens):
            var.reset(token)


def to_device(x: Tensor, device: torch.device) -> Tensor:
    """A small host tensor onto `device` without waiting for the work queued there: through pinned memory on CUDA
    (a copy from pageable memory may first wait for the stream, so the launches after it would start only once
    the queued work, a forward or expert copies, had finished)."""
    if device.type != "cuda":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)
