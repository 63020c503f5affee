"""The serving engine: continuous batching over a paged hybrid cache, with an exact prefix cache.

    engine = Engine(model, eos_token_ids=[...])
    engine.add_request(Request("a", prompt_ids, SamplingParams(max_new_tokens=64)))
    while engine.has_unfinished():
        for out in engine.step(): ...

Synchronous and single-threaded: a server runs `step()` in its own thread and talks to it through queues.
Each step: schedule (scheduler.py) -> one packed forward (runner.py) -> snapshot the exported states into
the prefix cache -> sample (sampler.py) -> stop checks -> outputs of the requests that advanced.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Sequence as Seq

import torch
from torch import nn

from kimik3.inference.engine.pools import BlockPool, SlotPool
from kimik3.inference.engine.prefix_cache import GRID, PrefixCache, root_key
from kimik3.inference.engine.request import (
    Request,
    RequestOutput,
    RequestState,
    Sequence,
    SequenceOutput,
    Status,
    TokenLogprob,
)
from kimik3.inference.engine.runner import ModelRunner, take_rows
from kimik3.inference.engine.sampler import sample, token_logprobs
from kimik3.inference.engine.scheduler import Chunk, Scheduler
from kimik3.inference.sampling import SamplingParams
from kimik3.model.cache import PagedCache
from kimik3.ops.kda import supports_checkpoints


class Engine:
    """Continuous batching for a K3 model (`K3ForCausalLM` or `K3ForConditionalGeneration`, text prompts).

    Args:
        max_num_seqs: running sequences at most (KDA slots).
        max_num_batched_tokens: tokens per step (prefill chunks + decodes); at least 64.
        max_model_len: prompt + output tokens per sequence (default: the config's max_position_embeddings).
        prefix_cache_bytes: the budget over KDA snapshots and the MLA blocks the cache holds (default: 16
            snapshots plus a quarter of the block pool).
        enable_prefix_cache: reuse computed prefixes.
        eos_token_ids: ids that end every request (unless its ignore_eos).
        block_size: MLA block size in tokens (a divisor of 64, the snapshot grid).
        use_cuda_graphs: replay captured decode-only steps (default: on CUDA in bf16/fp16).
        model_id: part of every prefix key (two models never share a cache entry).
        tokenizer: with `decode(ids) -> str`, enables stop strings.
        num_blocks: MLA pool blocks (default: every running sequence at max_model_len; on CUDA at most half the
            free memory, and at least one sequence's worth).
        snapshot_interval: grid positions (multiples of 64) that get a prefix snapshot besides each prompt's
            last grid point and each finished request's end.
        poison: fill freed slots, freed blocks and evicted snapshots with NaN (tests: a stale read fails).
    """

    def __init__(self, model: nn.Module, *, max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 max_model_len: int | None = None, prefix_cache_bytes: int | None = None,
                 enable_prefix_cache: bool = True, eos_token_ids: Seq[int] = (), block_size: int = 64,
                 use_cuda_graphs: bool | None = None, model_id: str = "", tokenizer=None,
                 num_blocks: int | None = None, snapshot_interval: int = 256, poison: bool = False):
        lm = model.language_model if hasattr(model, "language_model") else model
        cfg = lm.config
        self.model, self.cfg, self.tokenizer = lm, cfg, tokenizer
        self.max_model_len = max_model_len or cfg.max_position_embeddings
        if max_num_batched_tokens < GRID:
            raise ValueError(f"max_num_batched_tokens must be >= {GRID} (one KDA chunk), got {max_num_batched_tokens}")
        if block_size < 1 or GRID % block_size:
            raise ValueError(f"block_size must divide {GRID} (the snapshot grid), got {block_size}")
        if snapshot_interval < GRID or snapshot_interval % GRID:
            raise ValueError(f"snapshot_interval must be a positive multiple of {GRID}, got {snapshot_interval}")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        w = lm.lm_head.weight
        self.dtype, self.device = w.dtype, w.device
        max_blocks = -(-self.max_model_len // block_size)
        if num_blocks is None:
            num_blocks = max_num_seqs * max_blocks
            if w.is_cuda:  # a long max_model_len would ask for far more than the card has: half its free memory
                mla = sum(kind == "mla" for kind in cfg.layer_types)
                per_block = block_size * mla * (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim) * w.element_size()
                free = torch.cuda.mem_get_info(w.device)[0]
                num_blocks = max(max_blocks, min(num_blocks, int(free // 2 // max(per_block, 1))))
        self.cache = PagedCache(cfg, max_num_seqs, num_blocks, block_size, w.dtype, w.device)
        self.slots, self.blocks = SlotPool(self.cache, poison), BlockPool(self.cache, poison)
        if prefix_cache_bytes is None:
            prefix_cache_bytes = 16 * self.cache.slot_bytes + num_blocks * self.cache.block_bytes // 4
        self.prefix = (PrefixCache(self.blocks, prefix_cache_bytes, self.cache.block_bytes, poison)
                       if enable_prefix_cache else None)
        self.scheduler = Scheduler(self.slots, self.blocks, self.prefix, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens,
                                   snapshot_interval=snapshot_interval,
                                   interior_snapshots=supports_checkpoints(w))
        # by default on CUDA in 16-bit: fp32 routed experts run the reference loop, which reads expert counts on
        # the host and so cannot be captured
        graphs = (w.is_cuda and w.dtype != torch.float32) if use_cuda_graphs is None else use_cuda_graphs
        with torch.no_grad():
            self.runner = ModelRunner(lm, self.cache, max_blocks, graphs, max_num_seqs)
        self.eos = tuple(eos_token_ids)
        self.model_id = model_id
        self.requests: dict[str, RequestState] = {}
        self.aborted: list[RequestState] = []  # final outputs the next step() returns
        self.counters = dict(aborts=0, prompt_tokens_total=0, generation_tokens_total=0)
        # called once a step's forward is queued and before its results are waited for: a server hands the previous
        # step's outputs to its front end then, so that formatting them overlaps the device, not this thread's
        # preparation of the step (both need the GIL)
        self.on_launch: Callable[[], None] | None = None

    def add_request(self, request: Request) -> None:
        p, ids = request.params, list(request.prompt_ids)
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already running")
        if not ids:
            raise ValueError(f"request {request.request_id!r}: the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"request {request.request_id!r}: prompt ids outside the vocabulary "
                             f"[0, {self.cfg.vocab_size}): {bad[:5]}")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"request {request.request_id!r}: a prompt of {len(ids)} tokens leaves no room for "
                             f"output within max_model_len {self.max_model_len}")
        longest = min(len(ids) + p.max_new_tokens, self.max_model_len)
        if longest > self.cache.num_blocks * self.cache.block_size:
            raise ValueError(f"request {request.request_id!r}: {len(ids)} prompt + {p.max_new_tokens} new tokens "
                             f"can never fit the MLA pool of {self.cache.num_blocks} blocks of "
                             f"{self.cache.block_size} tokens (num_blocks)")
        if p.n > self.scheduler.max_num_seqs:
            raise ValueError(f"request {request.request_id!r}: n = {p.n} exceeds max_num_seqs "
                             f"{self.scheduler.max_num_seqs}")
        group = RequestState(request, root_key(self.model_id, self.dtype, request.cache_salt, request.mm_hashes))
        constraint = request.constraint or (request.constraint_factory() if request.constraint_factory else None)
        group.seqs.append(Sequence(group, 0, ids, constraint, self._generator(p, 0)))
        self.requests[request.request_id] = group
        self.scheduler.add(group)
        self.counters["prompt_tokens_total"] += len(ids)

    def abort(self, request_id: str) -> None:
        """Stop a request now (its slot and blocks are free before the next forward); the next `step()`
        returns its final output with finish_reason "abort". Unknown or finished ids are ignored."""
        group = self.requests.get(request_id)
        if group is None:
            return
        for seq in group.seqs:
            if seq.status is not Status.FINISHED:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
        self.counters["aborts"] += 1
        self.aborted.append(group)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def reset_prefix_cache(self) -> None:
        if self.prefix is not None:
            self.prefix.reset()

    @property
    def stats(self) -> dict:
        pc = self.prefix
        return dict(running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
                    prefix_queries_tokens=pc.queries_tokens if pc else 0, prefix_hit_tokens=pc.hit_tokens if pc else 0,
                    kda_snapshots=len(pc.entries) if pc else 0, kda_snapshot_bytes=pc.snapshot_bytes if pc else 0,
                    prefix_cache_bytes=pc.nbytes if pc else 0, nonfinite_refused=pc.nonfinite_refused if pc else 0,
                    cache_usage=1 - len(self.blocks) / self.cache.num_blocks,
                    preemptions=self.scheduler.preemptions, **self.counters)

    def generate(self, prompts: list[list[int]], sampling: SamplingParams | list[SamplingParams],
                 progress=None) -> list[RequestOutput]:
        """Run the prompts to the end (offline batch); outputs in prompt order. `progress(done, total)` is
        called whenever a request finishes."""
        params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling parameter sets for {len(prompts)} prompts")
        ids = [f"generate-{id(self)}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, params):
            self.add_request(Request(rid, list(prompt), p))
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
                    if progress is not None:
                        progress(len(final), len(ids))
        return [final[r] for r in ids]

    @torch.no_grad()
    def step(self) -> list[RequestOutput]:
        """One scheduler step: the outputs of the requests that sampled a token (and of those aborted since)."""
        aborted = [self._output(g) for g in self.aborted]
        self.aborted.clear()
        chunks = self.scheduler.schedule()
        if not chunks:
            return aborted
        now = time.monotonic()
        for c in chunks:
            c.seq.group.first_scheduled = c.seq.group.first_scheduled or now
        rows, samplers, prompt_lp = [], [], []
        start = 0
        for c in chunks:
            seq = c.seq
            done = seq.num_computed + c.num_tokens == len(seq.tokens)
            if seq.params.prompt_logprobs is not None and seq.num_computed < seq.num_prompt:
                upto = min(c.num_tokens, seq.num_prompt - seq.num_computed)
                prompt_lp.append((seq, len(rows), upto))
                rows.extend(range(start, start + upto))
                if done and upto == c.num_tokens:
                    samplers.append((seq, len(rows) - 1))
                elif done:
                    rows.append(start + c.num_tokens - 1)
                    samplers.append((seq, len(rows) - 1))
            elif done:
                rows.append(start + c.num_tokens - 1)
                samplers.append((seq, len(rows) - 1))
            start += c.num_tokens
        logits, exports = self.runner.run(chunks, rows)
        if self.on_launch is not None:
            self.on_launch()
        n_chunk = {c.seq: c.num_tokens for c in chunks}
        if exports:
            self._snapshot_exports(chunks, exports)
        for c in chunks:
            c.seq.num_computed += c.num_tokens
        for seq, row, n in prompt_lp:
            self._prompt_logprobs(seq, logits[row: row + n], seq.num_computed - n_chunk[seq], n)
        advanced: dict[str, RequestState] = {}
        sampling = self._fork(samplers)
        if sampling:
            seqs = [s for s, _ in sampling]
            tokens, logprobs = sample(take_rows(logits, [r for _, r in sampling]), seqs)
            for seq, token, lp in zip(seqs, tokens, logprobs):
                self._append(seq, token, lp)
                advanced[seq.group.request.request_id] = seq.group
        return aborted + [self._output(g) for g in advanced.values()]

    def _generator(self, p: SamplingParams, index: int) -> torch.Generator:
        seed = p.seed + index if p.seed is not None else int(torch.randint(0, 2**62, ()))
        return torch.Generator(device=self.device).manual_seed(seed)

    def _fork(self, samplers: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int]]:
        """n > 1: when the prompt's prefill ends, the other n-1 choices start from a copy of its state."""
        out = []
        for seq, row in samplers:
            out.append((seq, row))
            group = seq.group
            if group.forked:
                continue
            group.forked = True
            for i in range(1, group.request.params.n):
                req = group.request
                child = Sequence(group, i, list(seq.tokens),
                                 req.constraint_factory() if req.constraint_factory else None,
                                 self._generator(req.params, i), num_computed=seq.num_computed,
                                 slot=group.reserved.pop(), status=Status.RUNNING)
                self.slots.copy(seq.slot, child.slot)
                size, p = self.blocks.size, seq.num_computed
                for b in seq.blocks[: p // size]:
                    self.blocks.ref(b)
                child.blocks = list(seq.blocks[: p // size])
                group.seqs.append(child)
                self.scheduler.running.append(child)
                if p % size:  # copy-on-write of the partial last block
                    if not len(self.blocks) and self.prefix is not None:
                        self.prefix.evict(need_free_blocks=1)
                    if not len(self.blocks):  # no room: this choice recomputes its prompt later
                        self.scheduler.preempt(child, unreserve=False)
                        continue
                    b = self.blocks.allocate()
                    self.blocks.copy(seq.blocks[p // size], b, p % size)
                    child.blocks.append(b)
                out.append((child, row))
        return out

    def _snapshot_exports(self, chunks: list[Chunk], exports: list) -> None:
        """Insert the states the forward exported (one entry per (chunk, offset), in that order)."""
        e = 0
        for c in chunks:
            seq = c.seq
            for off in c.exports:
                p = seq.num_computed + off
                state = [t[e].clone() for layer in exports for t in layer]
                e += 1
                nblocks = p // self.blocks.size
                blocks = seq.blocks[:nblocks]
                self.prefix.insert(seq.group.root_key, seq.tokens[:p], state, blocks,
                                   self.blocks.finite(blocks, p))

    def _prompt_logprobs(self, seq: Sequence, logits, first: int, n: int) -> None:
        """Prompt logprobs from a chunk starting at position `first` (row i predicts prompt token first+i+1);
        positions already reported (a preempted prefill computes them again) are skipped."""
        group, k = seq.group, seq.params.prompt_logprobs
        if group.prompt_logprobs is None:
            group.prompt_logprobs = [None]
        lo = len(group.prompt_logprobs)  # the next prompt position without a logprob
        hi = min(first + n, seq.num_prompt - 1)  # the last position a row of this chunk predicts
        if hi >= lo:
            lp = logits[lo - first - 1: hi - first].log_softmax(-1)
            group.prompt_logprobs.extend(token_logprobs(lp, seq.tokens[lo: hi + 1], k))

    def _append(self, seq: Sequence, token: int, lp: TokenLogprob | None) -> None:
        group, p = seq.group, seq.params
        seq.tokens.append(token)
        group.first_token = group.first_token or time.monotonic()
        self.counters["generation_tokens_total"] += 1
        if p.logprobs is not None:
            seq.logprobs = (seq.logprobs or []) + [lp]
        if seq.constraint is not None:
            seq.constraint.accept(token)
        n_out = len(seq.tokens) - seq.num_prompt
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos):
            seq.finish_reason, seq.stop_reason = "stop", token
        elif seq.constraint is not None and seq.constraint.is_finished():
            seq.finish_reason = "stop"
        elif p.stop and self.tokenizer is not None and (hit := self._stop_string(seq)) is not None:
            seq.finish_reason, seq.stop_reason = "stop", hit
        elif n_out >= p.max_new_tokens or len(seq.tokens) >= self.max_model_len:
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            self._finish(seq)

    def _stop_string(self, seq: Sequence) -> str | None:
        return stop_hit(self.tokenizer.decode, seq.tokens, seq.num_prompt, seq.params.stop)

    def _finish(self, seq: Sequence) -> None:
        """Snapshot the end state (prompt + output so far: the last sampled token is not computed yet), then
        free the sequence's slot and blocks."""
        if self.prefix is not None and seq.params.prompt_logprobs is None and seq.num_computed:
            p = seq.num_computed
            blocks = seq.blocks[: -(-p // self.blocks.size)]
            self.prefix.insert(seq.group.root_key, seq.tokens[:p], self.slots.save(seq.slot), blocks,
                               self.blocks.finite(blocks, p))
        self.scheduler.finish(seq)

    def _output(self, group: RequestState) -> RequestOutput:
        outs = []
        for seq in group.seqs:
            out = seq.output  # a fresh list: no further copy (each step copies only what it must)
            outs.append(SequenceOutput(seq.index, out, out[seq.reported:], seq.logprobs, seq.finish_reason,
                                       seq.stop_reason))
            seq.reported = len(out)
        # an aborted n > 1 request may end before its fork: with the one sequence it has
        finished = group.finished or any(s.finish_reason == "abort" for s in group.seqs)
        if finished:
            group.finished_at = time.monotonic()
            self.requests.pop(group.request.request_id, None)
        metrics = dict(arrival=group.arrival, first_token=group.first_token, finished=group.finished_at,
                       queue_time=(group.first_scheduled or group.arrival) - group.arrival)
        # the request's own prompt list, not a copy per step (a 4k-token prompt x 64 running requests was ~260k
        # copied ids per step); the engine never modifies it
        return RequestOutput(group.request.request_id, group.request.prompt_ids, outs, finished,
                             group.cached_tokens, group.prompt_logprobs, metrics)


def stop_hit(decode: Callable[[list[int]], str], tokens: list[int], start: int, stops: Seq[str]) -> str | None:
    """The stop string that the text of tokens[start:] contains, checked after each new token (the one whose
    occurrence begins first if several do); None if none.

    Only a tail is decoded, so the cost per token does not grow with the output (decoding it all made a long
    generation quadratic). Since the check runs after every token, a stop can only be new: it ends inside the
    newest token's text and begins at most len(stop) characters before that. The window of tokens decoded
    doubles until the text before the newest token is that long, plus a few characters for a cut through a
    multi-byte character (garbled to U+FFFD at the window's start) -- or until it is the whole output.
    """
    need = max(map(len, stops)) + 4
    newest = len(decode(tokens[-1:]))
    n_out, w = len(tokens) - start, 2 * need
    while True:
        w = min(w, n_out)
        text = decode(tokens[len(tokens) - w:])
        if w == n_out or len(text) - newest >= need:
            break
        w *= 2
    hits = [(text.find(s), s) for s in stops if s in text]
    return min(hits)[1] if hits else None
