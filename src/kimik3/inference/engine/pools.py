"""Who owns which rows of the `StatePool`: KDA slots (one per running sequence) and ref-counted MLA blocks
(shared by every sequence and prefix-cache entry that holds the same prefix).

With `poison=True` (tests) a slot or block going back to the free list is filled with NaN, so any later
read of it that is not overwritten first turns a test's logits into NaN instead of passing silently.
"""

from __future__ import annotations

import torch
from torch import nn

from kimik3.inference.engine.config import EngineConfig
from kimik3.model.state import SlotState, StatePool, state_specs


def state_pool(lm: nn.Module, cfg: EngineConfig, max_model_len: int) -> StatePool:
    """The engine's pool for `lm`'s declared state: a KDA slot per running sequence, and MLA blocks for every one
    at max_model_len (unless `cfg.num_blocks`; on CUDA at most half the free memory, and at least one sequence's
    worth)."""
    w, Bs = lm.lm_head.weight, cfg.block_size
    max_blocks = -(-max_model_len // Bs)
    specs = state_specs(lm)
    num_blocks = cfg.num_blocks
    if num_blocks is None:
        num_blocks = cfg.max_num_seqs * max_blocks
        if w.is_cuda:  # a long max_model_len would ask for far more than the card has: half its free memory
            per_block = StatePool(specs, 1, 1, Bs, w.dtype, "meta").block_bytes
            free = torch.cuda.mem_get_info(w.device)[0]
            num_blocks = max(max_blocks, min(num_blocks, int(free // 2 // max(per_block, 1))))
    return StatePool(specs, cfg.max_num_seqs, num_blocks, Bs, w.dtype, w.device)


class SlotPool:
    def __init__(self, pool: StatePool, poison: bool = False):
        self.pool, self.poison = pool, poison
        self.free = list(range(pool.num_slots - 1, -1, -1))  # pop() hands out slot 0 first

    def __len__(self) -> int:
        return len(self.free)

    def allocate(self) -> int:
        """A slot whose state is zero (a sequence's start: empty recurrent state, zero conv padding)."""
        slot = self.free.pop()
        self.pool.fill_slot(slot, 0.0)
        return slot

    def release(self, slot: int) -> None:
        assert slot not in self.free, f"slot {slot} released twice"
        if self.poison:
            self.pool.fill_slot(slot, float("nan"))
        self.free.append(slot)

    def copy(self, src: int, dst: int) -> None:
        self.pool.copy_slot(src, dst)

    def save(self, slot: int) -> SlotState:
        return self.pool.save_slot(slot)

    def load(self, slot: int, saved: SlotState) -> None:
        """Copy-on-write restore: the snapshot is copied into the sequence's own slot, never shared."""
        self.pool.load_slot(slot, saved)


class BlockPool:
    def __init__(self, pool: StatePool, poison: bool = False):
        self.pool, self.poison = pool, poison
        self.size = pool.block_size
        self.free = list(range(pool.num_blocks - 1, -1, -1))
        self.refs = [0] * pool.num_blocks

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
                self.pool.fill_block(block, float("nan"))
            self.free.append(block)

    def copy(self, src: int, dst: int, rows: int) -> None:
        """Copy the first `rows` positions of block src into block dst (copy-on-write of a partial block)."""
        self.pool.copy_block(src, dst, rows)

    def fork(self, blocks: list[int], length: int) -> list[int] | None:
        """The block list of a new holder of positions [0, length) of `blocks`: the full blocks shared (one more
        reference each), the partial last one copied (copy-on-write: the holder writes past `length`). None if
        no block is free for the copy (nothing is taken then)."""
        full, part = divmod(length, self.size)
        if part and not self.free:
            return None
        out = list(blocks[:full])
        for b in out:
            self.ref(b)
        if part:
            b = self.allocate()
            self.copy(blocks[full], b, part)
            out.append(b)
        return out

    def finite(self, blocks: list[int], length: int):
        """Whether the latents of the first `length` positions held by `blocks` are finite (a device bool)."""
        return self.pool.finite_blocks(blocks, length)
