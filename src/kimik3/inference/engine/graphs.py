"""CUDA graphs of the engine's static steps: decode-only steps and graphed verification steps replay a graph
captured per (batch bucket, span bucket, row length), with static shapes, padding rows on the pool's scratch slot and
block, and block tables read from a persistent device table indexed by slot (`BlockTable`: updated by the blocks each
step adds, never rebuilt). The span bucket is the power of two of blocks that covers the step's longest sequence,
so a step attends over at most twice the cached keys whatever `max_model_len` is; a bucket's graph is captured the
first time a step needs it.

With speculative decoding a step whose rows are all short and some verify a draft replays a verification graph:
every row padded to 1 + k tokens, k the smallest of the engine's draft lengths that holds the step's longest draft
(the padding is never kept), KDA's recurrent kernel over them, and each KDA layer's saved inputs copied into buffers
every verification graph shares (`VerifyBuffers`), which the commit graph of as many rows and tokens reads.

A graph is handed what its step reads (the model, the state pool, the block table, the tapped layers), never the
runner. Legend: S slots, MB blocks per table, R rows, L row length, T = R*L packed tokens, V vocabulary.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable

import torch
from torch import Tensor, nn

from kimik3.inference.engine.scheduler import Chunk
from kimik3.inference.spec.taps import tapped
from kimik3.model.state import KDAView, StatePool
from kimik3.model.step import uniform_step
from kimik3.ops.backend import to_device
from kimik3.ops.moe.tiered import graph_holes

GRAPH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MIN_SPAN_BLOCKS = 16  # the smallest key span a graph is captured for (1,024 tokens in blocks of 64)
# the memory the verification graphs' saved KDA inputs may take (`VerifyBuffers`, shared by all of them): the
# graphed rows are the batch buckets that fit (`verify_graph_rows`); a larger verifying batch runs eagerly
VERIFY_BUFFER_BYTES = 1 << 30


def span_bucket(blocks: int, max_blocks: int) -> int:
    """Blocks of key span a graph attends over for a longest sequence of `blocks` blocks."""
    span = MIN_SPAN_BLOCKS
    while span < blocks:
        span *= 2
    return min(span, max_blocks)


class BlockTable:
    """Each slot's block list on the device ([S+1, MB], the scratch slot's row all scratch block), kept in step
    with the sequences' host lists by writing only the entries that changed."""

    def __init__(self, pool: StatePool, max_blocks: int):
        self.pad = pool.scratch_block
        self.table = torch.full((pool.num_slots + 1, max_blocks), self.pad, dtype=torch.long, device=pool.device)
        self.rows: list[list[int]] = [[] for _ in range(pool.num_slots + 1)]

    def sync(self, chunks: list[Chunk]) -> None:
        idx, val = [], []
        for c in chunks:
            slot, blocks = c.seq.slot, c.seq.blocks
            have = self.rows[slot]
            start = len(have) if blocks[: len(have)] == have else 0
            if start == 0 and have:  # a new holder of the slot: clear what the last one left past its blocks
                idx.extend(slot * self.table.shape[1] + j for j in range(len(blocks), len(have)))
                val.extend([self.pad] * (len(have) - len(blocks)))
            idx.extend(slot * self.table.shape[1] + j for j in range(start, len(blocks)))
            val.extend(blocks[start:])
            self.rows[slot] = list(blocks)
        if idx:
            host = torch.tensor([idx, val], dtype=torch.long)
            dev = to_device(host, self.table.device)
            self.table.view(-1).index_copy_(0, dev[0], dev[1])


def verify_graph_rows(pool: StatePool, num_kda: int, row_len: int, sizes: list[int],
                      budget: int = VERIFY_BUFFER_BYTES) -> list[int]:
    """The batch buckets of `sizes` that get verification graphs: those whose `VerifyBuffers` rows fit `budget`.
    Per row and KDA layer the buffers hold k, v, g [L, H, K] and beta [L, H] fp32 and the three pre-conv inputs
    [L+W-1, P]: at K3's widths (96 heads of 128, a window of 4) and 1 + k = 8, 1.4 MB, so ~97 MB a row over its 69
    KDA layers (8 rows fit 1 GiB), 12.6 MB a row for slice-12's 9 (all 64 fit)."""
    _, _, H, K, _ = pool.recurrent.shape
    W1, P = pool.conv.shape[-2:]
    size = pool.dtype.itemsize
    per_row = num_kda * (3 * row_len * H * K * size + row_len * H * 4 + 3 * (row_len + W1) * P * size)
    return [n for n in sizes if n * per_row <= budget]


