"""What the tests share: the repository's paths, the house's yardstick (from `kimik3.testing`), a free loopback
port, the Triton-interpreter switch, and a spy on the checkpoint reader. Fixtures live in `conftest.py`."""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
from pathlib import Path

import pytest
import torch

from kimik3.testing import randomize, rel_err

__all__ = ["CONFIGS", "HAS_TRITON", "REPO", "free_port", "interpret_triton", "needs_cuda_triton", "needs_interpreter",
           "patch_interpreter_index", "randomize", "rel_err", "requires_cuda", "spying_safe_open"]

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"

# with the `gpu` marker on device tests: `pytest -m gpu` on a machine without CUDA skips them rather than failing
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


HAS_TRITON = importlib.util.find_spec("triton") is not None
# a fused kernel's CPU tests run under Triton's interpreter (tests/conftest.py switches it on before triton is
# imported); its GPU tests need CUDA and triton
needs_interpreter = pytest.mark.skipif(not HAS_TRITON or torch.cuda.is_available(),
                                       reason="needs triton (CPU: run under Triton's interpreter)")
needs_cuda_triton = pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON,
                                       reason="needs CUDA and triton")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def patch_interpreter_index(mp) -> None:
    """Let Triton's interpreter loop over a runtime scalar (`range(0, n, BLOCK)` in a kernel), on MonkeyPatch mp.

    Triton 3.6's interpreter indexes with `int(array of one)`, which numpy >= 2.4 refuses
    (triton-lang/triton#9171, fixed upstream by #9172).
    """
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    mp.setattr(interpreter, "_patch_lang_tensor", patched)


def interpret_triton() -> bool:
    """Switch Triton's interpreter on when there is triton but no CUDA; True if the fused kernels can run here.

    Triton reads TRITON_INTERPRET when it is first imported and when each `@triton.jit` runs, so this must be
    called at collection, before anything imports triton.
    """
    if importlib.util.find_spec("triton") is None:
        return False
    if not torch.cuda.is_available():
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            return False  # imported already without the interpreter: the kernels cannot run on CPU tensors
        os.environ["TRITON_INTERPRET"] = "1"
    return True


def spying_safe_open(real, record):
    """A stand-in for safetensors' `safe_open` that calls `record(name, tensor)` for every tensor read, whole
    (`get_tensor`) or as a block (`get_slice(name)[...]`)."""

    class Spy:
        def __init__(self, *args, **kwargs):
            self.outer = real(*args, **kwargs)

        def __enter__(self):
            self.f = self.outer.__enter__()
            return self

        def __exit__(self, *exc):
            return self.outer.__exit__(*exc)

        def get_tensor(self, name):
            t = self.f.get_tensor(name)
            record(name, t)
            return t

        def get_slice(self, name):
            whole = self.f.get_slice(name)

            class Block:
                def __getitem__(self, index):
                    t = whole[index]
                    record(name, t)
                    return t

            return Block()

    return Spy
