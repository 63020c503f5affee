"""Inference state: what each attention layer keeps per sequence (its declared spec), one pool that allocates it
stacked over layers, and the `Step` that says where a forward's tokens read and write it.

Legend: Lk KDA layers, Lm MLA layers, S slots, Nb MLA blocks of Bs tokens (X = (Nb+1)*Bs latent rows), H heads,
K = V KDA head dim, P = H*K, W conv window, C MLA latent rank, R shared-key width; in a step: N sequences,
T packed tokens, MB blocks per block table, E exported snapshots.

KDA keeps a fixed size per sequence (a slot): the fp32 recurrent state [H, K, V] and the last W-1 pre-conv inputs
of q, k and v [W-1, P], whatever the context. MLA keeps the normed latent and the shared key, C+R (576 for K3)
per token, in blocks of Bs rows that a sequence's block table maps. AttnRes keeps nothing: it mixes over depth,
per token, within one forward. The last slot and the last block are scratch rows for padding (CUDA graphs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class KDAStateSpec:
    """Per sequence: recurrent [H, K, K] fp32 and three conv tails [W-1, P] (H: this rank's heads under TP)."""

    num_heads: int
    head_dim: int
    proj_dim: int
    conv_window: int


@dataclass(frozen=True)
class MLAStateSpec:
    """Per token: the latent row [C+R]."""

    width: int


@dataclass
class KDAView:
    """One KDA layer's rows of the pool (views)."""

    recurrent: Tensor  # [S+1, H, K, V] fp32
    conv_q: Tensor  # [S+1, W-1, P]
    conv_k: Tensor
    conv_v: Tensor


@dataclass
class MLAView:
    """One MLA layer's latent rows (a view): row b*Bs + i holds position i of block b."""

    latent: Tensor  # [X, C+R]


@dataclass
class SlotState:
    """A copy of one slot over every KDA layer (a prefix snapshot)."""

    recurrent: Tensor  # [Lk, H, K, V] fp32
    conv: Tensor  # [Lk, 3, W-1, P]

    @property
    def nbytes(self) -> int:
        return self.recurrent.nbytes + self.conv.nbytes

    def finite(self) -> Tensor:
        """A device bool scalar (no host sync here)."""
        return torch.isfinite(self.recurrent).all() & torch.isfinite(self.conv).all()


class StatePool:
    """Every layer's inference state for `num_slots` sequences and `num_blocks` MLA blocks, allocated from the
    layers' declared specs: three stacked tensors, so a slot's copy, save or restore is one kernel per tensor.

    Args:
        specs: one per layer, in layer order (`state_specs(model)`).
    """

    def __init__(self, specs: list[KDAStateSpec | MLAStateSpec], num_slots: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        if num_slots < 1 or num_blocks < 1 or block_size < 1:
            raise ValueError(f"a state pool needs num_slots, num_blocks, block_size >= 1, got {num_slots}, "
                             f"{num_blocks}, {block_size}")
        self.num_slots, self.num_blocks, self.block_size = num_slots, num_blocks, block_size
        self.scratch_slot, self.scratch_block = num_slots, num_blocks
        self.dtype, self.device = dtype, torch.device(device)
        kda = [s for s in specs if isinstance(s, KDAStateSpec)]
        mla = [s for s in specs if isinstance(s, MLAStateSpec)]
        assert len(set(kda)) <= 1 and len(set(mla)) <= 1, "stacked state needs one spec per layer kind"
        S = num_slots + 1
        k = kda[0] if kda else KDAStateSpec(0, 0, 0, 1)
        self.conv_window = k.conv_window
        self.recurrent = torch.zeros(len(kda), S, k.num_heads, k.head_dim, k.head_dim, dtype=torch.float32,
                                     device=device)
        self.conv = torch.zeros(len(kda), 3, S, k.conv_window - 1, k.proj_dim, dtype=dtype, device=device)
        width = mla[0].width if mla else 0
        self.latent = torch.zeros(len(mla), (num_blocks + 1) * block_size, width, dtype=dtype, device=device)
        self.layers: list[KDAView | MLAView] = []
        i_k = i_m = 0
        for s in specs:
            if isinstance(s, KDAStateSpec):
                # indexed one by one: unbind's views (one op's several outputs) refuse in-place writes under autograd
                conv = self.conv[i_k]
                self.layers.append(KDAView(self.recurrent[i_k], conv[0], conv[1], conv[2]))
                i_k += 1
            else:
                self.layers.append(MLAView(self.latent[i_m]))
                i_m += 1

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot over every KDA layer (what one prefix snapshot costs)."""
        return self.recurrent[:, 0].nbytes + self.conv[:, :, 0].nbytes

    @property
    def block_bytes(self) -> int:
        """Bytes of one MLA block over every MLA layer."""
        return self.latent[:, : self.block_size].nbytes

    def nbytes(self) -> dict[str, int]:
        return {"kda_state": self.recurrent.nbytes, "kda_conv": self.conv.nbytes, "mla_latent": self.latent.nbytes}

    def fill_slot(self, slot: int, value: float) -> None:
        self.recurrent[:, slot].fill_(value)
        self.conv[:, :, slot].fill_(value)

    def copy_slot(self, src: int, dst: int) -> None:
        self.recurrent[:, dst].copy_(self.recurrent[:, src])
        self.conv[:, :, dst].copy_(self.conv[:, :, src])

    def save_slot(self, slot: int) -> SlotState:
        return SlotState(self.recurrent[:, slot].clone(), self.conv[:, :, slot].clone())

    def load_slot(self, slot: int, saved: SlotState) -> None:
        """Copy-on-write restore: the snapshot is copied into the sequence's own slot, never shared."""
        self.recurrent[:, slot].copy_(saved.recurrent)
        self.conv[:, :, slot].copy_(saved.conv)

    def fill_block(self, block: int, value: float) -> None:
        self.latent[:, block * self.block_size: (block + 1) * self.block_size].fill_(value)

    def copy_block(self, src: int, dst: int, rows: int) -> None:
        """The first `rows` positions of block src into block dst (copy-on-write of a partial block)."""
        Bs = self.block_size
        self.latent[:, dst * Bs: dst * Bs + rows].copy_(self.latent[:, src * Bs: src * Bs + rows])

    def finite_blocks(self, blocks: list[int], length: int) -> Tensor:
        """Whether the latents of the first `length` positions held by `blocks` are all finite (device bool)."""
        if not blocks or not length:
            return torch.ones((), dtype=torch.bool, device=self.device)
        Bs = self.block_size
        rows = (torch.tensor(blocks)[:, None] * Bs + torch.arange(Bs)).flatten()[:length]
        return torch.isfinite(self.latent[:, rows.to(self.device)]).all()


def state_specs(lm) -> list[KDAStateSpec | MLAStateSpec]:
    """Each layer's declared state, in order, read from the (possibly tensor-parallel) attention modules."""
    return [layer.self_attn.state_spec() for layer in lm.model.layers]
