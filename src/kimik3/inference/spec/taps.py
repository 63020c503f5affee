"""The target's hidden states at chosen decoder layers, read with forward hooks (the model is not changed).

Legend: B batch, T tokens, D hidden, M stored AttnRes blocks, n tapped layers.

A K3 decoder layer returns (running sum, blocks [M, B, T, D], ...): with block attention residuals the running sum
holds only the current block's layers. What we tap is the full residual stream after layer i,
h_i = blocks.sum(0) + running sum (the embedding plus every layer's output so far), the tensor a plain
pre-norm transformer would carry there, so a drafter sees the same quantity whichever block a layer is in.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn


def residual_stream(output: tuple[Tensor, Tensor, object]) -> Tensor:
    """A decoder layer's (running sum [B, T, D], blocks [M, B, T, D], its attention's step output) -> the residual
    stream [B, T, D] (fp32)."""
    partial, blocks, _ = output
    h = partial.float()
    return h + blocks.float().sum(0) if len(blocks) else h


@contextlib.contextmanager
def tapped(lm: nn.Module, layer_ids: tuple[int, ...]) -> Iterator[list[Tensor | None]]:
    """Within the block, every forward of `lm` (a K3ForCausalLM) records layer i's residual stream [B, T, D]
    into the yielded list, at index j for layer_ids[j] (a later forward overwrites the earlier one).

    Raises ValueError when a layer index is outside the model."""
    layers = lm.model.layers
    bad = [i for i in layer_ids if not 0 <= i < len(layers)]
    if bad:
        raise ValueError(f"target_layer_ids {bad} outside the target's {len(layers)} layers (0-based)")
    found: list[Tensor | None] = [None] * len(layer_ids)

    def hook(j: int):
        def record(module, args, output):
            found[j] = residual_stream(output)
        return record

    handles = [layers[i].register_forward_hook(hook(j)) for j, i in enumerate(layer_ids)]
    try:
        yield found
    finally:
        for h in handles:
            h.remove()


def stack_taps(found: list[Tensor | None]) -> Tensor:
    """The recorded taps -> [B, T, n*D] (the drafter's `fc` input: layers side by side in layer_ids order)."""
    assert all(t is not None for t in found), "a tapped layer did not run"
    return torch.cat(found, dim=-1)
