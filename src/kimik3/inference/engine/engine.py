"""The serving engine: continuous batching over the hybrid state pool, with an exact prefix cache.

    engine = Engine(model, EngineConfig(max_num_seqs=16), eos_token_ids=[...])
    engine.add_request(Request("a", prompt_ids, SamplingParams(max_new_tokens=64)))
    while engine.has_unfinished():
        for out in engine.step(): ...          # each request's new tokens (deltas)

Synchronous and single-threaded: a server runs `step()` in its own thread and talks to it through queues.
A step is schedule -> run -> update: the scheduler picks the chunks (scheduler.py; with speculative decoding the
proposers draft first, speculative.py), the runner runs them in one packed forward (runner.py), and the results
become tokens (prompt logprobs and the prefix snapshots the forward exported, then the drafts verified and
committed, or a token sampled: sampler.py) that the scheduler's update appends (stop checks, finish).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from collections.abc import Sequence as Seq
from pathlib import Path

import torch
from torch import Tensor, nn

from kimik3.inference.engine.config import EngineConfig
from kimik3.inference.engine.draft_length import StepCosts
from kimik3.inference.engine.pools import BlockPool, SlotPool, state_pool
from kimik3.inference.engine.prefix_cache import PrefixCache, root_key
from kimik3.inference.engine.request import (
    Request,
    RequestOutput,
    RequestState,
    Sequence,
    Status,
    accumulate,
    check_request,
)
from kimik3.inference.engine.runner import ModelRunner, StepOutput, logit_rows, take_rows
from kimik3.inference.engine.sampler import prompt_logprobs, sample
from kimik3.inference.engine.scheduler import Chunk, Scheduler
from kimik3.inference.engine.speculative import Speculator
from kimik3.inference.sampling import SamplingParams
from kimik3.lora.serving import attach_adapters
from kimik3.ops.kda import supports_checkpoints
from kimik3.ops.matmul import batch_invariant
from kimik3.placement import tier_stats, tiered_layers
from kimik3.tokenizer.stops import StopDecoder


class Engine:
    """Continuous batching for a K3 model (`K3ForCausalLM` or `K3ForConditionalGeneration`).

    Args:
        config: the runtime knobs (`EngineConfig`; None: its defaults).
        eos_token_ids: ids that end every request (unless its ignore_eos).
        tokenizer: a `kimik3.tokenizer.Tokenizer`: the outputs of requests that ask for text (`detokenize`, the
            default) carry their visible text, and stop strings stop; a request that does not is never decoded.
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
        self.adapters = attach_adapters(lm, adapters) if adapters else None
        self.config, self.model, self.tokenizer, self.sync_tokens = cfg, lm, tokenizer, sync_tokens
        # the multimodal wrapper when it has a vision tower: what turns a prompt's images into its media tokens
        self.vision_model = model if getattr(model, "has_vision", False) else None
        self.media_id = getattr(model.config, "media_placeholder_token_id", None)
        self.vocab_size = lm.config.vocab_size
        self.max_model_len = cfg.max_model_len or lm.config.max_position_embeddings
        w = lm.lm_head.weight
        self.dtype, self.device = w.dtype, w.device
        self.pool = state_pool(lm, cfg, self.max_model_len)
        self.slots, self.blocks = SlotPool(self.pool, cfg.poison), BlockPool(self.pool, cfg.poison)
        self.prefix = PrefixCache(self.blocks, cfg.prefix_cache_bytes, cfg.poison) if cfg.enable_prefix_cache else None
        self.scheduler = Scheduler(self.slots, self.blocks, self.prefix, max_num_seqs=cfg.max_num_seqs,
                                   max_num_batched_tokens=cfg.max_num_batched_tokens,
                                   snapshot_interval=cfg.snapshot_interval, interior_snapshots=supports_checkpoints(w),
                                   max_model_len=self.max_model_len, eos_token_ids=tuple(eos_token_ids))
        self.speculator = Speculator(cfg.speculative, lm) if cfg.speculative is not None else None
        if self.speculator is not None and sync_tokens is not None:
            raise ValueError("speculative decoding with sync_tokens (ranks generating together) is not supported")
        # the mode is thread-local: entered around the construction (captures, warm-up) and each step. On the CPU
        # the default kernels are batch-invariant but for MKL's 16-bit GEMM at some shapes, which the mode groups
        # by rows (at the price of its Python dispatch on every op, so only when asked)
        self.mode = batch_invariant if cfg.deterministic else contextlib.nullcontext
        with torch.no_grad(), self.mode():
            spec = self.speculator
            self.runner = ModelRunner(lm, self.pool, -(-self.max_model_len // cfg.block_size), cfg.use_cuda_graphs,
                                      cfg.max_num_seqs, self.adapters,
                                      tuple(1 + k for k in spec.lengths.lengths) if spec is not None else (),
                                      spec.needs_taps if spec is not None else ())
            # the step costs it picks k by: timed on first need. Not with tiered experts: a timed step's random
            # tokens would pass through the expert cache, counted, and evict hot experts; there k stays the ceiling
            if spec is not None and spec.lengths.adaptive and not tiered_layers(lm):
                spec.lengths.costs = StepCosts(self.runner.time_steps, self.runner.sizes)
            if cfg.warmup:
                self.runner.capture_graphs()
                self.runner.warmup(cfg.max_num_batched_tokens)
                # ... or here, every batch bucket, on CUDA (graph replays); on the CPU, where timing the demo's eager
                # steps for every bucket added 11 s to a 64-sequence warm-up, each bucket is timed when first met
                if spec is not None and spec.lengths.costs is not None and self.device.type == "cuda":
                    for n in self.runner.sizes:
                        spec.lengths.costs(n, 0)
        self.model_id = model_id
        self.requests: dict[str, RequestState] = {}
        self.aborted: list[RequestState] = []  # final outputs the next step() returns
        self.counters = dict(aborts=0, prompt_tokens_total=0)

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already running")
        ids = check_request(request, self.vocab_size, self.max_model_len, self.pool.num_blocks * self.pool.block_size,
                            self.scheduler.max_num_seqs)
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
                    generation_tokens_total=self.scheduler.generated,
                    **(self.speculator.stats.as_metrics() if self.speculator is not None else {}),
                    **{f"expert_cache_{k}": v for k, v in tier_stats(self.model).items()})

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
    def step(self, on_launch: Callable[[], None] | None = None) -> list[RequestOutput]:
        """One scheduler step: the new output of each request that sampled a token (and of those ended since).
        `on_launch()` is called once the step's forward is queued and before its results are waited for: a server
        hands the previous step's outputs to its front end then, so that formatting them overlaps the device, not
        this thread's preparation of the step (both need the GIL)."""
        with self.mode():
            return self._step(on_launch)

    def _step(self, on_launch: Callable[[], None] | None) -> list[RequestOutput]:
        ended = [self._output(g) for g in self.aborted]
        self.aborted.clear()
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running, self.max_model_len)
        chunks = self.scheduler.schedule()
        if not chunks:
            return ended
        rows, samplers, prompt_rows = logit_rows(chunks)
        starts = [c.seq.num_computed for c in chunks]
        out = self.runner.run(chunks, rows, [c.seq.media(c.num_tokens) for c in chunks])
        if on_launch is not None:
            on_launch()
        commits, forks = self._tokens(chunks, out, samplers, prompt_rows)
        advanced = self.scheduler.append(commits)
        if self.speculator is not None:  # what its proposer reads of the step, once the tokens are appended
            self.speculator.observe(chunks, starts, out.taps, forks)
        return ended + [self._output(g) for g in advanced]

    def _tokens(self, chunks: list[Chunk], out: StepOutput, samplers: list, prompt_rows: list
                ) -> tuple[list[tuple[Sequence, list[int], list]], list[tuple[Sequence, Sequence]]]:
        """What the forward's results commit: each sampling sequence's tokens and their logprobs (a verified draft's
        accepted tokens and the bonus, or one sampled token), after the prompt logprobs and the prefix snapshots the
        step computed; and the (parent, child) choices n > 1 forked."""
        logits, spec = out.logits, self.speculator
        lp_rows = {id(seq): prompt_logprobs(seq, logits[row: row + n]) for (seq, row, n), _ in prompt_rows}
        if out.exports:
            self.prefix.insert_exports(chunks, out.exports, lp_rows)
        for c in chunks:
            c.seq.num_computed += c.num_tokens
        verified = []
        if out.verification is not None:  # before any fork or snapshot reads a slot: commit the verifying ones
            verified = spec.verify_and_commit(logits, samplers, out.verification, self.runner)
        done = {seq for seq, _, _ in verified}
        forks = [(seq, s) for seq, _ in samplers for s in self._fork(seq)]
        drawn = [(s, r) for seq, r in samplers if seq not in done for s in [seq, *(c for p, c in forks if p is seq)]]
        commits = []
        if drawn:
            seqs = [s for s, _ in drawn]
            tokens, logprobs = sample(take_rows(logits, [r for _, r in drawn]), seqs, self.sync_tokens)
            commits = [(seq, [t], [lp]) for seq, t, lp in zip(seqs, tokens, logprobs)]
        return commits + verified, forks

    def _sequence(self, group: RequestState, index: int, tokens: list[int], constraint=None, **kw) -> Sequence:
        p = group.request.params
        seed = p.seed + index if p.seed is not None else int(torch.randint(0, 2**62, ()))
        text = (StopDecoder(self.tokenizer, p.stop, skip_special=p.skip_special_tokens)
                if self.tokenizer is not None and p.detokenize else None)
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

    def _output(self, group: RequestState) -> RequestOutput:
        out = group.output()
        if out.finished:
            self.requests.pop(group.request.request_id, None)
        return out
