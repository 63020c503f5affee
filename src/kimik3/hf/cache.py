"""`KimiK3Cache`: a `transformers.Cache` over kimik3's explicit hybrid state (KDA recurrent + conv tails, MLA
latents), so `generate()` runs transformers' own loop on kimik3's one cached path.

It holds no per-layer tensors of its own: the state is `model.new_cache(batch, max_length)`, allocated on the
first forward (transformers expands a batch for `num_return_sequences` after it prepares the cache, so the batch
size is known only then) and advanced by `model(ids, cache=state, attention_mask=new_tokens_mask)`. What
transformers asks of a cache here is its length (to slice the new tokens off `input_ids`); reordering or
cropping hybrid state (beam search, assisted decoding) is not supported and says so.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import Cache


class KimiK3Cache(Cache):
    """A lazily allocated kimik3 cache for up to `max_length` tokens per sequence.

    Args:
        new_cache: `model.new_cache` of a kimik3 model: (batch_size, max_length) -> its explicit cache.
        max_length: prompt + generated tokens per row (transformers passes generation_config.max_length - 1).
    """

    def __init__(self, new_cache: Callable[[int, int], object], max_length: int):
        super().__init__(layers=[])
        self._new_cache, self.max_length = new_cache, max_length
        self.state = None  # kimik3's cache, made by `bind`
        self.seen = 0  # tokens per row the state holds (left padding included)

    def bind(self, batch_size: int, num_new: int) -> object:
        """The kimik3 state for a forward of `num_new` tokens per row, allocated on first use."""
        if self.state is None:
            self.state = self._new_cache(batch_size, self.max_length)
            self._batch = batch_size
        elif batch_size != self._batch:
            raise ValueError(f"KimiK3Cache holds {self._batch} sequences, the forward gave {batch_size}")
        if self.seen + num_new > self.max_length:
            raise ValueError(f"KimiK3Cache holds {self.max_length} tokens per sequence; {self.seen} are used and "
                             f"{num_new} more were given (make it with a larger max_length)")
        self.seen += num_new
        return self.state

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.max_length

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    @property
    def is_linear(self) -> list[bool]:
        # one entry, False: the state has a sequence axis (MLA), so transformers slices input_ids by its length
        return [False]

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return self.state is not None

    @property
    def batch_size(self) -> int:
        return self._batch if self.state is not None else -1

    def reset(self) -> None:
        self.state, self.seen = None, 0

    def _unsupported(self, what: str):
        raise NotImplementedError(f"KimiK3Cache cannot {what}: kimik3's recurrent KDA state has no per-token "
                                  "history to rewind or reorder (use greedy or sampling, num_beams=1, no assistant)")

    def reorder_cache(self, beam_idx: torch.LongTensor):
        self._unsupported("reorder rows for beam search")

    def crop(self, tokens_to_remove: int) -> None:
        self._unsupported("crop tokens (assisted decoding)")

    def batch_repeat_interleave(self, repeats: int):
        if self.state is not None:
            self._unsupported("repeat rows after allocation")

    def batch_select_indices(self, indices: torch.Tensor):
        self._unsupported("select rows")