class VerifyBuffers:
    """Per KDA layer, static buffers for a verification step's saved inputs (`KDAStepIO.saved`: k, v, g, beta
    [R, L, ...], q/k/v pre-conv inputs [R, L+W-1, P]) of up to `max_rows` rows of up to `max_len` tokens, allocated
    at first use. Each is one flat tensor: the graphs of R rows of L tokens copy into (and the commit graphs read) a
    contiguous view of its front, so every verification width shares the memory."""

    def __init__(self, pool: StatePool, num_kda: int, max_rows: int, max_len: int):
        self.pool, self.num_kda, self.max_rows, self.max_len = pool, num_kda, max_rows, max_len
        self.flat: list[tuple[Tensor, ...]] | None = None

    def _shapes(self, R: int, L: int) -> tuple[tuple[int, ...], ...]:
        _, _, H, K, _ = self.pool.recurrent.shape
        W1, P = self.pool.conv.shape[-2:]
        return (R, L, H, K), (R, L, H, K), (R, L, H, K), (R, L, H), *((R, L + W1, P),) * 3

    def __call__(self, rows: int, row_len: int) -> list[tuple[Tensor, ...]]:
        p = self.pool
        dtypes = (p.dtype,) * 3 + (torch.float32,) + (p.dtype,) * 3
        if self.flat is None:
            full = self._shapes(self.max_rows, self.max_len)
            self.flat = [tuple(torch.zeros(math.prod(s), dtype=d, device=p.device) for s, d in zip(full, dtypes))
                         for _ in range(self.num_kda)]
        shapes = self._shapes(rows, row_len)
        return [tuple(t[: math.prod(s)].view(s) for t, s in zip(layer, shapes)) for layer in self.flat]


class Pieces:
    """A call captured as CUDA graphs cut where host-side work must run (tiered experts: `graph_holes`): replaying
    it replays each graph in order with its hole's work between. Without holes: one graph."""

    def __init__(self, handle):
        self.handle, self.graphs, self.holes = handle, [], []

    def begin(self) -> None:
        self.graphs.append(torch.cuda.CUDAGraph())
        self.graphs[-1].capture_begin(pool=self.handle)

    def end(self) -> None:
        self.graphs[-1].capture_end()

    def replay(self) -> None:
        for i, graph in enumerate(self.graphs):
            graph.replay()
            if i < len(self.holes):
                self.holes[i]()


