"""Per-request sampling parameters and the batched draw the engine's sampler (engine/sampler.py) runs.

Legend: B sequences, V vocabulary.

Every request carries its own parameters; per row: repetition penalty (over the tokens seen so far),
temperature (0 = greedy), top-k, top-p, min-p, then the exponential race argmax(p / E), E ~ Exp(1), from the
row's own generator, with no host synchronisation.

Batch independence, precisely: given the same logits, a seeded row draws the same tokens whatever else shares
its batch (exact, any dtype: its generator and filters are its own). The logits themselves depend on the batch
at rounding level (the batch shape changes GEMM blocking), and a rounding difference can flip an MoE routing
choice. In fp32 on the CPU a row's logits stay within a few 1e-6 (relative) of its solo run and seeded samples
agree in practice (tested); in bf16 they do not: a seeded row can part from its solo run within a few tokens.
Run a request alone, or in fp32, to reproduce it.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from kimik3.checkpoint.source import read_generation_config


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request.

    Attributes:
        temperature: 0 for greedy; otherwise logits are divided by it. Default 1.0.
        top_k: keep the k most likely tokens (0 = all).
        top_p: keep the smallest set of tokens whose probability reaches p (1.0 = all).
        min_p: drop tokens less likely than min_p times the most likely one (0 = off).
        repetition_penalty: > 1 discourages tokens already in the prompt or output (1.0 = off).
        seed: makes the request's samples reproducible (None = drawn from torch's global generator).
        max_new_tokens: stop after this many generated tokens.
        stop_token_ids: stop when one of these is generated (it is kept in the output ids).
        stop: stop when the generated text contains one of these strings (the text is cut before it).
        n: choices per request (the serving engine prefills the prompt once and forks its state).
        logprobs: None = off; 0 = the sampled token's log-probability; k = also the k most likely tokens'.
        prompt_logprobs: the same for every prompt token (the engine then computes the whole prompt).
        presence_penalty: subtracted once from the logit of every token already generated (OpenAI's).
        frequency_penalty: subtracted from a token's logit once per time it was generated.
        logit_bias: (token id, bias) pairs added to the logits before sampling.
        ignore_eos: keep generating past the model's end-of-turn ids (stop_token_ids still stop).
        detokenize: the engine makes the output's text (an engine given a tokenizer): what stop strings are matched
            over. False for a caller that makes the text itself (the server: each id is decoded once, there).
        skip_special_tokens: that text leaves out special ids (markers such as <|end_of_msg|>); by default they are
            written literally.
    Log-probabilities are those of the model's raw distribution (before penalties, temperature and
    truncation). The engine honours every field (`generate()` runs on it; its results carry one choice).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    ignore_eos: bool = False
    detokenize: bool = True
    skip_special_tokens: bool = False

    def __post_init__(self) -> None:
        # finite real numbers first: inf and nan pass comparisons like `>= 0` (or fail them with a misleading
        # message), and a string would raise TypeError from the comparison below
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not math.isfinite(v):
                raise ValueError(f"sampling parameter {name} must be a finite number, got {v!r}")
        checks = (
            ("temperature", self.temperature >= 0, "must be >= 0 (0 = greedy)"),
            ("top_k", _is_int(self.top_k) and self.top_k >= 0, "must be an integer >= 0"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("repetition_penalty", self.repetition_penalty > 0, "must be > 0"),
            ("max_new_tokens", _is_int(self.max_new_tokens) and self.max_new_tokens >= 1,
             "must be an integer >= 1"),
            ("seed", self.seed is None or (_is_int(self.seed) and -2**63 <= self.seed < 2**64),
             "must be None or an integer in [-2**63, 2**64) (what torch.Generator takes)"),
            ("stop_token_ids", _all(self.stop_token_ids, lambda t: _is_int(t) and t >= 0),
             "must be a list of integer token ids >= 0"),
            ("stop", _all(self.stop, lambda s: isinstance(s, str) and s != ""), "must be a list of non-empty strings"),
            ("n", _is_int(self.n) and self.n >= 1, "must be an integer >= 1"),
            ("logprobs", self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20),
             "must be None or an integer in [0, 20]"),
            ("prompt_logprobs", self.prompt_logprobs is None or (_is_int(self.prompt_logprobs)
                                                                 and 0 <= self.prompt_logprobs <= 20),
             "must be None or an integer in [0, 20]"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "must be in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"),
            ("logit_bias", _all(tuple(self.logit_bias.items()) if isinstance(self.logit_bias, dict) else
                                self.logit_bias, lambda kv: len(kv) == 2 and _is_int(kv[0]) and kv[0] >= 0
                                and _is_real(kv[1]) and math.isfinite(kv[1])),
             "must be (token id >= 0, finite bias) pairs"),
            ("ignore_eos", isinstance(self.ignore_eos, bool), "must be True or False"),
            ("detokenize", isinstance(self.detokenize, bool) and (self.detokenize or not self.stop),
             "must be True or False, and True with stop strings (they are matched over the engine's text)"),
            ("skip_special_tokens", isinstance(self.skip_special_tokens, bool), "must be True or False"),
        )
        for name, ok, msg in checks:
            if not ok:
                raise ValueError(f"sampling parameter {name} {msg}, got {getattr(self, name)!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias))


# what a checkpoint's generation_config.json may set (Hugging Face's keys that are SamplingParams fields too)
GENERATION_KEYS = ("max_new_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty")


def generation_defaults(path: str | Path) -> SamplingParams:
    """The sampling defaults a checkpoint ships: its generation_config.json's (a GGUF's: its saved generation
    config, else llama.cpp's general.sampling.* keys) GENERATION_KEYS over SamplingParams' own (none: those alone).
    Read once per command; a request's or a flag's value replaces a field. A bad file is a ValueError naming it."""
    file, gen = read_generation_config(path)
    try:
        return SamplingParams(**{k: gen[k] for k in GENERATION_KEYS if k in gen})
    except ValueError as e:
        raise ValueError(f"{file}: {e}") from None


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _all(v, ok) -> bool:
    """v is a list/tuple/set (not a lone string or number) and every item passes `ok`."""
    return isinstance(v, (list, tuple, set, frozenset)) and all(ok(x) for x in v)


def repetition_penalty(x_BV: Tensor, seen_BV: Tensor, penalty_B: Tensor) -> Tensor:
    """Divide positive (multiply negative) logits of tokens in each row's context by its penalty."""
    pen = penalty_B[:, None]
    return torch.where(seen_BV, torch.where(x_BV > 0, x_BV / pen, x_BV * pen), x_BV)


