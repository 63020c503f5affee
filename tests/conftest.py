"""Shared test helpers: configs, relative error, and fully random weights for the tiny model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kimik3.config import K3Config

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp64; NaN never passes (it compares False against any bound)."""
    out, ref = out.double(), ref.double()
    err = ((out - ref).norm() / ref.norm()).item()
    return err if torch.isfinite(out).all() else float("nan")


@pytest.fixture(scope="session")
def k3_config() -> K3Config:
    return K3Config.from_file(CONFIGS / "k3.json")


@pytest.fixture(scope="session")
def tiny_config() -> K3Config:
    return K3Config.from_file(CONFIGS / "tiny.json")


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Random values in every tensor (never the structured training init), keeping the KDA islands sane.

    Pseudo-queries and correction biases get random values too, so AttnRes mixes and routing are non-trivial.
    Matrices get half the unit-gain scale and pseudo-queries 0.1: with unit-gain random weights the
    7-layer model is so sensitive that its own fp32 forward is only ~1e-5 away from fp64, leaving no room
    for the 1e-5 fp32 comparisons; at these scales fp32 noise is ~3e-6 and every path is still exercised.
    """
    g = torch.Generator().manual_seed(seed)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.endswith("A_log"):
            v = torch.rand(t.shape, generator=g) * 2.0 - 1.0
        elif name.endswith("dt_bias"):
            v = torch.randn(t.shape, generator=g) * 0.5
        elif name.endswith("norm.weight"):
            v = 1.0 + 0.2 * torch.randn(t.shape, generator=g)
        elif name.endswith("_res_proj.weight"):
            v = 0.1 * torch.randn(t.shape, generator=g)
        elif name.endswith("e_score_correction_bias"):
            v = 0.05 * torch.randn(t.shape, generator=g)
        elif name.endswith("conv1d.weight"):
            v = 0.5 * torch.randn(t.shape, generator=g)
        else:
            v = 0.5 * torch.randn(t.shape, generator=g) / max(t.shape[-1], 1) ** 0.5
        t.copy_(v.to(t.dtype))
    return model


def pytest_configure(config):
    """KIMIK3_TEST_TRITON_FIRST_CONFIG=1 (device runs of the GPU tests): every Triton autotuner takes its first
    config instead of compiling and timing them all. fla's KDA kernels autotune ~30 kernels per dtype, which
    costs minutes on a fresh machine; correctness does not depend on the config, only speed does."""
    if os.environ.get("KIMIK3_TEST_TRITON_FIRST_CONFIG") == "1":
        from triton.runtime import autotuner

        autotuner.Autotuner._bench = lambda self, *args, config, **kwargs: [0.0, 0.0, 0.0]
        # and keep those zero timings out of Triton's disk cache, where a later benchmark run would take them
        # for tuned results (the disk cache is neither read nor written in this mode)
        autotuner.Autotuner.check_disk_cache = lambda self, tuning_key, configs, bench_fn: bench_fn() and False


@pytest.fixture(autouse=True)
def _seed():
    """Every test draws the same random inputs on every run."""
    torch.manual_seed(1234)


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


@pytest.fixture
def tensors_read(monkeypatch) -> list[str]:
    """The names of the checkpoint tensors `kimik3.load` reads (its safe_open spied on), in order."""
    from kimik3.checkpoint import loader

    read: list[str] = []
    monkeypatch.setattr(loader, "safe_open", spying_safe_open(loader.safe_open, lambda name, t: read.append(name)))
    return read
