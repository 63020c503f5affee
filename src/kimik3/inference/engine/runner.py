"""The forward of one engine step: pack the scheduled chunks in one row, build the `PagedStep`, run the model,
return the logits of the rows that sample and the KDA states the step exported. Decode-only steps replay a
CUDA graph captured per batch bucket (static shapes: the MLA keys span the whole block table, padding rows
point at the pool's scratch slot and block).

Legend: N sequences in the step, T packed tokens, M logit rows, MB blocks per block table, V vocabulary.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor, nn

from kimik3.inference.engine.scheduler import Chunk
from kimik3.model.cache import PagedCache, paged_step
from kimik3.model.mla import EXPANDED_FROM_TOKENS

GRAPH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class ModelRunner:
    def __init__(self, model: nn.Module, cache: PagedCache, max_blocks: int, use_cuda_graphs: bool,
                 max_num_seqs: int):
        self.model, self.cache, self.max_blocks = model, cache, max_blocks
        self.device = next(model.parameters()).device
        self.graphs: dict[int, _DecodeGraph] = {}
        if use_cuda_graphs:
            sizes = [n for n in GRAPH_BUCKETS if n < max_num_seqs] + [max_num_seqs]
            pool = torch.cuda.graph_pool_handle()  # one memory pool for all: the largest is captured first
            for n in sorted(sizes, reverse=True):
                self.graphs[n] = _DecodeGraph(self, n, pool)

    def _tables(self, chunks: list[Chunk], rows: int | None = None) -> Tensor:
        """[rows, MB] block tables (host), padded with the scratch block; one tensor built from one list."""
        pad = self.cache.scratch_block
        table = [c.seq.blocks + [pad] * (self.max_blocks - len(c.seq.blocks)) for c in chunks]
        table += [[pad] * self.max_blocks] * ((rows or len(chunks)) - len(chunks))
        return torch.tensor(table, dtype=torch.long)

    def run(self, chunks: list[Chunk], logit_rows: list[int]) -> tuple[Tensor, list | None]:
        """Run the chunks; returns (logits [M, V] fp32 at packed rows `logit_rows`, the step's KDA exports)."""
        lens = [c.num_tokens for c in chunks]
        if max(lens) == 1 and len(chunks) in self._graph_sizes() and not any(c.exports for c in chunks):
            logits = self.graphs[self._bucket(len(chunks))](chunks)
            return take_rows(logits, logit_rows), None
        ids = torch.tensor([t for c in chunks for t in c.seq.tokens[c.seq.num_computed:
                                                                     c.seq.num_computed + c.num_tokens]])
        starts = torch.tensor([0, *lens]).cumsum(0)[:-1]
        cached = torch.tensor([c.seq.num_computed for c in chunks])
        span = max(c.seq.num_computed + c.num_tokens for c in chunks)
        d = self.device
        step = paged_step(total=sum(lens), slots=torch.tensor([c.seq.slot for c in chunks], device=d),
                          starts=starts.to(d), lens=torch.tensor(lens, device=d), cached=cached.to(d),
                          block_tables=self._tables(chunks).to(d), block_size=self.cache.block_size,
                          conv_window=self.cache.conv_window, max_len=max(lens), span=span,
                          expanded_from=EXPANDED_FROM_TOKENS,
                          exports=[c.exports for c in chunks] if any(c.exports for c in chunks) else None)
        logits = self.model(ids[None].to(d), cache=self.cache, step=step,
                            logits_at=torch.tensor(logit_rows, dtype=torch.long, device=d))[0]
        return logits.float(), step.kda_exports

    def _graph_sizes(self) -> range:
        return range(1, max(self.graphs) + 1) if self.graphs else range(0)

    def _bucket(self, n: int) -> int:
        return next(b for b in sorted(self.graphs) if b >= n)


class _DecodeGraph:
    """One captured decode step for `rows` sequences (real ones first, then padding on the scratch rows).

    With `pool=None` nothing is captured and each call runs the same static step eagerly (the CPU tests check
    the padding and the whole-table key span this way)."""

    def __init__(self, runner: ModelRunner, rows: int, pool):
        # a proxy, not a reference: the runner owns its graphs, and a cycle would keep the captured graphs' memory
        # pool (and the cache) alive after `del engine` until the cycle collector happens to run
        self.runner, self.rows = weakref.proxy(runner), rows
        cache, d = runner.cache, runner.device
        # the inputs are views of one buffer, refilled by one host-to-device copy per step
        MB = runner.max_blocks
        self.inputs = torch.zeros(rows * (3 + MB), dtype=torch.long, device=d)
        self.ids, self.slots, self.cached, tables = self.inputs.split([rows, rows, rows, rows * MB])
        self.ids, self.tables = self.ids.view(1, rows), tables.view(rows, MB)
        self.slots.fill_(cache.scratch_slot)
        self.tables.fill_(cache.scratch_block)
        self.graph = None
        if pool is None:
            return
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.no_grad():
            for _ in range(2):  # warm up (autotuning, lazy init) on the scratch rows, outside the graph
                self._forward()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool), torch.no_grad():
            self.logits = self._forward()

    def _forward(self) -> Tensor:
        r, d = self.runner, self.runner.device
        ones = torch.ones(self.rows, dtype=torch.long, device=d)
        step = paged_step(total=self.rows, slots=self.slots, starts=torch.arange(self.rows, device=d), lens=ones,
                          cached=self.cached, block_tables=self.tables, block_size=r.cache.block_size,
                          conv_window=r.cache.conv_window, max_len=1, span=r.max_blocks * r.cache.block_size,
                          expanded_from=EXPANDED_FROM_TOKENS)
        return r.model(self.ids, cache=r.cache, step=step)[0].float()

    def __call__(self, chunks: list[Chunk]) -> Tensor:
        cache, pad = self.runner.cache, self.rows - len(chunks)
        host = torch.cat([torch.tensor([c.seq.tokens[c.seq.num_computed] for c in chunks] + [0] * pad
                                       + [c.seq.slot for c in chunks] + [cache.scratch_slot] * pad
                                       + [c.seq.num_computed for c in chunks] + [0] * pad),
                          self.runner._tables(chunks, self.rows).flatten()])
        self.inputs.copy_(host.pin_memory() if self.inputs.is_cuda else host, non_blocking=True)
        if self.graph is None:
            return self._forward()
        self.graph.replay()
        return self.logits


def take_rows(x: Tensor, index: list[int]) -> Tensor:
    """x[index] for a host list of row ids; a plain slice (no index tensor, no host-to-device copy that waits
    for the queued step) when they are 0..n-1, as in every decode step."""
    if index == list(range(len(index))):
        return x[: len(index)]
    return x[torch.tensor(index, device=x.device)]
