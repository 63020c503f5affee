"""Who owns which rows of the `PagedCache`: KDA slots (one per running sequence) and ref-counted MLA blocks
(shared by every sequence and prefix-cache entry that holds the same prefix).

With `poison=True` (tests) a slot or block going back to the free list is filled with NaN, so any later
read of it that is not overwritten first turns a test's logits into NaN instead of passing silently.
"""

from __future__ import annotations

import torch

from kimik3.model.cache import PagedCache


class SlotPool:
    def __init__(self, cache: PagedCache, poison: bool = False):
        self.cache, self.poison = cache, poison
        self.free = list(range(cache.num_slots - 1, -1, -1))  # pop() hands out slot 0 first

    def __len__(self) -> int:
        return len(self.free)

    def allocate(self) -> int:
        """A slot whose state is zero (a sequence's start: empty recurrent state, zero conv padding)."""
        slot = self.free.pop()
        for pool in self.cache.kda:
            for t in pool.tensors():
                t[slot].zero_()
        return slot

    def release(self, slot: int) -> None:
        assert slot not in self.free, f"slot {slot} released twice"
        if self.poison:
            for pool in self.cache.kda:
                for t in pool.tensors():
                    t[slot].fill_(float("nan"))
        self.free.append(slot)

    def copy(self, src: int, dst: int) -> None:
        for pool in self.cache.kda:
            for t in pool.tensors():
                t[dst].copy_(t[src])

    def save(self, slot: int) -> list[torch.Tensor]:
        """A copy of the slot's state, every KDA layer's (recurrent, conv q, k, v) in order."""
        return [t[slot].clone() for pool in self.cache.kda for t in pool.tensors()]

    def load(self, slot: int, saved: list[torch.Tensor]) -> None:
        """Copy-on-write restore: the snapshot is copied into the sequence's own slot, never shared."""
        for t, s in zip((t for pool in self.cache.kda for t in pool.tensors()), saved):
            t[slot].copy_(s)


class BlockPool:
    def __init__(self, cache: PagedCache, poison: bool = False):
        self.cache, self.poison = cache, poison
        self.size = cache.block_size
        self.free = list(range(cache.num_blocks - 1, -1, -1))
        self.refs = [0] * cache.num_blocks

    def __len__(self) -> int:
        return len(self.free)

    def allocate(self) -> int:
        block = self.free.pop()
        self.refs[block] = 1
        return block

    def ref(self, block: int) -> None:
        assert self.refs[block] > 0, f"block {block} is free"
        self.refs[block] += 1

    def unref(self, block: int) -> None:
        assert self.refs[block] > 0, f"block {block} released twice"
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if self.poison:
                for pool in self.cache.mla:
                    pool.latent[self._rows(block)].fill_(float("nan"))
            self.free.append(block)

    def copy(self, src: int, dst: int, rows: int) -> None:
        """Copy the first `rows` positions of block src into block dst (copy-on-write of a partial block)."""
        for pool in self.cache.mla:
            pool.latent[dst * self.size: dst * self.size + rows].copy_(pool.latent[src * self.size:
                                                                                   src * self.size + rows])

    def finite(self, blocks: list[int], length: int) -> bool:
        """Whether the latents of the first `length` positions held by `blocks` are all finite."""
        rows = torch.cat([torch.arange(b * self.size, b * self.size + self.size) for b in blocks])[:length]
        return all(bool(torch.isfinite(pool.latent[rows.to(pool.latent.device)]).all()) for pool in self.cache.mla)

    def _rows(self, block: int) -> slice:
        return slice(block * self.size, (block + 1) * self.size)
