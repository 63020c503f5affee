"""Per-request sampling parameters and a batched sampler with no host synchronisation.

Legend: B sequences, V vocabulary.

Every request carries its own parameters; the sampler holds them as [B] tensors and applies, per row:
repetition penalty (over the tokens seen so far), temperature (0 = greedy), top-k, top-p, min-p, then draws
with the exponential race argmax(p / E), E ~ Exp(1), from the row's own generator -- so a seeded request
samples the same tokens whatever else shares its batch, and nothing waits for the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


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

    def __post_init__(self) -> None:
        checks = (
            ("temperature", self.temperature >= 0, "must be >= 0"),
            ("top_k", isinstance(self.top_k, int) and self.top_k >= 0, "must be an integer >= 0"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("repetition_penalty", self.repetition_penalty > 0, "must be > 0"),
            ("max_new_tokens", isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1,
             "must be an integer >= 1"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must hold non-empty strings"),
        )
        for name, ok, msg in checks:
            if not ok:
                raise ValueError(f"sampling parameter {name} {msg}, got {getattr(self, name)!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))


class Sampler:
    """Samples one token per row from [B, V] logits; all state lives on the logits' device."""

    def __init__(self, params: list[SamplingParams], vocab_size: int, device: torch.device | str = "cpu"):
        B, V = len(params), vocab_size
        f = lambda xs: torch.tensor(xs, dtype=torch.float32, device=device)  # noqa: E731
        self.vocab_size = V
        self.temperature = f([p.temperature for p in params])
        self.top_k = torch.tensor([p.top_k or V for p in params], device=device)
        self.top_p = f([p.top_p for p in params])
        self.min_p = f([p.min_p for p in params])
        self.penalty = f([p.repetition_penalty for p in params])
        self.seen = torch.zeros(B, V, dtype=torch.bool, device=device)
        seeds = [p.seed if p.seed is not None else int(torch.randint(0, 2**62, ())) for p in params]
        self.generators = [torch.Generator(device=device).manual_seed(s) for s in seeds]

    def observe(self, ids_BT: Tensor, valid_BT: Tensor | None = None) -> None:
        """Record tokens now in each row's context (for the repetition penalty)."""
        if valid_BT is not None:
            ids_BT = torch.where(valid_BT.bool(), ids_BT, ids_BT[:, :1])
        self.seen.scatter_(1, ids_BT, True)

    def sample(self, logits_BV: Tensor) -> Tensor:
        """[B, V] logits -> [B] int64 token ids."""
        x = logits_BV.float()
        pen = self.penalty[:, None]
        x = torch.where(self.seen, torch.where(x > 0, x / pen, x * pen), x)
        greedy_B = x.argmax(-1)
        x = x / self.temperature.clamp(min=1e-6)[:, None]
        sorted_BV, order_BV = x.sort(-1, descending=True)
        probs = sorted_BV.softmax(-1)
        ranks = torch.arange(x.shape[-1], device=x.device)
        drop = ranks[None, :] >= self.top_k[:, None]
        drop |= (probs.cumsum(-1) - probs) >= self.top_p[:, None]  # the most likely token always stays
        drop |= probs < self.min_p[:, None] * probs[:, :1]
        probs = sorted_BV.masked_fill(drop, float("-inf")).softmax(-1)
        noise = torch.stack([torch.empty(x.shape[-1], device=x.device).exponential_(generator=g)
                             for g in self.generators])
        choice_B = (probs / noise).argmax(-1)
        sampled_B = order_BV.gather(1, choice_B[:, None]).squeeze(1)
        return torch.where(self.temperature == 0, greedy_B, sampled_B)
