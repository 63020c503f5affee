"""The serving engine: continuous batching over the hybrid state pool, with an exact prefix cache.

    engine = Engine(model, EngineConfig(max_num_seqs=16), eos_token_ids=[...])
    engine.add_request(Request("a", prompt_ids, SamplingParams(max_new_tokens=64)))
    while engine.has_unfinished():
        for out in engine.step(): ...          # each request's new tokens (deltas)

Synchronous and single-threaded: a server runs `step()` in its own thread and talks to it through queues.
Each step: (speculative decoding: draft, speculative.py) -> schedule (scheduler.py) -> one packed forward
(runner.py) -> snapshot the exported states into the prefix cache -> sample (sampler.py), or verify the drafts and
roll back the rejected ones -> the scheduler's update (append, stop checks, finish) -> outputs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from pathlib import Path

import torch
from torch import Tensor, nn

from kimik3.inference.engine.config import EngineConfig
from kimik3.inference.engine.pools import BlockPool, SlotPool
from kimik3.inference.engine.prefix_cache import PrefixCache, prompt_logprobs_at, root_key
from kimik3.inference.engine.request import (
    Request,
    RequestOutput,
    RequestState,
    Sequence,
    SequenceOutput,
    Status,
    accumulate,
)
from kimik3.inference.engine.runner import ModelRunner, logit_rows, take_rows
from kimik3.inference.engine.sampler import sample, token_logprobs
from kimik3.inference.engine.scheduler import Chunk, Scheduler
from kimik3.inference.engine.speculative import Speculator
from kimik3.inference.sampling import SamplingParams
from kimik3.lora.serving import attach_adapters
from kimik3.model.state import SlotState, StatePool, state_specs
from kimik3.ops.kda import supports_checkpoints
from kimik3.tokenizer.stops import StopDecoder


class Engine:
    """Continuous batching for a K3 model (`K3ForCausalLM` or `K3ForConditionalGeneration`).

    Args:
        config: the runtime knobs (`EngineConfig`; None: its defaults).
        eos_token_ids: ids that end every request (unless its ignore_eos).
        tokenizer: a `kimik3.tokenizer.Tokenizer`: outputs carry their visible text, and stop strings stop.
        model_id: part of every prefix key (two models never share a cache entry).
        adapters: LoRA adapters to serve, name -> PEFT-format folder (`kimik3.lora.attach_adapters` puts them on
            `model`, in place); a request names one (`Request.adapter`), and requests of different adapters and of
            none share each step. Decode steps then run eagerly (no CUDA graphs).
        sync_tokens: called in place on each step's sampled ids [M] (int64, on the model's device) before they
            are used; ranks generating together (tensor / expert parallel) pass a broadcast from rank 0.

    `config.speculative` turns on speculative decoding (speculative.py).
    """

    def __init__(self, model: nn.Module, config: EngineConfig | None = None, *, eos_token_ids: Seq[int] = (),
                 tokenizer=None, model_id: str = "", sync_tokens: Callable[[Tensor], object] | None = None,
                 adapters: dict[str, str | Path] | None = None):
        cfg = config if config is not None else EngineConfig()
        lm = model.language_model if hasattr(model, "language_model") else model
        if adapters and cfg.use_cuda_graphs:
            raise ValueError("use_cuda_graphs with adapters: the adapters' updates read row counts on the host "
                             "(their decode steps run eagerly); leave use_cuda_graphs unset")
        text = lm.config
        self.adapters = attach_adapters(lm, adapters) if adapters else None
        self.config, self.model, self.tokenizer, self.sync_tokens = cfg, lm, tokenizer, sync_tokens
        # the multimodal wrapper when it has a vision tower: what turns a prompt's images into its media tokens
        self.vision_model = model if getattr(model, "has_vision", False) else None
        self.media_id = getattr(model.config, "media_placeholder_token_id", None)
        self.vocab_size = text.vocab_size
        self.max_model_len = cfg.max_model_len or text.max_position_embeddings
        w = lm.lm_head.weight
        self.dtype, self.device = w.dtype, w.device
        Bs = cfg.block_size
        max_blocks = -(-self.max_model_len // Bs)
        specs = state_specs(lm)
        num_blocks = cfg.num_blocks
        if num_blocks is None:
            num_blocks = cfg.max_num_seqs * max_blocks
            if w.is_cuda:  # a long max_model_len would ask for far more than the card has: half its free memory
                per_block = StatePool(specs, 1, 1, Bs, w.dtype, "meta").block_bytes
                free = torch.cuda.mem_get_info(w.device)[0]
                num_blocks = max(max_blocks, min(num_blocks, int(free // 2 // max(per_block, 1))))
        self.pool = StatePool(specs, cfg.max_num_seqs, num_blocks, Bs, w.dtype, w.device)
        self.slots, self.blocks = SlotPool(self.pool, cfg.poison), BlockPool(self.pool, cfg.poison)
        budget = cfg.prefix_cache_bytes
        if budget is None:
            budget = 16 * self.pool.slot_bytes + num_blocks * self.pool.block_bytes // 4
        self.prefix = PrefixCache(self.blocks, budget, self.pool.block_bytes, cfg.poison) \
            if cfg.enable_prefix_cache else None
        self.scheduler = Scheduler(self.slots, self.blocks, self.prefix, max_num_seqs=cfg.max_num_seqs,
                                   max_num_batched_tokens=cfg.max_num_batched_tokens,
                                   snapshot_interval=cfg.snapshot_interval, interior_snapshots=supports_checkpoints(w),
                                   max_model_len=self.max_model_len, eos_token_ids=tuple(eos_token_ids))
        self.speculator = Speculator(cfg.speculative, lm) if cfg.speculative is not None else None
        if self.speculator is not None and sync_tokens is not None:
            raise ValueError("speculative decoding with sync_tokens (ranks generating together) is not supported")
        # by default on CUDA in 16-bit: fp32 routed experts run the reference loop, which reads expert counts on
        # the host and so cannot be captured; nor can adapters' per-row updates
        graphs = (w.is_cuda and w.dtype != torch.float32 and not adapters) if cfg.use_cuda_graphs is None \
            else cfg.use_cuda_graphs
        with torch.no_grad():
            verify_len = 1 + cfg.speculative.num_speculative_tokens if self.speculator is not None else 1
            self.runner = ModelRunner(lm, self.pool, max_blocks, graphs, cfg.max_num_seqs, self.adapters, verify_len,
                                      self.speculator.needs_taps if self.speculator is not None else ())
            if cfg.warmup:
                self.runner.warmup(cfg.max_num_batched_tokens)
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
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"request {request.request_id!r}: prompt ids outside the vocabulary "
                             f"[0, {self.vocab_size}): {bad[:5]}")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"request {request.request_id!r}: a prompt of {len(ids)} tokens leaves no room for "
                             f"output within max_model_len {self.max_model_len}")
        longest = min(len(ids) + p.max_new_tokens, self.max_model_len)
        if longest > self.pool.num_blocks * self.pool.block_size:
            raise ValueError(f"request {request.request_id!r}: {len(ids)} prompt + {p.max_new_tokens} new tokens "
                             f"can never fit the MLA pool of {self.pool.num_blocks} blocks of "
                             f"{self.pool.block_size} tokens (num_blocks)")
        if p.n > self.scheduler.max_num_seqs:
            raise ValueError(f"request {request.request_id!r}: n = {p.n} exceeds max_num_seqs "
                             f"{self.scheduler.max_num_seqs}")
        adapter = ""
        if request.adapter is not None:
            if self.adapters is None:
                raise ValueError(f"request {request.request_id!r}: adapter {request.adapter!r}, but the engine "
                                 "serves no adapters")
            k = self.adapters.index(request.adapter)
            adapter = f"{request.adapter}@{self.adapters.paths[k]}"
        group = RequestState(request, root_key(self.model_id, self.dtype, request.cache_salt, request.mm_hashes,
                                               adapter))
        if request.mm_embeds is not None:
            group.media = [i for i, t in enumerate(ids) if t == self.media_id]
            if len(group.media) != request.mm_embeds.shape[0]:
                raise ValueError(f"request {request.request_id!r}: {len(group.media)} <|media_pad|> positions "
                                 f"for {request.mm_embeds.shape[0]} image tokens")
        constraint = request.constraint or (request.constraint_factory() if request.constraint_factory else None)
        group.seqs.append(self._sequence(group, 0, ids, constraint))
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

    def stop(self, request_id: str, stop_reason: int | str | None = None) -> None:
        """End a request normally (a caller's own stop condition, e.g. a stop string over parsed content): it
        finishes with reason "stop", leaves its end snapshot, and the next `step()` returns its final output."""
        group = self.requests.get(request_id)
        if group is None:
            return
        for seq in group.seqs:
            if seq.status is not Status.FINISHED:
                self.scheduler.stop(seq, "stop", stop_reason)
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
                    cache_usage=1 - len(self.blocks) / self.pool.num_blocks,
                    preemptions=self.scheduler.preemptions, **self.counters,
                    **(self.speculator.stats.as_metrics() if self.speculator is not None else {}))

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
        acc: dict[str, RequestOutput] = {}
        done = 0
        while done < len(ids):
            outs = self.step()
            accumulate(acc, outs)
            for out in outs:
                if out.finished:
                    done += 1
                    if progress is not None:
                        progress(done, len(ids))
        return [acc[r] for r in ids]

    @torch.no_grad()
    def step(self) -> list[RequestOutput]:
        """One scheduler step: the new output of each request that sampled a token (and of those ended since)."""
        ended = [self._output(g) for g in self.aborted]
        self.aborted.clear()
        spec = self.speculator
        if spec is not None:
            spec.propose(self.scheduler.running, self.max_model_len)
        chunks = self.scheduler.schedule()
        if not chunks:
            return ended
        now = time.monotonic()
        for c in chunks:
            c.seq.group.first_scheduled = c.seq.group.first_scheduled or now
        starts = [c.seq.num_computed for c in chunks]
        rows, samplers, prompt_lp = logit_rows(chunks)
        out = self.runner.run(chunks, rows, [self._media(c) for c in chunks])
        logits, exports, verification = out.logits, out.exports, out.verification
        if self.on_launch is not None:
            self.on_launch()
        rows_lp = {id(seq): self._prompt_logprobs(seq, logits[row: row + n]) for (seq, row, n), _ in prompt_lp}
        if exports:
            self._snapshot_exports(chunks, exports, rows_lp)
        for c in chunks:
            c.seq.num_computed += c.num_tokens
        verified, rejected = [], {}
        if verification is not None:  # before any fork or snapshot reads a slot: commit the verifying ones
            verified = spec.verify(logits, [(s, r) for s, r in samplers if s.draft is not None])
            rejected = {seq: len(seq.draft_tokens) + 1 - len(tokens) for seq, tokens, _ in verified}
            self.runner.commit(verification, rejected)
            for seq, n in rejected.items():
                seq.num_computed -= n  # the latents past the accepted tokens no longer count
                seq.draft = None
        forks = [(seq, s) for seq, _ in samplers for s in self._fork(seq)]
        sampling = [(s, r) for seq, r in samplers for s in [seq, *(c for p, c in forks if p is seq)]]
        plain = [(s, r) for s, r in sampling if s not in rejected]
        commits = []
        if plain:
            seqs = [s for s, _ in plain]
            tokens, logprobs = sample(take_rows(logits, [r for _, r in plain]), seqs, self.sync_tokens)
            commits += [(seq, [t], [lp]) for seq, t, lp in zip(seqs, tokens, logprobs)]
        commits += verified
        advanced: dict[str, RequestState] = {}
        first = time.monotonic()
        for seq, tokens, logprobs in commits:
            seq.group.first_token = seq.group.first_token or first
            for token, lp in zip(tokens, logprobs):
                self.scheduler.update(seq, token, lp)
                self.counters["generation_tokens_total"] += 1
                if seq.status is Status.FINISHED:  # a stop id, string or the length: the rest is dropped
                    break
            advanced[seq.group.request.request_id] = seq.group
        if spec is not None and spec.needs_taps:
            spec.record_taps(chunks, starts, out.taps)
            for parent, child in forks:
                spec.fork(parent, child)
        return ended + [self._output(g) for g in advanced.values()]

    def _sequence(self, group: RequestState, index: int, tokens: list[int], constraint=None, **kw) -> Sequence:
        p = group.request.params
        seed = p.seed + index if p.seed is not None else int(torch.randint(0, 2**62, ()))
        text = StopDecoder(self.tokenizer, p.stop) if self.tokenizer is not None else None
        return Sequence(group, index, tokens, constraint, torch.Generator(device=self.device).manual_seed(seed),
                        text=text, **kw)

    def _fork(self, seq: Sequence) -> list[Sequence]:
        """n > 1: when the prompt's prefill ends, the other n-1 choices start from a copy of its state."""
        group, req = seq.group, seq.group.request
        if group.forked:
            return []
        group.forked = True
        children = [self._sequence(group, i, list(seq.tokens), req.constraint_factory() if req.constraint_factory
                                   else None, num_computed=seq.num_computed, status=Status.RUNNING)
                    for i in range(1, req.params.n)]
        return self.scheduler.fork(seq, children)

    def _media(self, c: Chunk) -> tuple[list[int], Tensor] | None:
        """The image tokens this chunk embeds: (its rows, their [n, D] embeddings), or None."""
        group = c.seq.group
        if not group.media:
            return None
        lo, hi = c.seq.num_computed, c.seq.num_computed + c.num_tokens
        picks = [(p - lo, j) for j, p in enumerate(group.media) if lo <= p < hi]
        if not picks:
            return None
        return [r for r, _ in picks], group.request.mm_embeds[[j for _, j in picks]]

    def _snapshot_exports(self, chunks: list[Chunk], exports: list, rows_lp: dict[int, Tensor]) -> None:
        """Insert the states the forward exported (one entry per (chunk, offset), in that order), with the
        prompt logprobs up to them (`rows_lp`: the chunk's prompt log-softmax rows, by sequence)."""

        recurrent = torch.stack([layer[0] for layer in exports])  # [Lk, E, H, K, V]
        conv = torch.stack([torch.stack(layer[1:]) for layer in exports])  # [Lk, 3, E, W-1, P]
        e = 0
        for c in chunks:
            seq = c.seq
            for off in c.exports:
                p = seq.num_computed + off
                state = SlotState(recurrent[:, e].clone(), conv[:, :, e].clone())
                e += 1
                blocks = seq.blocks[: p // self.blocks.size]
                lp = rows_lp.get(id(seq))
                kept = prompt_logprobs_at(seq.group, p, lp[p - 1 - seq.num_computed] if lp is not None
                                          and p - 1 - seq.num_computed < lp.shape[0] else None)
                self.prefix.insert(seq.group.root_key, seq.tokens[:p], state, blocks, self.blocks.finite(blocks, p),
                                   kept)

    def _prompt_logprobs(self, seq: Sequence, logits: Tensor) -> Tensor:
        """Prompt logprobs from the [n, V] logits of a chunk starting at seq.num_computed (row i predicts prompt
        token num_computed+i+1); positions already reported (a preempted prefill computes them again) are
        skipped. Returns the rows' log-softmax, which the chunk's prefix snapshots keep."""
        group, k, first, n = seq.group, seq.params.prompt_logprobs, seq.num_computed, logits.shape[0]
        if group.prompt_logprobs is None:
            group.prompt_logprobs = [None]
        lp = logits.log_softmax(-1)
        lo = len(group.prompt_logprobs)  # the next prompt position without a logprob
        hi = min(first + n, seq.num_prompt - 1)  # the last position a row of this chunk predicts
        if hi >= lo:
            group.prompt_logprobs.extend(token_logprobs(lp[lo - first - 1: hi - first], seq.tokens[lo: hi + 1], k))
        if first + n == seq.num_prompt:  # the prompt's last row: its end snapshot keeps it
            group.prompt_end_row = lp[-1].clone()
        return lp

    def _output(self, group: RequestState) -> RequestOutput:
        outs = []
        for seq in group.seqs:
            ids, lps, text = seq.take_output()
            outs.append(SequenceOutput(seq.index, ids, lps, text, seq.finish_reason, seq.stop_reason))
        # an aborted n > 1 request may end before its fork: with the one sequence it has
        finished = group.finished or any(s.finish_reason == "abort" for s in group.seqs)
        if finished:
            group.finished_at = time.monotonic()
            self.requests.pop(group.request.request_id, None)
        metrics = dict(arrival=group.arrival, first_token=group.first_token, finished=group.finished_at,
                       queue_time=(group.first_scheduled or group.arrival) - group.arrival)
        # the request's own prompt list, not a copy per step (the engine never modifies it)
        return RequestOutput(group.request.request_id, group.request.prompt_ids, outs, finished,
                             group.cached_tokens, group.prompt_logprobs, metrics)
