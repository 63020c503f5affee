"""What goes into the engine and what comes out of it (the engine/server contract), and the per-sequence
bookkeeping the scheduler keeps between steps."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

import torch

from kimik3.inference.sampling import SamplingParams
from kimik3.tokenizer.stops import StopDecoder


class TokenConstraint(Protocol):
    """Structured output: which tokens may come next (applied as a -inf mask before sampling)."""

    def allowed(self) -> torch.Tensor | None: ...  # bool [V] of tokens allowed next (None = no constraint now)

    def accept(self, token_id: int) -> None: ...  # advance the constraint by the sampled token

    def is_finished(self) -> bool: ...  # grammar complete: the engine stops with finish_reason "stop"

    # optional: `rollback(n)` undoes the last n accepted tokens. A constraint that has it speculates (each draft
    # token is checked against the grammar advanced by the drafts before it, which is then rolled back); one
    # without it decodes a token per step under speculative decoding.


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    mm_hashes: tuple[str, ...] = ()  # content hashes of media pads (chained into prefix keys)
    constraint: TokenConstraint | None = None
    # for n > 1 the engine forks the request into n sequences; each gets constraint_factory() if given
    constraint_factory: Callable[[], TokenConstraint] | None = None
    mm_embeds: torch.Tensor | None = None  # [pads, D] what each <|media_pad|> of the prompt embeds to, in order
    adapter: str | None = None  # a LoRA adapter the engine serves (Engine(adapters=...)), None for the base


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # top-k (id, logprob)


@dataclass
class SequenceOutput:
    """What one step added to a choice (vLLM's DELTA outputs); `Engine.generate` returns them accumulated."""

    index: int
    token_ids: list[int]  # ids generated in this step (all of them, in an accumulated output)
    logprobs: list[TokenLogprob] | None  # theirs, when requested
    text: str  # their visible text (the engine has a tokenizer; stop strings cut it), else ""
    finish_reason: str | None  # None while running; "stop" | "length" | "abort"
    stop_reason: int | str | None

    def extend(self, delta: SequenceOutput) -> None:
        self.token_ids += delta.token_ids
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs
        self.text += delta.text
        self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


@dataclass
class RequestOutput:
    request_id: str
    prompt_ids: list[int]
    outputs: list[SequenceOutput]
    finished: bool
    cached_tokens: int  # prompt tokens not recomputed (prefix-cache hit)
    prompt_logprobs: list[TokenLogprob | None] | None  # first entry None
    metrics: dict  # arrival, first_token, finished (time.monotonic()), queue_time


def accumulate(acc: dict[str, RequestOutput], outs: list[RequestOutput]) -> None:
    """Fold one step's outputs (deltas) into whole ones in `acc`, by request id: every id, logprob and text so far,
    and the latest finish state and metrics."""
    for out in outs:
        a = acc.get(out.request_id)
        if a is None:
            a = acc[out.request_id] = dataclasses.replace(out, outputs=[])
        have = {o.index: o for o in a.outputs}
        for o in out.outputs:
            if o.index in have:
                have[o.index].extend(o)
            else:
                a.outputs.append(dataclasses.replace(o, token_ids=list(o.token_ids),
                                                     logprobs=None if o.logprobs is None else list(o.logprobs)))
        a.outputs.sort(key=lambda o: o.index)
        a.finished, a.cached_tokens, a.prompt_logprobs, a.metrics = (out.finished, out.cached_tokens,
                                                                     out.prompt_logprobs, out.metrics)


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class TokenCounts:
    """What the sampler's penalties need of one sequence's tokens, kept on the logits' device and brought up to
    date with only the tokens added since the last step (recounting them all made a step's cost grow with the
    sequence). Legend: V vocabulary."""

    seen_V: torch.Tensor  # bool: in the prompt or the output (repetition penalty)
    output_V: torch.Tensor  # fp32: times generated (presence and frequency penalties)
    upto: int = 0  # tokens[:upto] are counted


@dataclass(eq=False)
class Sequence:
    """One choice of a request: its tokens (prompt + output), how many of them the pools hold, where.

    The state in its KDA slot and MLA blocks always covers exactly tokens[:num_computed]; a step computes
    tokens[num_computed:num_computed + n], and once num_computed == len(tokens) the step's logits give the
    next token. With speculative decoding a step's row is `row_tokens` (the pending tokens, then the draft)."""

    group: RequestState
    index: int
    tokens: list[int]
    constraint: TokenConstraint | None = None
    generator: torch.Generator | None = None
    num_computed: int = 0
    slot: int | None = None
    blocks: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    reported: int = 0  # output tokens already returned by step()
    counts: TokenCounts | None = None  # made by the sampler on the first step with a penalty
    text: StopDecoder | None = None  # visible text and stop strings (the engine has a tokenizer)
    new_text: str = ""  # visible text since the last output
    # speculative decoding: this step's proposal (kimik3.inference.spec.Draft), computed after tokens[-1]
    draft: object = None

    @property
    def draft_tokens(self) -> tuple[int, ...]:
        return self.draft.tokens if self.draft is not None else ()

    @property
    def num_pending(self) -> int:
        """Tokens a step has left to compute: the uncomputed committed ones and the draft."""
        return len(self.tokens) - self.num_computed + len(self.draft_tokens)

    def row_tokens(self, n: int) -> list[int]:
        """The ids of the next n positions to compute (committed tokens, then draft tokens)."""
        rest = self.tokens[self.num_computed: self.num_computed + n]
        return rest + list(self.draft_tokens[: n - len(rest)])

    @property
    def num_prompt(self) -> int:
        return len(self.group.request.prompt_ids)

    def take_output(self) -> tuple[list[int], list[TokenLogprob] | None, str]:
        """The ids, logprobs and text added since the last call (O(new), not O(length))."""
        start = self.num_prompt + self.reported
        ids = self.tokens[start:]
        lps = self.logprobs[self.reported:] if self.logprobs is not None else None
        text, self.new_text = self.new_text, ""
        self.reported += len(ids)
        return ids, lps, text

    @property
    def params(self) -> SamplingParams:
        return self.group.request.params

    def media(self, n: int) -> tuple[list[int], torch.Tensor] | None:
        """The image tokens the next n positions embed: (their rows from num_computed, their [m, D] embeddings),
        or None."""
        group = self.group
        lo, hi = self.num_computed, self.num_computed + n
        picks = [(p - lo, j) for j, p in enumerate(group.media) if lo <= p < hi]
        if not picks:
            return None
        return [r for r, _ in picks], group.request.mm_embeds[[j for _, j in picks]]


@dataclass(eq=False)
class RequestState:
    request: Request
    root_key: bytes
    arrival: float = field(default_factory=time.monotonic)
    seqs: list[Sequence] = field(default_factory=list)
    forked: bool = False  # n > 1: the other n-1 sequences exist (made when the prompt's prefill ends)
    reserved: list[int] = field(default_factory=list)  # n > 1: their KDA slots, taken at admission
    cached_tokens: int = 0
    media: list[int] = field(default_factory=list)  # prompt positions of the <|media_pad|> ids (mm_embeds rows)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_end_row: torch.Tensor | None = None  # [V] log-softmax at the prompt's last position (its end snapshot's)
    first_scheduled: float | None = None
    first_token: float | None = None
    finished_at: float | None = None

    @property
    def finished(self) -> bool:
        return len(self.seqs) == (self.request.params.n if self.forked else 1) and all(
            s.status is Status.FINISHED for s in self.seqs)

    def output(self) -> RequestOutput:
        """Each choice's new tokens since the last output (a delta), and whether the request has ended."""
        outs = []
        for seq in self.seqs:
            ids, lps, text = seq.take_output()
            outs.append(SequenceOutput(seq.index, ids, lps, text, seq.finish_reason, seq.stop_reason))
        # an aborted n > 1 request may end before its fork: with the one sequence it has
        finished = self.finished or any(s.finish_reason == "abort" for s in self.seqs)
        if finished:
            self.finished_at = time.monotonic()
        metrics = dict(arrival=self.arrival, first_token=self.first_token, finished=self.finished_at,
                       queue_time=(self.first_scheduled or self.arrival) - self.arrival)
        # the request's own prompt list, not a copy per step (the engine never modifies it)
        return RequestOutput(self.request.request_id, self.request.prompt_ids, outs, finished, self.cached_tokens,
                             self.prompt_logprobs, metrics)


def check_request(request: Request, vocab_size: int, max_model_len: int, pool_tokens: int, max_num_seqs: int
                  ) -> list[int]:
    """The request's prompt ids, or a ValueError naming the request and what it asks for that the engine cannot
    give: an empty prompt or ids outside the vocabulary, a prompt that fills max_model_len, more tokens than the
    MLA pool holds (`pool_tokens`), more choices than sequences run at once."""
    p, ids, rid = request.params, list(request.prompt_ids), request.request_id
    if not ids:
        raise ValueError(f"request {rid!r}: the prompt is empty")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"request {rid!r}: prompt ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    if len(ids) >= max_model_len:
        raise ValueError(f"request {rid!r}: a prompt of {len(ids)} tokens leaves no room for output within "
                         f"max_model_len {max_model_len}")
    if min(len(ids) + p.max_new_tokens, max_model_len) > pool_tokens:
        raise ValueError(f"request {rid!r}: {len(ids)} prompt + {p.max_new_tokens} new tokens can never fit the MLA "
                         f"pool of {pool_tokens} tokens (num_blocks)")
    if p.n > max_num_seqs:
        raise ValueError(f"request {rid!r}: n = {p.n} exceeds max_num_seqs {max_num_seqs}")
    return ids
