"""The forward of one engine step: pack the scheduled chunks in one row, build the `Step`, run the model, return
the logits of the rows that sample and the KDA states the step exported. Decode-only steps replay a CUDA graph
captured per (batch bucket, span bucket): static shapes, padding rows on the pool's scratch slot and block, and
block tables read from a persistent device table indexed by slot (updated by the blocks each step adds, never
rebuilt). The span bucket is the power of two of blocks that covers the step's longest sequence, so a step
attends over at most twice the cached keys whatever `max_model_len` is; a bucket's graph is captured the first
time a step needs it.

With speculative decoding a step whose rows are all short and some verify a draft replays a verification graph:
every row padded to 1 + k tokens (the padding is never kept), KDA's recurrent kernel over them, and each KDA
layer's inputs saved into buffers the graphs share. After verification `commit` writes each verifying sequence's
KDA slot for the tokens it keeps (`KimiDeltaAttention.commit`); its MLA latents past them are simply not counted.

Legend: N sequences in the step, T packed tokens, M logit rows, MB blocks per table, S slots, V vocabulary.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from kimik3.inference.engine.request import Sequence
from kimik3.inference.engine.sampler import to_device
from kimik3.inference.engine.scheduler import Chunk
from kimik3.inference.spec.taps import stack_taps, tapped
from kimik3.lora.serving import ServedAdapters
from kimik3.model.moe import warm_experts
from kimik3.model.state import KDAView, StatePool
from kimik3.model.step import VerifyRows, build_step, uniform_step

GRAPH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MIN_SPAN_BLOCKS = 16  # the smallest key span a graph is captured for (1,024 tokens in blocks of 64)
# the most rows a verification graph has: its saved KDA inputs take ~1.4 MB per row and KDA layer at K3's widths
# (1 + k = 8 tokens), so larger verifying batches run eagerly (where speculation gains least)
VERIFY_GRAPH_ROWS = 16


@dataclass
class StepOutput:
    """A step's results: the logits [M, V] fp32 at the asked rows, the KDA states it exported (prefix snapshots),
    what `ModelRunner.commit` needs when rows verified drafts, and the tapped layers' hidden states [T, n*D] of
    its packed tokens when the runner taps any (a drafter's input)."""

    logits: Tensor
    exports: list | None = None
    verification: Verification | None = None
    taps: Tensor | None = None


@dataclass
class Verification:
    """What a step with drafts leaves for `ModelRunner.commit`: its verifying sequences in row order, the tokens
    each brought, the step's saved KDA inputs, and their slots ([Nv], a graph's padding rows on the scratch)."""

    seqs: list[Sequence]
    lens: list[int]
    rows: VerifyRows
    slots: Tensor


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
            dev = host.pin_memory().to(self.table.device, non_blocking=True) if self.table.is_cuda else host
            self.table.view(-1).index_copy_(0, dev[0], dev[1])


class ModelRunner:
    """Runs the engine's steps. `verify_len` (1 + k, with speculative decoding) is the row length of the
    verification graphs; 1 captures decode graphs only. `taps`: decoder layers whose residual stream each step
    returns (`kimik3.inference.spec.taps`; a graph returns the hidden states its capture recorded)."""

    def __init__(self, model: nn.Module, pool: StatePool, max_blocks: int, use_cuda_graphs: bool,
                 max_num_seqs: int, adapters: ServedAdapters | None = None, verify_len: int = 1,
                 taps: tuple[int, ...] = ()):
        self.model, self.pool, self.max_blocks, self.adapters = model, pool, max_blocks, adapters
        self.taps = taps
        self.device = next(model.parameters()).device
        self.table = BlockTable(pool, max_blocks)
        self.sizes = sorted({n for n in GRAPH_BUCKETS if n < max_num_seqs} | {max_num_seqs})
        self.verify_len = verify_len
        self.verify_sizes = sorted({n for n in self.sizes if n < VERIFY_GRAPH_ROWS} | {min(VERIFY_GRAPH_ROWS,
                                                                                            self.sizes[-1])})
        self.kda = [(layer.self_attn, view) for layer, view in zip(model.model.layers, pool.layers)
                    if isinstance(view, KDAView)]
        self._verify_buffers: list[tuple[Tensor, ...]] | None = None
        self.graphs: dict[tuple[int, int, int], _StepGraph] = {}  # (rows, span, row_len)
        self.commit_graphs: dict[int, _CommitGraph] = {}  # rows
        # on CUDA one memory pool for all the graphs; on the CPU the same static steps run eagerly (their form)
        self.static = use_cuda_graphs
        self.handle = torch.cuda.graph_pool_handle() if use_cuda_graphs and self.device.type == "cuda" else None
        if self.handle is not None:
            for n in reversed(self.sizes):  # the largest first: the smaller ones reuse its pool memory
                self.graph(n, self.span_bucket(1), 1)
            if verify_len > 1:
                for n in reversed(self.verify_sizes):
                    self.graph(n, self.span_bucket(1), verify_len)
                    self._commit_graph(n)

    def span_bucket(self, blocks: int) -> int:
        """Blocks of key span a graph attends over for a longest sequence of `blocks` blocks."""
        span = MIN_SPAN_BLOCKS
        while span < blocks:
            span *= 2
        return min(span, self.max_blocks)

    def graph(self, rows: int, span: int, row_len: int) -> _StepGraph:
        g = self.graphs.get((rows, span, row_len))
        if g is None:
            g = self.graphs[rows, span, row_len] = _StepGraph(self, rows, span, row_len, self.handle)
        return g

    def verify_buffers(self, rows: int) -> list[tuple[Tensor, ...]]:
        """Per KDA layer, the first `rows` rows of the buffers the verification graphs save their inputs into."""
        if self._verify_buffers is None:
            R, L, p = self.verify_sizes[-1], self.verify_len, self.pool
            _, _, H, K, _ = p.recurrent.shape
            W1, P = p.conv.shape[-2:]
            new = lambda *shape, dtype=p.dtype: torch.zeros(*shape, dtype=dtype, device=p.device)  # noqa: E731
            self._verify_buffers = [(new(R, L, H, K), new(R, L, H, K), new(R, L, H, K),
                                     new(R, L, H, dtype=torch.float32), *(new(R, L + W1, P) for _ in range(3)))
                                    for _ in self.kda]
        return [tuple(t[:rows] for t in layer) for layer in self._verify_buffers]

    def run(self, chunks: list[Chunk], logit_rows: list[int], media: list | None = None) -> StepOutput:
        """Run the chunks; the logits are those of packed rows `logit_rows`. `media[i]`: None, or (rows of chunk
        i, their [n, D] embeddings) spliced over the token embeddings."""
        lens = [c.num_tokens for c in chunks]
        exports = [c.exports for c in chunks] if any(c.exports for c in chunks) else None
        images = media is not None and any(m is not None for m in media)
        verify = [i for i, c in enumerate(chunks) if c.seq.draft is not None]
        L = self.verify_len if verify else 1
        sizes = self.verify_sizes if verify else self.sizes
        Bs = self.pool.block_size
        if (max(lens) <= L and self.static and len(chunks) <= sizes[-1] and exports is None and not images
                and max(c.seq.num_computed for c in chunks) + L <= self.max_blocks * Bs):
            self.table.sync(chunks)
            rows = next(b for b in sizes if b >= len(chunks))
            span = self.span_bucket(max(max(len(c.seq.blocks), -(-(c.seq.num_computed + L) // Bs))
                                        for c in chunks))
            g = self.graph(rows, span, L)
            logits = g(chunks)
            # packed row r of chunk i is row i * L + (r - its start) of the graph's padded rows
            padded = [i * L + j for i, n in enumerate(lens) for j in range(n)]
            taps = take_rows(stack_taps(g.found)[0], padded) if self.taps else None
            if L == 1:
                return StepOutput(take_rows(logits, logit_rows), taps=taps)
            return StepOutput(take_rows(logits, [padded[r] for r in logit_rows]), None,
                              Verification([c.seq for c in chunks], lens, g.step.verify, g.slots), taps)
        ids = torch.tensor([t for c in chunks for t in c.seq.row_tokens(c.num_tokens)])
        step = build_step(slots=[c.seq.slot for c in chunks], cached=[c.seq.num_computed for c in chunks],
                          lens=lens, tables=[c.seq.blocks for c in chunks], block_size=Bs,
                          conv_window=self.pool.conv_window, pad_block=self.pool.scratch_block, device=self.device,
                          exports=exports, verify=verify)
        ids = ids[None].to(self.device)
        embeds = None
        if images:
            embeds = self.model.model.embed_tokens(ids)
            start = 0
            for c, m in zip(chunks, media):
                if m is not None:
                    embeds[0, [start + r for r in m[0]]] = m[1].to(embeds.dtype)
                start += c.num_tokens
        with self._adapter_rows(chunks), tapped(self.model, self.taps) as found:
            logits = self.model(ids, state=self.pool, step=step, inputs_embeds=embeds,
                                logits_at=torch.tensor(logit_rows, dtype=torch.long, device=self.device))[0]
        verification = None
        if verify:
            verification = Verification([chunks[i].seq for i in verify], [lens[i] for i in verify], step.verify,
                                        step.slots[step.verify.seqs])
        return StepOutput(logits.float(), step.kda_exports, verification,
                          stack_taps(found)[0] if self.taps else None)

    def commit(self, v: Verification, rejected: dict[Sequence, int]) -> None:
        """Write each verifying sequence's KDA slot for the tokens of its row it keeps: all of them but its
        `rejected` drafts and, in a graph, its padding."""
        keep = [n - rejected.get(seq, 0) for seq, n in zip(v.seqs, v.lens)]
        keep += [1] * (v.slots.shape[0] - len(keep))  # a graph's padding rows (the scratch slot)
        host = torch.tensor(keep)
        if v.rows.buffers is not None and self.handle is not None:  # a graph's step: a graph's commit
            self._commit_graph(len(keep))(v.slots, host)
            return
        keep_N = host.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else host
        self._commit(v.rows.saved, v.slots, keep_N)

    def _commit(self, saved: list[tuple[Tensor, ...]], slots_N: Tensor, keep_N: Tensor) -> None:
        for (attn, view), layer_saved in zip(self.kda, saved):
            attn.commit(view, layer_saved, slots_N, keep_N)

    def _commit_graph(self, rows: int) -> _CommitGraph:
        g = self.commit_graphs.get(rows)
        if g is None:
            g = self.commit_graphs[rows] = _CommitGraph(self, rows, self.handle)
        return g

    def _adapter_rows(self, chunks: list[Chunk]):
        """Each packed token row's LoRA adapter for the forward (-1: the base), when the engine serves some."""
        a = self.adapters
        if a is None:
            return contextlib.nullcontext()
        index = [k for c in chunks for k in [a.index(c.seq.group.request.adapter)] * c.num_tokens]
        return a.rows(index, self.device)

    def warmup(self, max_tokens: int) -> None:
        """Run each shape the engine meets once on the scratch rows, so nothing compiles or autotunes after it:
        a prefill chunk per power of two up to `max_tokens` (the expanded and the latent attention), alone and
        with decode rows beside it (the graphs ran when they were captured)."""
        warm_experts(self.model, max_tokens)  # steps carry at most max_tokens (chunks and decode rows)
        scratch, Bs, n = self.pool.scratch_slot, self.pool.block_size, 1
        while n <= max_tokens:
            for lens in ([n], [n, 1, 1]):
                tables = [[self.pool.scratch_block] * -(-m // Bs) for m in lens]
                step = build_step(slots=[scratch] * len(lens), cached=[0] * len(lens), lens=lens, tables=tables,
                                  block_size=Bs, conv_window=self.pool.conv_window,
                                  pad_block=self.pool.scratch_block, device=self.device)
                ids = torch.zeros(1, sum(lens), dtype=torch.long, device=self.device)
                self.model(ids, state=self.pool, step=step,
                           logits_at=torch.zeros(1, dtype=torch.long, device=self.device))
            n *= 2
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def capture(fn, handle, warmups: int):
    """fn() run `warmups` times on a side stream, outside any graph, then captured into a CUDA graph in the memory
    pool `handle`: (the graph, what the captured call returned: tensors each replay refills)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=handle), torch.no_grad():
        out = fn()
    return graph, out


class _StepGraph:
    """One captured uniform step for `rows` sequences of `row_len` tokens (real ones first, then padding on the
    scratch rows) whose keys span `span` blocks at most: decode (row_len 1) or verification (1 + k).

    With `handle=None` nothing is captured and each call runs the same static step eagerly (the CPU tests check
    the padding this way)."""

    def __init__(self, runner: ModelRunner, rows: int, span: int, row_len: int, handle):
        # a proxy, not a reference: the runner owns its graphs, and a cycle would keep the captured graphs' memory
        # pool (and the state pool) alive after `del engine` until the cycle collector happens to run
        self.runner, self.rows, self.span, self.row_len = weakref.proxy(runner), rows, span, row_len
        # the inputs are views of one buffer, refilled by one host-to-device copy per step
        self.inputs = torch.zeros((row_len + 2) * rows, dtype=torch.long, device=runner.device)
        ids, self.slots, self.cached = self.inputs.split([row_len * rows, rows, rows])
        self.ids = ids.view(1, row_len * rows)
        self.slots.fill_(runner.pool.scratch_slot)
        self.graph = None
        if handle is not None:  # warmed up twice on the scratch rows (autotuning, lazy init)
            self.graph, self.logits = capture(self._forward, handle, warmups=2)

    def _forward(self) -> Tensor:
        """The static step; the tapped hidden states into `found` (under a graph, tensors each replay refills)."""
        r = self.runner
        self.step = uniform_step(self.slots, self.cached, r.table.table[self.slots, : self.span],
                                 row_len=self.row_len, block_size=r.pool.block_size,
                                 max_len=self.span * r.pool.block_size, conv_window=r.pool.conv_window,
                                 pad_block=r.pool.scratch_block)
        if self.step.verify is not None:
            self.step.verify.buffers = r.verify_buffers(self.rows)
        with tapped(r.model, r.taps) as self.found:
            return r.model(self.ids, state=r.pool, step=self.step)[0].float()

    def __call__(self, chunks: list[Chunk]) -> Tensor:
        pad, L = self.rows - len(chunks), self.row_len
        ids = [t for c in chunks for t in c.seq.row_tokens(c.num_tokens) + [0] * (L - c.num_tokens)]
        host = torch.tensor(ids + [0] * (pad * L) + [c.seq.slot for c in chunks]
                            + [self.runner.pool.scratch_slot] * pad + [c.seq.num_computed for c in chunks] + [0] * pad)
        self.inputs.copy_(host.pin_memory() if self.inputs.is_cuda else host, non_blocking=True)
        if self.graph is None:
            return self._forward()
        self.graph.replay()
        return self.logits


class _CommitGraph:
    """`ModelRunner.commit` captured for the verification graphs of `rows` rows (their buffers are shared): the
    slots and the kept counts are copied into its inputs before each replay."""

    def __init__(self, runner: ModelRunner, rows: int, handle):
        self.inputs = torch.zeros(2 * rows, dtype=torch.long, device=runner.device)
        self.slots, self.keep = self.inputs.split([rows, rows])
        self.slots.fill_(runner.pool.scratch_slot)
        self.keep.fill_(1)
        saved = runner.verify_buffers(rows)
        self.graph, _ = capture(lambda: runner._commit(saved, self.slots, self.keep), handle, warmups=1)

    def __call__(self, slots_N: Tensor, keep: Tensor) -> None:
        self.slots.copy_(slots_N)
        self.keep.copy_(keep.pin_memory(), non_blocking=True)
        self.graph.replay()


def logit_rows(chunks: list[Chunk]) -> tuple[list[int], list, list]:
    """Which packed rows of a step's hidden state go through the LM head: (the rows, each sampling sequence with
    its first row among them (a sequence verifying a draft has 1 + len(draft) rows from there), and
    ((seq, first row, count), chunk) for the prompt-logprob rows)."""
    rows, samplers, prompt_lp = [], [], []
    start = 0
    for c in chunks:
        seq = c.seq
        done = c.num_tokens == seq.num_pending
        verify = 1 + len(seq.draft_tokens)  # the last committed token's row, then one per draft token
        if seq.params.prompt_logprobs is not None and seq.num_computed < seq.num_prompt:
            upto = min(c.num_tokens, seq.num_prompt - seq.num_computed)
            prompt_lp.append(((seq, len(rows), upto), c))
            rows.extend(range(start, start + upto))
            if done and upto < c.num_tokens:
                rows.append(start + c.num_tokens - 1)
        elif done:
            rows.extend(range(start + c.num_tokens - verify, start + c.num_tokens))
        if done:
            samplers.append((seq, len(rows) - verify))
        start += c.num_tokens
    return rows, samplers, prompt_lp


def take_rows(x: Tensor, index: list[int]) -> Tensor:
    """x[index] for a host list of row ids, queued behind the step that writes x (the index goes up through pinned
    memory, not a copy that waits for the step); a plain slice when they are 0..n-1, as in every decode step."""
    if index == list(range(len(index))):
        return x[: len(index)]
    return x[to_device(torch.tensor(index), x.device)]
