"""`generate()` and `stream()`: a short loop over the serving engine, the one cached path.

The prompts become requests of an engine sized for them (a slot each, no prefix cache); each engine step's
new tokens come back as TokenEvents, with their text from the engine's stop-aware decoder.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from kimik3.inference.engine import Engine, EngineConfig, Request
from kimik3.inference.engine.config import GRID, SpeculativeConfig
from kimik3.inference.sampling import SamplingParams
from kimik3.inference.spec import SpecStats
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
                    stop: str = "max_context={positions}") -> None:
    """A ValueError when a prompt of `prompt_tokens` fills the model's `positions` (max_position_embeddings) or
    `max_new_tokens` more would run past them (the transformers route checks with this too); `stop` says which
    argument would stop generation at the end of the context instead."""
    if positions is None:
        return
    if prompt_tokens >= positions:
        raise ValueError(f"{what}: {prompt_tokens} tokens leave no room in the model's {positions} positions "
                         "(max_position_embeddings)")
    if prompt_tokens + max_new_tokens > positions:
        raise ValueError(f"{what}: {prompt_tokens} tokens + max_new_tokens {max_new_tokens} exceed the model's "
                         f"{positions} positions (max_position_embeddings); lower max_new_tokens to "
                         f"{positions - prompt_tokens}, or pass {stop.format(positions=positions)} to stop there")


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
            check_positions(len(q), p.max_new_tokens, limit, f"prompt {i}")
        return params
    return [dataclasses.replace(p, max_new_tokens=min(p.max_new_tokens, limit - len(q)))
            for p, q in zip(params, prompts, strict=True)]


@torch.no_grad()
def stream(model: nn.Module, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
           *, tokenizer: Tokenizer | None = None, eos_token_ids: Sequence[int] = (),
           max_context: int | None = None, cuda_graph: bool = False, pixel_values: Tensor | None = None,
           grid_thws: Tensor | None = None, sync_tokens: Callable[[Tensor], object] | None = None,
           speculative: SpeculativeConfig | None = None, spec_stats: SpecStats | None = None
           ) -> Iterator[list[TokenEvent]]:
    """Generate for a batch of token-id prompts, yielding each step's new tokens as they come.

    Args:
        model: a K3 model (`K3ForCausalLM` or `K3ForConditionalGeneration`) in eval mode.
        prompts: B lists of token ids (ragged).
        params: one SamplingParams for all, or one per prompt.
        tokenizer: a `kimik3.tokenizer.Tokenizer`; enables text deltas and stop strings.
        eos_token_ids: ids that end every sequence (e.g. `<|end_of_msg|>`), besides each request's own.
        max_context: the most tokens (prompt + generated) a sequence may hold, at most the model's
            `max_position_embeddings`; a prompt that fills it is an error and generation stops ("length") when
            a sequence reaches it. None: the model's `max_position_embeddings` bounds prompt + max_new_tokens,
            and a request past it is an error (nothing is allocated for it).
        cuda_graph: replay the engine's CUDA-graphed decode steps (model on a GPU).
        pixel_values, grid_thws: the prompts' images (`kimik3.vision.process_images`), in prompt order; each
            prompt carries one <|media_pad|> per image token (`kimik3.vision.expand_media_pads`).
        sync_tokens: called in place on each step's sampled tokens [B] (int64, on the model's device) before
            they are used; several processes generating together (tensor / expert parallel) pass a broadcast
            from rank 0, so every rank continues with the same tokens and stops at the same step.
        speculative: speculative decoding (`SpeculativeConfig`): the same tokens (greedy) or distribution
            (sampling), several tokens per step.
        spec_stats: with `speculative`, a `SpecStats` that receives the run's counters (drafts, draft and
            accepted tokens) as the run ends.

    Yields:
        per engine step, one TokenEvent per new token of each sequence that advanced.
    """
    cfg = model.config.text if hasattr(model.config, "text") else model.config
    prompts = _check_prompts(prompts, cfg.vocab_size)
    params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    if len(params) != len(prompts):
        raise ValueError(f"{len(params)} sampling parameter sets for {len(prompts)} prompts")
    params = _fit_context(prompts, params, max_context, cfg.max_position_embeddings)
    config = EngineConfig(max_num_seqs=len(prompts), enable_prefix_cache=False, use_cuda_graphs=cuda_graph,
                          max_model_len=max(len(q) + p.max_new_tokens for q, p in zip(prompts, params)),
                          max_num_batched_tokens=max(GRID, sum(map(len, prompts))), speculative=speculative)
    engine = Engine(model, config, eos_token_ids=eos_token_ids, tokenizer=tokenizer, sync_tokens=sync_tokens)
    embeds = _image_tokens(model, prompts, pixel_values, grid_thws)
    for i, (q, p) in enumerate(zip(prompts, params)):
        engine.add_request(Request(str(i), q, p, mm_embeds=embeds[i] if embeds else None))
    while engine.has_unfinished():
        events = []
        for out in engine.step():
            for o in out.outputs:
                for k, token in enumerate(o.token_ids):
                    last = k == len(o.token_ids) - 1
                    events.append(TokenEvent(int(out.request_id), token, o.text if last else "",
                                             o.finish_reason if last else None))
        if events:
            yield events
    if spec_stats is not None and engine.speculator is not None:
        vars(spec_stats).update(copy.deepcopy(vars(engine.speculator.stats)))


def _image_tokens(model: nn.Module, prompts: list[list[int]], pixel_values: Tensor | None,
                  grid_thws: Tensor | None) -> list[Tensor | None] | None:
    """Per prompt, the projected image tokens its <|media_pad|> ids take, in order (images in prompt order)."""
    if pixel_values is None:
        return None
    from kimik3.model.vision import encode_images

    if not getattr(model, "has_vision", False):
        raise ValueError("images were given but this model has no vision tower (text-only config or load)")
    device = next(model.parameters()).device
    feats = torch.cat(encode_images(model.vision_tower, model.mm_projector, pixel_values.to(device), grid_thws))
    pad = model.config.media_placeholder_token_id
    counts = [sum(t == pad for t in q) for q in prompts]
    if sum(counts) != feats.shape[0]:
        raise ValueError(f"the prompts have {sum(counts)} <|media_pad|> positions but the images give "
                         f"{feats.shape[0]} tokens")
    return [part if len(part) else None for part in feats.split(counts)]


def generate(model: nn.Module, prompts: Sequence[Sequence[int]],
             params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             tokenizer: Tokenizer | None = None, eos_token_ids: Sequence[int] = (),
             max_context: int | None = None, cuda_graph: bool = False, pixel_values: Tensor | None = None,
             grid_thws: Tensor | None = None, speculative: SpeculativeConfig | None = None) -> list[Completion]:
    """`stream` run to the end: one Completion (ids, text, finish reason) per prompt (params None: the
    SamplingParams defaults)."""
    params = SamplingParams() if params is None else params
    out = [Completion(prompt_tokens=len(p)) for p in prompts]
    for events in stream(model, prompts, params, tokenizer=tokenizer, eos_token_ids=eos_token_ids,
                         max_context=max_context, cuda_graph=cuda_graph, pixel_values=pixel_values,
                         grid_thws=grid_thws, speculative=speculative):
        for e in events:
            c = out[e.index]
            c.token_ids.append(e.token_id)
            c.text += e.text
            c.finish_reason = e.finish_reason
    return out
