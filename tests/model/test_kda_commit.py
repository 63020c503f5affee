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
        _, io = layer.cached(x_NLD.reshape(1, N * L, D), pool.layers[0], step)
        # the forward wrote no KDA state of a verifying row: it gave back their inputs
        assert torch.equal(pool.recurrent, before[0]) and torch.equal(pool.conv, before[1])
        layer.commit(pool.layers[0], io.saved, step.slots, keep.to(device))

        ref = _pool(layer, device)
        for j in range(L):  # decode the kept tokens one at a time (a row past its keep: its slot is not touched)
            rows = [n for n in range(N) if j < keep[n]]
            view = ref.layers[0]
            sub = uniform_step(torch.tensor(rows, device=device), (cached[rows] + j).to(device),
                               torch.arange(N * 4, device=device).view(N, 4)[rows], row_len=1, block_size=BS,
                               max_len=4 * BS)
            layer.cached(x_NLD[rows, j][None], view, sub)
    assert rel_err(pool.recurrent, ref.recurrent) < 1e-5
    assert rel_err(pool.conv, ref.conv) < 1e-6


def test_commit_equals_decoding_the_kept_tokens():
    _check("cpu")


@pytest.mark.gpu
@requires_cuda
def test_commit_equals_decoding_the_kept_tokens_gpu():
    _check("cuda")


def _fields(step) -> dict:
    """Every field of a step (and of its verification rows): tensors cloned, the rest as they are."""
    out = {}
    for name, value in list(vars(step).items()) + [(f"verify.{k}", v) for k, v in vars(step.verify or {}).items()]:
        out[name] = value.clone() if isinstance(value, torch.Tensor) else value
    return out


def test_the_layer_returns_what_it_reads_and_never_writes_the_step():
    """A step is the layers' input only: exported snapshots and a verification's saved inputs come back from
    `cached` (the old layer appended them to the step it was given)."""
    from kimik3.model.step import build_step

    layer = _layer("cpu")
    D = layer.q_proj.in_features
    x = torch.randn(1, 64 + 5, D, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        pool = _pool(layer, "cpu")
        step = build_step(slots=[0, 1], cached=[0, 7], lens=[64, 5], tables=[[0, 1, 2, 3], [4, 5]], block_size=BS,
                          conv_window=4, pad_block=N * 4, device=torch.device("cpu"), exports=[[64], []], verify=[1])
        before = _fields(step)
        _, io = layer.cached(x, pool.layers[0], step)
    after = _fields(step)
    assert before.keys() == after.keys()
    for name, value in before.items():
        assert (torch.equal(value, after[name]) if isinstance(value, torch.Tensor) else value == after[name]), name
    recurrent, *tails = io.exports
    assert recurrent.shape[0] == 1 and all(t.shape[0] == 1 for t in tails)  # one export, after the first chunk
    assert len(io.saved) == 7 and io.saved[0].shape[0] == 1  # k, v, g, beta, 3 pre-conv inputs of the one row
