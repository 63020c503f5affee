"""The forward of one engine step: pack the scheduled chunks in one row, build the `Step`, run the model, return
the logits of the rows that sample, the KDA states the step exported and, for rows that verified drafts, what the
commit needs. Decode-only steps (and, with speculative decoding, steps of short rows that verify drafts) replay a
CUDA graph (graphs.py). After verification `commit` writes each verifying sequence's KDA slot for the tokens it keeps
(`KimiDeltaAttention.commit`); its MLA latents past them are simply not counted.

Legend: N sequences in the step, T packed tokens, M logit rows, V vocabulary.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from kimik3.inference.engine.graphs import (
    GRAPH_BUCKETS,
    BlockTable,
    CommitGraph,
    StepGraph,
    VerifyBuffers,
    commit_kda,
    span_bucket,
    verify_graph_rows,
)
from kimik3.inference.engine.request import Sequence
from kimik3.inference.engine.scheduler import Chunk
from kimik3.inference.spec.taps import stack_taps, tapped
from kimik3.lora.serving import ServedAdapters
from kimik3.model.moe import compile_experts, warm_experts
from kimik3.model.state import KDAView, StatePool
from kimik3.model.step import build_step, prompt_expanded_until
from kimik3.ops.backend import to_device


@dataclass
class StepOutput:
    """A step's results: the logits [M, V] fp32 at the asked rows, the KDA states it exported (prefix snapshots: per
    KDA layer (recurrent [E, H, K, V], conv q, k, v [E, W-1, P])), what `ModelRunner.commit` needs when rows
    verified drafts, and the tapped layers' hidden states [T, n*D] of its packed tokens when the runner taps any
    (a drafter's input)."""

    logits: Tensor
    exports: list[tuple[Tensor, ...]] | None = None
    verification: Verification | None = None
    taps: Tensor | None = None


@dataclass
class Verification:
    """What a step with drafts leaves for `ModelRunner.commit`: its verifying sequences in row order, the tokens
    each brought, each KDA layer's saved inputs of their rows, and their slots ([Nv], a graph's padding rows on the
    scratch); `row_len`: a graph's row length, its saved inputs the verification graphs' shared buffers (0: an
    eager step's own)."""

    seqs: list[Sequence]
    lens: list[int]
    saved: list[tuple[Tensor, ...]]
    slots: Tensor
    row_len: int = 0


class ModelRunner:
    """Runs the engine's steps. `verify_lens` (1 + k for each draft length the speculator may choose) are the row
    lengths of the verification graphs; none: decode graphs only. `taps`: decoder layers whose residual stream each
    step returns (`kimik3.inference.spec.taps`; a graph returns the hidden states its capture recorded)."""

    def __init__(self, model: nn.Module, pool: StatePool, max_blocks: int, use_cuda_graphs: bool | None,
                 max_num_seqs: int, adapters: ServedAdapters | None = None, verify_lens: tuple[int, ...] = (),
                 taps: tuple[int, ...] = ()):
        self.model, self.pool, self.max_blocks, self.adapters = model, pool, max_blocks, adapters
        self.taps = taps
        self.device = next(model.parameters()).device
        # on the CPU verification steps run as static steps unless told otherwise (below)
        verify_static = use_cuda_graphs is None and self.device.type == "cpu" and adapters is None
        if use_cuda_graphs is None:  # on CUDA in 16-bit: fp32 routed experts run the reference loop, which reads
            # expert counts on the host and so cannot be captured; nor can adapters' per-row updates (tiered experts
            # can: each tiered layer is a hole between the graphs of a step, `graphs.Pieces`)
            use_cuda_graphs = self.device.type == "cuda" and pool.dtype != torch.float32 and adapters is None
        self.table = BlockTable(pool, max_blocks)
        self.sizes = sorted({n for n in GRAPH_BUCKETS if n < max_num_seqs} | {max_num_seqs})
        self.verify_lens = tuple(sorted(verify_lens))
        longest = max(self.verify_lens, default=1)
        # on CUDA one memory pool for all the graphs; on the CPU the same static steps run eagerly (their form)
        self.static = use_cuda_graphs
        self.handle = torch.cuda.graph_pool_handle() if use_cuda_graphs and self.device.type == "cuda" else None
        # static verification steps run the recurrent KDA kernel over each row, as decode runs it (the chunked
        # kernel sums in another order: in bf16 a verified row's logits then differ from decode's and speculation
        # changed greedy tokens); on the CPU for any number of rows (no graph memory to bound)
        self.static_verify = self.static or verify_static
        self.kda = [(layer.self_attn, view) for layer, view in zip(model.model.layers, pool.layers)
                    if isinstance(view, KDAView)]
        # graphed verification: the batch buckets whose saved KDA inputs fit their memory budget (on the CPU, with
        # no graph memory to bound, every bucket); none fit: verification steps run eagerly
        self.verify_sizes = self.sizes if self.handle is None else verify_graph_rows(pool, len(self.kda), longest,
                                                                                      self.sizes)
        self.buffers = VerifyBuffers(pool, len(self.kda), max(self.verify_sizes, default=0), longest)
        self.graphs: dict[tuple[int, int, int], StepGraph] = {}  # (rows, span, row_len)
        self.commit_graphs: dict[tuple[int, int], CommitGraph] = {}  # (rows, row_len)

    def capture_graphs(self) -> None:
        """Capture the decode and verification graphs of every batch bucket at the shortest key span now (a warming
        engine: a server, ready only when its first requests meet no capture). Otherwise each graph is captured
        at the first step that needs it, as the longer spans' always are: `kimik3 generate` prints its first
        token, which a prefill step computes, before the decode graph's capture and its kernels' compiles (~4.5 s
        on a new H200, bench_startup's compile trace), instead of after them."""
        if self.handle is None:
            return
        span, longest = span_bucket(1, self.max_blocks), max(self.verify_lens, default=1)
        # the graphs' expert kernels compile side by side first (their captures would compile them one by one)
        compile_experts(self.model, self.sizes[-1] * longest)
        for n in reversed(self.sizes):  # the largest first: the smaller ones reuse its pool memory
            self.graph(n, span, 1)
        for L in reversed(self.verify_lens):
            for n in reversed(self.verify_sizes):
                self.graph(n, span, L)
                self._commit_graph(n, L)

    def graph(self, rows: int, span: int, row_len: int) -> StepGraph:
        g = self.graphs.get((rows, span, row_len))
        if g is None:
            buffers = self.buffers(rows, row_len) if row_len > 1 else None
            g = self.graphs[rows, span, row_len] = StepGraph(self.model, self.pool, self.table, self.taps, rows,
                                                             span, row_len, self.handle, buffers)
        return g

    def run(self, chunks: list[Chunk], logit_rows: list[int], media: list | None = None) -> StepOutput:
        """Run the chunks; the logits are those of packed rows `logit_rows`. `media[i]`: None, or (rows of chunk
        i, their [n, D] embeddings) spliced over the token embeddings."""
        if self._graphable(chunks, media):
            return self._replay(chunks, logit_rows)
        lens = [c.num_tokens for c in chunks]
        verify = [i for i, c in enumerate(chunks) if c.seq.draft is not None]
        step = build_step(slots=[c.seq.slot for c in chunks], cached=[c.seq.num_computed for c in chunks],
                          lens=lens, tables=[c.seq.blocks for c in chunks], block_size=self.pool.block_size,
                          conv_window=self.pool.conv_window, pad_block=self.pool.scratch_block, device=self.device,
                          exports=[c.exports for c in chunks] if any(c.exports for c in chunks) else None,
                          verify=verify, expanded_until=[prompt_expanded_until(c.seq.num_prompt) for c in chunks])
        ids = torch.tensor([t for c in chunks for t in c.seq.row_tokens(c.num_tokens)])[None].to(self.device)
        embeds = self._embeds(ids, chunks, media)
        with self._adapter_rows(chunks), tapped(self.model, self.taps) as found:
            logits, ios = self.model.run_step(ids, self.pool, step, inputs_embeds=embeds,
                                              logits_at=torch.tensor(logit_rows, dtype=torch.long, device=self.device))
        verification = None
        if verify:
            verification = Verification([chunks[i].seq for i in verify], [lens[i] for i in verify],
                                        [io.saved for io in ios], step.slots[step.verify.seqs])
        exports = [io.exports for io in ios] if step.export_pick is not None else None
        return StepOutput(logits[0].float(), exports, verification, stack_taps(found)[0] if self.taps else None)

    def _row_len(self, chunks: list[Chunk]) -> int:
        """A graph's row length for these chunks: 1 without drafts, else the shortest verification length that
        holds the longest row (0: none does)."""
        if all(c.seq.draft is None for c in chunks):
            return 1
        longest = max(c.num_tokens for c in chunks)
        return next((L for L in self.verify_lens if L >= longest), 0)

    def _graphable(self, chunks: list[Chunk], media: list | None) -> bool:
        """Whether a graph runs these chunks: every row short, none exporting a snapshot or embedding an image, no
        more rows than a graph has, every sequence inside the block table."""
        L = self._row_len(chunks)
        sizes = self.verify_sizes if L > 1 else self.sizes
        return (L > 0 and (self.static_verify if L > 1 else self.static) and len(chunks) <= max(sizes, default=0)
                and all(c.num_tokens <= L and not c.exports for c in chunks)
                and (media is None or all(m is None for m in media))
                and max(c.seq.num_computed for c in chunks) + L <= self.max_blocks * self.pool.block_size)

    def _replay(self, chunks: list[Chunk], logit_rows: list[int]) -> StepOutput:
        L, Bs = self._row_len(chunks), self.pool.block_size
        verify = L > 1
        self.table.sync(chunks)
        rows = next(b for b in (self.verify_sizes if verify else self.sizes) if b >= len(chunks))
        span = span_bucket(max(max(len(c.seq.blocks), -(-(c.seq.num_computed + L) // Bs)) for c in chunks),
                           self.max_blocks)
        g = self.graph(rows, span, L)
        logits = g(chunks)
        lens = [c.num_tokens for c in chunks]
        # packed row r of chunk i is row i * L + (r - its start) of the graph's padded rows
        padded = [i * L + j for i, n in enumerate(lens) for j in range(n)]
        taps = take_rows(stack_taps(g.found)[0], padded) if self.taps else None
        if L == 1:
            return StepOutput(take_rows(logits, logit_rows), taps=taps)
        return StepOutput(take_rows(logits, [padded[r] for r in logit_rows]), None,
                          Verification([c.seq for c in chunks], lens, g.buffers, g.slots, row_len=L), taps)

    def _embeds(self, ids: Tensor, chunks: list[Chunk], media: list | None) -> Tensor | None:
        """The token embeddings [1, T, D] with the chunks' image tokens written over their media pads (None: no
        images; the model embeds the ids itself)."""
        if media is None or all(m is None for m in media):
            return None
        embeds = self.model.model.embed_tokens(ids)
        start = 0
        for c, m in zip(chunks, media):
            if m is not None:
                embeds[0, [start + r for r in m[0]]] = m[1].to(embeds.dtype)
            start += c.num_tokens
        return embeds

    def commit(self, v: Verification, rejected: dict[Sequence, int]) -> None:
        """Write each verifying sequence's KDA slot for the tokens of its row it keeps: all of them but its
        `rejected` drafts and, in a graph, its padding."""
        keep = [n - rejected.get(seq, 0) for seq, n in zip(v.seqs, v.lens)]
        keep += [1] * (v.slots.shape[0] - len(keep))  # a graph's padding rows (the scratch slot)
        host = torch.tensor(keep)
        if v.row_len and self.handle is not None:  # a graph's step: a graph's commit
            self._commit_graph(len(keep), v.row_len)(v.slots, host)
            return
        keep_N = to_device(host, self.device)
        commit_kda(self.kda, v.saved, v.slots, keep_N)

    def _commit_graph(self, rows: int, row_len: int) -> CommitGraph:
        g = self.commit_graphs.get((rows, row_len))
        if g is None:
            g = self.commit_graphs[rows, row_len] = CommitGraph(self.kda, self.buffers(rows, row_len), self.pool,
                                                                rows, self.handle)
        return g

    def time_steps(self, rows: int) -> dict[int, float]:
        """Seconds of a step of `rows` rows (a batch bucket) on the scratch rows: {0: decoding, k: verifying k
        drafts} for each verification length 1 + k (`StepGraph.timed`: a graph's replay, the fastest of three, or
        the static step run eagerly where none is captured, once: on the CPU a step of 64 rows takes a tenth of a
        second and more). The speculator chooses its k by them (`draft_length.StepCosts`)."""
        span, out = span_bucket(1, self.max_blocks), {}
        repeats = 3 if self.device.type == "cuda" else 1
        for L in (1, *self.verify_lens):
            if self.handle is not None and rows in (self.verify_sizes if L > 1 else self.sizes):
                g = self.graph(rows, span, L)
            else:  # no graph runs such a step: the same static step, eagerly
                g = StepGraph(self.model, self.pool, self.table, (), rows, span, L, None)
            out[L - 1] = g.timed(repeats)
        return out

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
        with decode rows beside it (the graphs ran when they were captured). Humming's kernels for up to
        `max_tokens` tokens first, compiled side by side and run once each (`warm_experts`): compiled on a thread
        beside this loop instead, the loop's own expert calls met kernels not compiled yet and compiled them one by
        one (bench_startup on new machines: ready after 84 s that way, 76 s compiled before the loop)."""
        scratch, Bs, n = self.pool.scratch_slot, self.pool.block_size, 1
        warm_experts(self.model, max_tokens)  # steps carry at most max_tokens tokens
        while n <= max_tokens:
            for lens in ([n], [n, 1, 1]):
                tables = [[self.pool.scratch_block] * -(-m // Bs) for m in lens]
                step = build_step(slots=[scratch] * len(lens), cached=[0] * len(lens), lens=lens, tables=tables,
                                  block_size=Bs, conv_window=self.pool.conv_window,
                                  pad_block=self.pool.scratch_block, device=self.device)
                ids = torch.zeros(1, sum(lens), dtype=torch.long, device=self.device)
                at = torch.zeros(1, dtype=torch.long, device=self.device)
                self.model.run_step(ids, self.pool, step, logits_at=at)
            n *= 2
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


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
