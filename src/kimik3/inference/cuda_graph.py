"""Decode steps under CUDA graphs: one captured forward per batch size, replayed for every new token.

A decode step has static shapes when it attends over the whole latent cache (span = max_length) with a
mask built on the device from a position buffer; the host only refills the token and position buffers
before each replay. Capturing writes into the cache, so its contents are saved before and restored after.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kimik3.model.cache import HybridCache


class GraphedDecoder:
    """Replays one captured decode step of `model` against `cache` (batch size and max_length fixed)."""

    def __init__(self, model: nn.Module, cache: HybridCache):
        if not cache.valid.is_cuda:
            raise ValueError("CUDA graphs need the model and cache on a CUDA device")
        self.model, self.cache = model, cache
        device = cache.valid.device
        self.tokens = torch.zeros(cache.batch_size, 1, dtype=torch.long, device=device)
        self.position = torch.zeros(1, dtype=torch.long, device=device)
        saved = _snapshot(cache)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.no_grad():
            for _ in range(2):  # warm up: autotuning and lazy initialisation stay out of the graph
                self._step()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), torch.no_grad():
            self.logits = self._step()
        _restore(cache, saved)

    def _step(self) -> Tensor:
        return static_step(self.model, self.cache, self.tokens, self.position)

    def __call__(self, tokens_B: Tensor) -> Tensor:
        """Append one token per row; returns the [B, V] logits (a buffer overwritten by the next call)."""
        if self.cache.length >= self.cache.max_length:
            raise ValueError(f"the cache holds {self.cache.max_length} tokens per sequence; it is full")
        self.tokens.copy_(tokens_B.view(-1, 1))
        self.position.fill_(self.cache.length)
        self.cache.length += 1
        self.graph.replay()
        return self.logits


def static_step(model: nn.Module, cache: HybridCache, tokens_B1: Tensor, position_1: Tensor) -> Tensor:
    """The decode step a graph captures: tokens [B, 1] at device `position_1` [1], attending over the whole cache
    (span = max_length, masked on the device); [B, V] logits. No host reads, so it is capturable as it stands."""
    step = cache.make_step(position_1, None, span=cache.max_length)
    return model(tokens_B1, cache=cache, step=step)[:, -1]


def eager_step(model: nn.Module, cache: HybridCache, tokens_B: Tensor) -> Tensor:
    """`GraphedDecoder`'s call run eagerly (the same kernels at the same shapes): append one token per row, return
    the [B, V] logits. What a graphed step is checked against."""
    position = torch.full((1,), cache.length, dtype=torch.long, device=cache.valid.device)
    cache.length += 1
    return static_step(model, cache, tokens_B.view(-1, 1), position)


def _snapshot(cache: HybridCache) -> list[Tensor]:
    return [t.clone() for t in _tensors(cache)]


def _restore(cache: HybridCache, saved: list[Tensor]) -> None:
    for t, s in zip(_tensors(cache), saved):
        t.copy_(s)


def _tensors(cache: HybridCache) -> list[Tensor]:
    out = [cache.valid]
    for layer in cache.layers:
        out.extend(vars(layer).values())
    return out
