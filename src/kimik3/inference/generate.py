"""The readable generation path: left-padded batched prefill, then one decode step per token.

Each step samples on the device (no host sync inside the sampler), then copies the B new ids to the host
once: streaming needs them, and the per-sequence stop checks (ids, strings, length) run there.
Finished sequences keep decoding in the static batch, but their outputs are dropped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor, nn

from kimik3.inference.cuda_graph import GraphedDecoder
from kimik3.inference.sampling import Sampler, SamplingParams


class Detokenizer(Protocol):
    def decode(self, ids: list[int]) -> str: ...


@dataclass
class TokenEvent:
    """One new token of one sequence."""

    index: int  # which prompt
    token_id: int
    text: str  # newly completed text ('' without a tokenizer or while a UTF-8 character is incomplete)
    finish_reason: str | None = None  # "stop" (a stop id or string) or "length", on the last event


@dataclass
class Completion:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0


class _Row:
    """Host-side bookkeeping of one sequence: its ids, its text so far, when it stops."""

    def __init__(self, params: SamplingParams, eos: Sequence[int], tokenizer: Detokenizer | None):
        self.params, self.tokenizer = params, tokenizer
        self.stop_ids = set(params.stop_token_ids) | set(eos)
        self.ids: list[int] = []
        self.text = ""
        self.emitted = 0  # characters of self.text already streamed
        self.finish: str | None = None

    def add(self, token: int) -> str:
        """Record a token; return the text that can now be streamed."""
        self.ids.append(token)
        if token in self.stop_ids:
            self.finish = "stop"
        elif len(self.ids) >= self.params.max_new_tokens:
            self.finish = "length"
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(self.ids[:-1] if token in self.stop_ids else self.ids)
        if self.finish is None:
            text = text.rstrip("\ufffd")  # an incomplete UTF-8 character: wait for its next bytes
        cuts = [i for i in (text.find(s) for s in self.params.stop) if i >= 0]
        if cuts:
            text, self.finish = text[: min(cuts)], "stop"
        self.text = text
        # while running, hold back a tail that may still grow into a stop string
        held = 0 if self.finish else max((k for s in self.params.stop for k in range(1, len(s))
                                          if text.endswith(s[:k])), default=0)
        safe = len(text) - held
        delta = text[self.emitted:safe]
        self.emitted = max(self.emitted, safe)
        return delta


def _check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int) -> list[list[int]]:
    if not prompts:
        raise ValueError("no prompts given")
    out = []
    for i, p in enumerate(prompts):
        p = [int(t) for t in p]
        if not p:
            raise ValueError(f"prompt {i} is empty")
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
        out.append(p)
    return out


def _fit_context(prompts: list[list[int]], params: list[SamplingParams], max_context: int | None,
                 positions: int | None) -> list[SamplingParams]:
    """Each request's params with max_new_tokens cut to what `max_context` leaves; without `max_context`,
    a request past the model's `positions` (max_position_embeddings) is a ValueError."""
    if max_context is not None:
        if isinstance(max_context, bool) or not isinstance(max_context, int) or max_context < 2:
            raise ValueError(f"max_context must be an integer >= 2, got {max_context!r}")
        if positions is not None and max_context > positions:
            raise ValueError(f"max_context {max_context} exceeds the model's {positions} positions "
                             "(max_position_embeddings)")
    limit = max_context if max_context is not None else positions
    if limit is None:
        return params
    longest = max(len(p) for p in prompts)
    if longest >= limit:
        what = "max_context" if max_context is not None else "the model's max_position_embeddings"
        raise ValueError(f"a prompt of {longest} tokens leaves no room in the allowed context of {limit} ({what})")
    if max_context is None:
        for i, (p, q) in enumerate(zip(params, prompts, strict=True)):
            if len(q) + p.max_new_tokens > limit:
                raise ValueError(f"prompt {i}: {len(q)} tokens + max_new_tokens {p.max_new_tokens} exceed the "
                                 f"model's {limit} positions (max_position_embeddings); lower max_new_tokens to "
                                 f"{limit - len(q)}, or pass max_context={limit} to stop there")
        return params
    return [dataclasses.replace(p, max_new_tokens=min(p.max_new_tokens, limit - len(q)))
            for p, q in zip(params, prompts, strict=True)]


