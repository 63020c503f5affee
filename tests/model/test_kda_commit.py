"""A verification step's KDA: the forward leaves the verifying slots as they were, and `KimiDeltaAttention.commit`
then writes each slot's state after the first `keep` tokens of its row == decoding those tokens one by one
(recurrent state and conv tails), on the reference ops and on fla's kernels."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kimik3.config import K3Config
from kimik3.model.kda import KimiDeltaAttention
from kimik3.model.state import StatePool
from kimik3.model.step import uniform_step
from tests.helpers import CONFIGS, randomize, rel_err, requires_cuda

N, L, BS = 4, 5, 16


def _layer(device: str) -> KimiDeltaAttention:
    cfg = K3Config.from_file(CONFIGS / "tiny.json").text
    # fla wants a power-of-two head dim >= 32
    cfg = dataclasses.replace(cfg, kda=dataclasses.replace(cfg.kda, head_dim=64))
    return randomize(KimiDeltaAttention(cfg, torch.float32), seed=7).to(device).eval()


def _pool(layer: KimiDeltaAttention, device: str) -> StatePool:
    pool = StatePool([layer.state_spec()], N, N * 4, BS, torch.float32, device)
    g = torch.Generator().manual_seed(1)
    pool.recurrent.copy_(torch.randn(pool.recurrent.shape, generator=g) * 0.1)
    pool.conv.copy_(torch.randn(pool.conv.shape, generator=g))
    return pool


def _steps(device: str, row_len: int, cached: torch.Tensor):
    slots = torch.arange(N, device=device)
    tables = torch.arange(N * 4, device=device).view(N, 4)
    return uniform_step(slots, cached.to(device), tables, row_len=row_len, block_size=BS, max_len=4 * BS,
                        conv_window=4, pad_block=N * 4)


def _check(device: str) -> None:
    layer = _layer(device)
    D = layer.q_proj.in_features
    x_NLD = torch.randn(N, L, D, generator=torch.Generator().manual_seed(2)).to(device)
    keep = torch.tensor([1, 3, L, 2])
    cached = torch.tensor([0, 7, 20, 33])
    with torch.no_grad():
        pool = _pool(layer, device)
        before = (pool.recurrent.clone(), pool.conv.clone())
        step = _steps(device, L, cached)
        layer(x_NLD.reshape(1, N * L, D), state=pool.layers[0], step=step)
        # the forward wrote no KDA state of a verifying row
        assert torch.equal(pool.recurrent, before[0]) and torch.equal(pool.conv, before[1])
        layer.commit(pool.layers[0], step.verify.saved[0], step.slots, keep.to(device))

        ref = _pool(layer, device)
        for j in range(L):  # decode the kept tokens one at a time (a row past its keep: its slot is not touched)
            rows = [n for n in range(N) if j < keep[n]]
            view = ref.layers[0]
            sub = uniform_step(torch.tensor(rows, device=device), (cached[rows] + j).to(device),
                               torch.arange(N * 4, device=device).view(N, 4)[rows], row_len=1, block_size=BS,
                               max_len=4 * BS)
            layer(x_NLD[rows, j][None], state=view, step=sub)
    assert rel_err(pool.recurrent, ref.recurrent) < 1e-5
    assert rel_err(pool.conv, ref.conv) < 1e-6


def test_commit_equals_decoding_the_kept_tokens():
    _check("cpu")


@pytest.mark.gpu
@requires_cuda
def test_commit_equals_decoding_the_kept_tokens_gpu():
    _check("cuda")
