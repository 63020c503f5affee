"""Prompt side of image splicing: one `<|media_pad|>` per image in the chat encoding becomes one pad per
image token, so the model can write each image's projected tokens over its pads (spec 4.4, engine form)."""

from __future__ import annotations

from collections.abc import Sequence


def expand_media_pads(ids: Sequence[int], num_tokens: Sequence[int], pad_id: int) -> list[int]:
    """Repeat the k-th pad of `ids` num_tokens[k] times; ValueError when pads and images do not pair up."""
    pads = sum(1 for t in ids if t == pad_id)
    if pads != len(num_tokens):
        raise ValueError(f"the prompt has {pads} image placeholders (<|media_pad|>) but {len(num_tokens)} images "
                         "were given")
    out: list[int] = []
    images = iter(num_tokens)
    for t in ids:
        out.extend([pad_id] * next(images) if t == pad_id else [t])
    return out
