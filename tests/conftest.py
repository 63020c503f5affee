"""Fixtures and pytest hooks shared by every test; plain helpers live in `tests/helpers.py`."""

from __future__ import annotations

import os

import pytest
import torch

from kimik3.config import K3Config
from kimik3.testing import triton_first_config
from tests.chat_template_check import check_segments, spells_special, value_merges
from tests.helpers import CONFIGS, interpret_triton, spying_safe_open

# on a machine without CUDA the fused Triton kernels' tests run under Triton's interpreter, which must be switched
# on before anything imports triton: here, before any test module is collected
interpret_triton()

# fla's Triton kernels leave `tl.dot`'s precision to Triton, which runs fp32 operands as TF32 on Hopper: measured
# on the H200, fla's fp32 KDA is 1.1e-3 to 1.8e-3 (relative) from the fp32 reference in outputs, states and
# gradients, ~1000x the fp32 rounding level, and the tiny model amplifies that to 7e-2. The fp32 GPU tests check
# the algorithm at fp32, so Triton's fp32 dots are IEEE in test sessions (read when a kernel compiles).
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")


@pytest.fixture(scope="session")
def k3_config() -> K3Config:
    return K3Config.from_file(CONFIGS / "k3.json")


@pytest.fixture(scope="session")
def tiny_config() -> K3Config:
    return K3Config.from_file(CONFIGS / "tiny.json")


def pytest_configure(config):
    """KIMIK3_TEST_TRITON_FIRST_CONFIG=1 (device runs of the GPU tests): no autotuning (`triton_first_config`)."""
    if os.environ.get("KIMIK3_TEST_TRITON_FIRST_CONFIG") == "1":
        triton_first_config()


@pytest.fixture(autouse=True)
def _seed():
    """Every test draws the same random inputs on every run."""
    torch.manual_seed(1234)


@pytest.fixture
def tensors_read(monkeypatch) -> list[str]:
    """The names of the checkpoint tensors `kimik3.load` reads (its safe_open spied on), in order."""
    from kimik3.checkpoint import loader

    read: list[str] = []
    monkeypatch.setattr(loader, "safe_open", spying_safe_open(loader.safe_open, lambda name, t: read.append(name)))
    return read


@pytest.fixture
def one_thread():
    """One intra-op thread while a test runs (restored after). Training-sized tests hold tiny tensors, so
    threading only adds synchronization: on a busy 2-core machine two spinning OpenMP threads made elementwise ops
    ~100x slower. One thread also makes in-process runs reproducible bit for bit."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def set_moe():
    """`set_moe(name)` picks the MoE backend for the rest of the test (the context variable `use_backend(moe=...)`
    sets, and the CLI sets from KIMIK3_MOE_BACKEND); the default comes back after it."""
    from kimik3.ops import backend

    tokens = []

    def set_(name: str) -> None:
        assert name in backend.MOE_BACKENDS, name
        tokens.append(backend._moe_backend.set(name))

    yield set_
    for token in reversed(tokens):
        backend._moe_backend.reset(token)


@pytest.fixture
def poison():
    """NaN-fill a tensor the op must overwrite completely."""
    def fill(t):
        return t.fill_(float("nan"))
    return fill


@pytest.fixture(autouse=True)
def _chat_template_renders_encode_chat(monkeypatch):
    """Every chat any test encodes is also rendered with the Jinja chat template (`kimik3.tokenizer.CHAT_TEMPLATE`)
    and must give encode_chat's ids under any vocabulary (`tests/chat_template_check.py`); skipped only for text
    that spells a special token's name and for an attribute value the pre-tokenizer joins to its quotes, which no
    text template can keep apart (docs/gguf.md)."""
    from kimik3.tokenizer import chat

    original = chat.build_segments

    def checked(messages, **kwargs):
        segments = original(messages, **kwargs)
        if not (spells_special(segments) or value_merges(segments)):
            check_segments(segments, messages, kwargs)
        return segments

    monkeypatch.setattr(chat, "build_segments", checked)