def truncated_probs(x_BV: Tensor, temperature_B: Tensor, top_k_B: Tensor, top_p_B: Tensor, min_p_B: Tensor
                    ) -> tuple[Tensor, Tensor]:
    """Processed fp32 logits -> (probabilities [B, V] in descending order, their token ids [B, V]) after
    temperature, top-k, top-p and min-p: the distribution `draw` samples (the speculative acceptance rule's p).
    Rows with temperature 0 are treated as temperature 1e-6 here; `draw` takes their argmax instead."""
    x = x_BV / temperature_B.clamp(min=1e-6)[:, None]
    sorted_BV, order_BV = x.sort(-1, descending=True)
    probs = sorted_BV.softmax(-1)
    ranks = torch.arange(x.shape[-1], device=x.device)
    drop = ranks[None, :] >= top_k_B[:, None]
    drop |= (probs.cumsum(-1) - probs) >= top_p_B[:, None]  # the most likely token always stays
    drop |= probs < min_p_B[:, None] * probs[:, :1]
    return sorted_BV.masked_fill(drop, float("-inf")).softmax(-1), order_BV


def draw(x_BV: Tensor, temperature_B: Tensor, top_k_B: Tensor, top_p_B: Tensor, min_p_B: Tensor,
         generators: list[torch.Generator]) -> Tensor:
    """Processed fp32 logits -> [B] token ids: greedy where temperature is 0, else temperature, top-k, top-p,
    min-p and the exponential race with each row's own generator (one draw per row per call)."""
    greedy_B = x_BV.argmax(-1)
    probs, order_BV = truncated_probs(x_BV, temperature_B, top_k_B, top_p_B, min_p_B)
    V = x_BV.shape[-1]
    noise = torch.stack([torch.empty(V, device=x_BV.device).exponential_(generator=g) for g in generators])
    choice_B = (probs / noise).argmax(-1)
    sampled_B = order_BV.gather(1, choice_B[:, None]).squeeze(1)
    return torch.where(temperature_B == 0, greedy_B, sampled_B)