def _left_pad(prompts: list[list[int]], pad: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Ragged prompts -> ids [B, T] (pad on the left) and the mask of real tokens [B, T], on `device`."""
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), longest, dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p):] = torch.tensor(p)
        mask[i, longest - len(p):] = True
    return ids.to(device), mask.to(device)


BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@torch.no_grad()
def stream(model: nn.Module, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
           *, tokenizer: Detokenizer | None = None, eos_token_ids: Sequence[int] = (),
           max_context: int | None = None, cuda_graph: bool = False, pixel_values: Tensor | None = None,
           grid_thws: Tensor | None = None, sync_tokens: Callable[[Tensor], object] | None = None
           ) -> Iterator[list[TokenEvent]]:
    """Generate for a batch of token-id prompts, yielding each step's new tokens as they come.

    Args:
        model: a K3 model (`K3ForCausalLM` or `K3ForConditionalGeneration`) in eval mode.
        prompts: B lists of token ids (ragged; they are left-padded internally).
        params: one SamplingParams for all, or one per prompt.
        tokenizer: anything with `decode(ids) -> str`; enables text deltas and stop strings.
        eos_token_ids: ids that end every sequence (e.g. `<|end_of_msg|>`), besides each request's own.
        max_context: the most tokens (prompt + generated) a sequence may hold, at most the model's
            `max_position_embeddings`; a prompt that fills it is an error and generation stops ("length") when
            a sequence reaches it. None: the model's `max_position_embeddings` bounds prompt + max_new_tokens,
            and a request past it is an error (nothing is allocated for it).
        cuda_graph: decode under a CUDA graph (model on a GPU); the batch is padded up to a bucket size
            (BATCH_BUCKETS) with dummy rows whose outputs are dropped.
        pixel_values, grid_thws: the prompts' images (`kimik3.vision.process_images`), in prompt order; each
            prompt carries one <|media_pad|> per image token (`kimik3.vision.expand_media_pads`).
        sync_tokens: called in place on each step's sampled tokens [B] (int64, on the model's device) before
            they are used; several processes generating together (tensor / expert parallel) pass a broadcast
            from rank 0, so every rank continues with the same tokens and stops at the same step.

    Yields:
        per step, one TokenEvent per still-running sequence.
    """
    cfg = model.config.text if hasattr(model.config, "text") else model.config
    prompts = _check_prompts(prompts, cfg.vocab_size)
    params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    if len(params) != len(prompts):
        raise ValueError(f"{len(params)} sampling parameter sets for {len(prompts)} prompts")
    params = _fit_context(prompts, params, max_context, cfg.max_position_embeddings)
    longest = max(len(p) for p in prompts)
    device = next(model.parameters()).device
    real = len(prompts)
    if cuda_graph:  # pad the batch to a bucket with one-token dummy prompts (their rows are never reported)
        bucket = next((b for b in BATCH_BUCKETS if b >= real), real)
        prompts, params = prompts + [[0]] * (bucket - real), params + [params[0]] * (bucket - real)
    B = len(prompts)
    ids, mask = _left_pad(prompts, cfg.pad_token_id if cfg.pad_token_id is not None else 0, device)
    steps = max(p.max_new_tokens for p in params)
    cache = model.new_cache(B, longest + steps)
    sampler = Sampler(params, cfg.vocab_size, device)
    sampler.observe(ids, mask)
    rows = [_Row(p, eos_token_ids, tokenizer) for p in params]
    images = {} if pixel_values is None else {"pixel_values": pixel_values.to(device), "grid_thws": grid_thws}
    logits = model(ids, cache=cache, attention_mask=mask, **images)[:, -1]
    decode = GraphedDecoder(model, cache) if cuda_graph else (lambda t: model(t[:, None], cache=cache)[:, -1])
    for _ in range(steps):
        tokens = sampler.sample(logits)
        if sync_tokens is not None:
            sync_tokens(tokens)
        events = []
        for i, token in enumerate(tokens.tolist()[:real]):
            row = rows[i]
            if row.finish is None:
                text = row.add(token)
                events.append(TokenEvent(i, token, text, row.finish))
        if events:
            yield events
        if all(r.finish for r in rows[:real]) or cache.length == cache.max_length:
            return
        sampler.observe(tokens[:, None])
        logits = decode(tokens)


def generate(model: nn.Module, prompts: Sequence[Sequence[int]],
             params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             tokenizer: Detokenizer | None = None, eos_token_ids: Sequence[int] = (),
             max_context: int | None = None, cuda_graph: bool = False, pixel_values: Tensor | None = None,
             grid_thws: Tensor | None = None) -> list[Completion]:
    """`stream` run to the end: one Completion (ids, text, finish reason) per prompt (params None: the
    SamplingParams defaults)."""
    params = SamplingParams() if params is None else params
    out = [Completion(prompt_tokens=len(p)) for p in prompts]
    for events in stream(model, prompts, params, tokenizer=tokenizer, eos_token_ids=eos_token_ids,
                         max_context=max_context, cuda_graph=cuda_graph, pixel_values=pixel_values,
                         grid_thws=grid_thws):
        for e in events:
            c = out[e.index]
            c.token_ids.append(e.token_id)
            c.text += e.text
            c.finish_reason = e.finish_reason
    return out
