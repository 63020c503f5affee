"""`generate()` and `stream()`: a short loop over the serving engine, the one cached path.

The prompts become requests of an engine (`config`, or one sized for them: a slot each, no prefix cache); each
engine step's new tokens come back as TokenEvents, with their text from the engine's stop-aware decoder.
`engine_stream` runs the same loop on an engine already built (`load_engine`'s).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from kimik3.inference.engine import Engine, EngineConfig, Request
from kimik3.inference.engine.config import GRID
from kimik3.inference.sampling import SamplingParams
from kimik3.tokenizer import Tokenizer


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


def check_positions(prompt_tokens: int, max_new_tokens: int, positions: int | None, what: str = "the prompt",
                    stop: str = "set max_model_len={positions}") -> None:
    """A ValueError when a prompt of `prompt_tokens` fills the model's `positions` (max_position_embeddings) or
    `max_new_tokens` more would run past them: `sized_config` and the transformers route (`kimik3.hf`) both check
    with this. `what` names the prompt; `stop` says which argument would stop generation at the end of the context
    instead."""
    if positions is None:
        return
    if prompt_tokens >= positions:
        raise ValueError(f"{what}: a prompt of {prompt_tokens} tokens leaves no room for output within the model's "
                         f"{positions} positions (max_position_embeddings)")
    if prompt_tokens + max_new_tokens > positions:
        raise ValueError(f"{what}: {prompt_tokens} tokens + max_new_tokens {max_new_tokens} exceed the model's "
                         f"{positions} positions (max_position_embeddings); lower max_new_tokens to "
                         f"{positions - prompt_tokens}, or {stop.format(positions=positions)} to stop there")


def sized_config(config: EngineConfig | None, prompts: list[list[int]], params: list[SamplingParams],
                 positions: int | None) -> EngineConfig:
    """`config`, or (None) one sized to the prompts: a slot each, all of them prefilled in one step, no prefix
    cache, no CUDA graphs. Without a max_model_len, prompt + max_new_tokens past the model's `positions`
    (max_position_embeddings) is refused here (`check_positions`), nothing allocated; with one, generation stops
    at it ("length")."""
    bound = None if config is None else config.max_model_len
    if bound is not None and positions is not None and bound > positions:
        raise ValueError(f"max_model_len {bound} exceeds the model's {positions} positions (max_position_embeddings)")
    if bound is None:
        for i, (p, q) in enumerate(zip(params, prompts, strict=True)):
            check_positions(len(q), p.max_new_tokens, positions, f"prompt {i}")
    if config is not None:
        return config
    return EngineConfig(max_num_seqs=len(prompts), enable_prefix_cache=False, use_cuda_graphs=False,
                        max_model_len=max(len(q) + p.max_new_tokens for q, p in zip(prompts, params)),
                        max_num_batched_tokens=max(GRID, sum(map(len, prompts))))


@torch.no_grad()
def stream(model: nn.Module, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
           *, config: EngineConfig | None = None, tokenizer: Tokenizer | None = None,
           eos_token_ids: Sequence[int] = (), pixel_values: Tensor | None = None, grid_thws: Tensor | None = None,
           sync_tokens: Callable[[Tensor], object] | None = None) -> Iterator[list[TokenEvent]]:
    """Generate for a batch of token-id prompts, yielding each step's new tokens as they come.

    Args:
        model: a K3 model (`K3ForCausalLM` or `K3ForConditionalGeneration`) in eval mode.
        prompts: B lists of token ids (ragged).
        params: one SamplingParams for all, or one per prompt.
        config: the engine's knobs (`EngineConfig`); None sizes one to the prompts (`sized_config`). Its
            max_model_len bounds prompt + generated tokens: a prompt that fills it is an error, and a sequence
            that reaches it stops ("length"). Unset, the model's max_position_embeddings bounds prompt +
            max_new_tokens, and a request past it is an error (nothing is allocated for it).
        tokenizer: a `kimik3.tokenizer.Tokenizer`; enables text deltas and stop strings.
        eos_token_ids: ids that end every sequence (e.g. `<|end_of_msg|>`), besides each request's own.
        pixel_values, grid_thws: the prompts' images (`kimik3.vision.process_images`), in prompt order; each
            prompt carries one <|media_pad|> per image token (`kimik3.vision.expand_media_pads`).
        sync_tokens: called in place on each step's sampled tokens [B] (int64, on the model's device) before
            they are used; several processes generating together (tensor / expert parallel) pass a broadcast
            from rank 0, so every rank continues with the same tokens and stops at the same step.

    Yields:
        per engine step, one TokenEvent per new token of each sequence that advanced.
    """
    cfg = model.config.text if hasattr(model.config, "text") else model.config
    prompts, params = _requests(prompts, params, cfg.vocab_size)
    engine = Engine(model, sized_config(config, prompts, params, cfg.max_position_embeddings),
                    eos_token_ids=eos_token_ids, tokenizer=tokenizer, sync_tokens=sync_tokens)
    yield from engine_stream(engine, prompts, params, pixel_values=pixel_values, grid_thws=grid_thws)


def engine_stream(engine: Engine, prompts: Sequence[Sequence[int]],
                  params: SamplingParams | Sequence[SamplingParams], *, pixel_values: Tensor | None = None,
                  grid_thws: Tensor | None = None) -> Iterator[list[TokenEvent]]:
    """`stream` on an engine already built (`load_engine`'s, kept across a chat's turns): the prompts join
    whatever it runs, and each step's new tokens of theirs come back. A caller that stops iterating early aborts
    the prompts still running (their slots are free for the next call)."""
    prompts, params = _requests(prompts, params, engine.vocab_size)
    embeds = _image_tokens(engine, prompts, pixel_values, grid_thws)
    base = f"stream-{next(_calls)}-"  # unique among the engine's requests, whoever else runs on it
    live: dict[str, int] = {}
    try:
        for i, (q, p) in enumerate(zip(prompts, params)):
            rid = f"{base}{i}"
            try:
                engine.add_request(Request(rid, q, p, mm_embeds=embeds[i] if embeds else None))
            except ValueError as e:  # the engine's message names its request id: name the prompt instead
                raise ValueError(f"prompt {i}: {str(e).removeprefix(f'request {rid!r}: ')}") from None
            live[rid] = i
        while live:
            events = []
            for out in engine.step():
                i = live.get(out.request_id)
                if i is None:
                    continue
                for o in out.outputs:
                    for k, token in enumerate(o.token_ids):
                        last = k == len(o.token_ids) - 1
                        events.append(TokenEvent(i, token, o.text if last else "", o.finish_reason if last else None))
                if out.finished:
                    del live[out.request_id]
            if events:
                yield events
    finally:
        for rid in live:
            engine.abort(rid)


_calls = itertools.count()


def _requests(prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
              vocab_size: int) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = _check_prompts(prompts, vocab_size)
    params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    if len(params) != len(prompts):
        raise ValueError(f"{len(params)} sampling parameter sets for {len(prompts)} prompts")
    return prompts, params


def _image_tokens(engine: Engine, prompts: list[list[int]], pixel_values: Tensor | None,
                  grid_thws: Tensor | None) -> list[Tensor | None] | None:
    """Per prompt, the projected image tokens its <|media_pad|> ids take, in order (images in prompt order)."""
    if pixel_values is None:
        return None
    from kimik3.model.vision import encode_images

    model = engine.vision_model
    if model is None:
        raise ValueError("images were given but this model has no vision tower (text-only config or load)")
    device = next(model.parameters()).device
    with torch.no_grad():
        feats = torch.cat(encode_images(model.vision_tower, model.mm_projector, pixel_values.to(device), grid_thws))
    pad = model.config.media_placeholder_token_id
    counts = [sum(t == pad for t in q) for q in prompts]
    if sum(counts) != feats.shape[0]:
        raise ValueError(f"the prompts have {sum(counts)} <|media_pad|> positions but the images give "
                         f"{feats.shape[0]} tokens")
    return [part if len(part) else None for part in feats.split(counts)]


def generate(model: nn.Module, prompts: Sequence[Sequence[int]],
             params: SamplingParams | Sequence[SamplingParams] | None = None, *, config: EngineConfig | None = None,
             tokenizer: Tokenizer | None = None, eos_token_ids: Sequence[int] = (), pixel_values: Tensor | None = None,
             grid_thws: Tensor | None = None) -> list[Completion]:
    """`stream` run to the end: one Completion (ids, text, finish reason) per prompt (params None: the
    SamplingParams defaults)."""
    params = SamplingParams() if params is None else params
    out = [Completion(prompt_tokens=len(p)) for p in prompts]
    for events in stream(model, prompts, params, config=config, tokenizer=tokenizer, eos_token_ids=eos_token_ids,
                         pixel_values=pixel_values, grid_thws=grid_thws):
        for e in events:
            c = out[e.index]
            c.token_ids.append(e.token_id)
            c.text += e.text
            c.finish_reason = e.finish_reason
    return out