def capture(fn: Callable[[], object], handle, warmups: int):
    """fn() run `warmups` times on a side stream, outside any graph, then captured (in pieces, where tiered experts
    cut it) into CUDA graphs in the memory pool `handle`: (the `Pieces`, what the captured call returned: tensors
    each replay refills)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    pieces = Pieces(handle)
    # no garbage collection inside a capture: an earlier engine's objects freed there release pinned host buffers,
    # whose allocator records and queries CUDA events, calls that invalidate a global-mode capture (the likeliest
    # cause of bench_spec's cudaErrorStreamCaptureInvalidated, raised at the next launch, fla's gated norm, when
    # a k=3 engine captured after k=7 engines in one process; not reproduced off the device). vLLM and SGLang
    # collect before capturing and keep the collector off during it, for the same reason.
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.stream(torch.cuda.Stream()), torch.no_grad(), graph_holes(pieces) as holes:
            pieces.begin()
            out = fn()
            pieces.end()
    finally:
        if was_enabled:
            gc.enable()
    pieces.holes = holes
    return pieces, out


class StepGraph:
    """One captured uniform step for `rows` sequences of `row_len` tokens (real ones first, then padding on the
    scratch rows) whose keys span `span` blocks at most: decode (row_len 1) or verification (1 + k, its KDA layers'
    saved inputs copied into `buffers`).

    With `handle=None` nothing is captured and each call runs the same static step eagerly (the CPU tests check
    the padding this way)."""

    def __init__(self, model: nn.Module, pool: StatePool, table: BlockTable, taps: tuple[int, ...], rows: int,
                 span: int, row_len: int, handle, buffers: list[tuple[Tensor, ...]] | None = None):
        self.model, self.pool, self.table, self.taps = model, pool, table, taps
        self.rows, self.span, self.row_len, self.buffers = rows, span, row_len, buffers
        # the inputs are views of one buffer, refilled by one host-to-device copy per step
        self.inputs = torch.zeros((row_len + 2) * rows, dtype=torch.long, device=pool.device)
        ids, self.slots, self.cached = self.inputs.split([row_len * rows, rows, rows])
        self.ids = ids.view(1, row_len * rows)
        self.slots.fill_(pool.scratch_slot)
        self.graph = None
        if handle is not None:  # warmed up twice on the scratch rows (autotuning, lazy init)
            self.graph, self.logits = capture(self._forward, handle, warmups=2)

    def _forward(self) -> Tensor:
        """The static step -> logits [T, V] fp32; the tapped hidden states into `found` (under a graph, tensors each
        replay refills)."""
        p = self.pool
        step = uniform_step(self.slots, self.cached, self.table.table[self.slots, : self.span], row_len=self.row_len,
                            block_size=p.block_size, max_len=self.span * p.block_size, conv_window=p.conv_window,
                            pad_block=p.scratch_block)
        with tapped(self.model, self.taps) as self.found:
            logits, ios = self.model.run_step(self.ids, p, step)
        for buffer, io in zip(self.buffers or (), ios):
            for b, t in zip(buffer, io.saved):
                b.copy_(t)
        return logits[0].float()

    def timed(self, repeats: int = 3) -> float:
        """Seconds of this step on the scratch rows with random token ids (routed as text spreads them, not all
        to one expert set): the fastest of `repeats` runs after an untimed one."""
        g = torch.Generator().manual_seed(0)
        self.ids.copy_(torch.randint(0, self.model.config.vocab_size, self.ids.shape, generator=g))
        self.slots.fill_(self.pool.scratch_slot)
        self.cached.zero_()
        cuda = self.pool.device.type == "cuda"
        times = []
        for _ in range(repeats + 1):
            if cuda:
                torch.cuda.synchronize(self.pool.device)
            t0 = time.perf_counter()
            if self.graph is not None:
                self.graph.replay()
            else:
                self._forward()
            if cuda:
                torch.cuda.synchronize(self.pool.device)
            times.append(time.perf_counter() - t0)
        return min(times[1:])  # noise (other processes, the allocator) only ever adds time

    def __call__(self, chunks: list[Chunk]) -> Tensor:
        pad, L = self.rows - len(chunks), self.row_len
        ids = [t for c in chunks for t in c.seq.row_tokens(c.num_tokens) + [0] * (L - c.num_tokens)]
        host = torch.tensor(ids + [0] * (pad * L) + [c.seq.slot for c in chunks]
                            + [self.pool.scratch_slot] * pad + [c.seq.num_computed for c in chunks] + [0] * pad)
        self.inputs.copy_(host.pin_memory() if self.inputs.is_cuda else host, non_blocking=True)
        if self.graph is None:
            return self._forward()
        self.graph.replay()
        return self.logits


def commit_kda(kda: list[tuple[nn.Module, KDAView]], saved: list[tuple[Tensor, ...]], slots_N: Tensor,
               keep_N: Tensor) -> None:
    """Each verifying slot's KDA state after the first keep_N[n] tokens of its row (`KimiDeltaAttention.commit`),
    for every KDA layer (attention module, its pool view) from its saved inputs."""
    for (attn, view), layer_saved in zip(kda, saved):
        attn.commit(view, layer_saved, slots_N, keep_N)


class CommitGraph:
    """`commit_kda` captured for the verification graphs of `rows` rows of one length (their buffers are shared):
    the slots and the kept counts are copied into its inputs before each replay."""

    def __init__(self, kda: list[tuple[nn.Module, KDAView]], buffers: list[tuple[Tensor, ...]], pool: StatePool,
                 rows: int, handle):
        self.inputs = torch.zeros(2 * rows, dtype=torch.long, device=pool.device)
        self.slots, self.keep = self.inputs.split([rows, rows])
        self.slots.fill_(pool.scratch_slot)
        self.keep.fill_(1)
        self.graph, _ = capture(lambda: commit_kda(kda, buffers, self.slots, self.keep), handle, warmups=1)

    def __call__(self, slots_N: Tensor, keep: Tensor) -> None:
        self.slots.copy_(slots_N)
        self.keep.copy_(keep.pin_memory(), non_blocking=True)
        self.graph.replay()
