"""A test-only engine with the engine contract's surface that emits scripted ids (never a product path).

It lets the HTTP tests choose the exact output ids (the K3 shapes of the parser tests, tool calls, stop strings)
and watch aborts, without a model. Outputs: `script(prompt_ids, index)` gives each sequence's ids (EOS included
when it should stop on its own); `tokens_per_step` ids per step; fake log-probabilities that are a function of
(position, token) so tests can check where they land.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from kimik3.inference.engine import RequestOutput, SequenceOutput, TokenLogprob


def continuing(ids: list[int]) -> Callable[[list[int], int], list[int]]:
    """A script whose output is `ids`, less the part of them the prompt already ends with (the opening a forced
    tool call's grammar writes into the prompt)."""
    def script(prompt: list[int], index: int) -> list[int]:
        j = next((j for j in range(min(len(ids), len(prompt)), 0, -1) if prompt[-j:] == ids[:j]), 0)
        return ids[j:]
    return script


def fake_logprob(position: int, token: int, k: int) -> TokenLogprob:
    lp = -0.25 - 0.01 * (position % 7)
    return TokenLogprob(token, lp, [(token, lp)] + [((token + j) % 100, lp - j) for j in range(1, k)][:max(k - 1, 0)])


class ScriptedEngine:
    def __init__(self, script: Callable[[list[int], int], list[int]], *, eos_id: int, max_model_len: int = 512,
                 tokens_per_step: int = 1, step_s: float = 0.0):
        self.script, self.eos_id, self.max_model_len = script, eos_id, max_model_len
        self.tokens_per_step, self.step_s = tokens_per_step, step_s
        self.active: dict[str, dict] = {}
        self.seen_prompts: set[tuple[int, ...]] = set()
        self.aborted: list[str] = []
        self.stopped: list[str] = []
        self.added: list = []
        self.reset_calls = 0
        self.steps = 0
        self.thread_ids: set[int] = set()
        self._stats = {"prompt_tokens_total": 0, "generation_tokens_total": 0, "aborts": 0,
                       "prefix_queries_tokens": 0, "prefix_hit_tokens": 0}

    def add_request(self, request) -> None:
        self.thread_ids.add(threading.get_ident())
        if len(request.prompt_ids) + request.params.max_new_tokens > self.max_model_len:
            raise ValueError(f"request {request.request_id} can never fit in {self.max_model_len} tokens")
        key = tuple(request.prompt_ids)
        cached = len(key) - 1 if key in self.seen_prompts else 0
        self.seen_prompts.add(key)
        n = request.params.n
        constraints = [request.constraint if i == 0 and request.constraint is not None
                       else (request.constraint_factory() if request.constraint_factory else None) for i in range(n)]
        self.active[request.request_id] = {
            "req": request, "cached": cached, "arrival": time.monotonic(),
            "seqs": [{"ids": list(self.script(request.prompt_ids, i)), "out": [], "lps": [], "new": [],
                      "finish": None, "c": constraints[i]} for i in range(n)]}
        self.added.append(request)
        self._stats["prompt_tokens_total"] += len(key)
        self._stats["prefix_queries_tokens"] += len(key)
        self._stats["prefix_hit_tokens"] += cached

    def abort(self, request_id: str) -> None:
        self.thread_ids.add(threading.get_ident())
        if self.active.pop(request_id, None) is not None:
            self.aborted.append(request_id)
            self._stats["aborts"] += 1

    def stop(self, request_id: str, stop_reason=None) -> None:
        """The engine contract's normal end: the next step returns the request finished with reason "stop"."""
        self.thread_ids.add(threading.get_ident())
        st = self.active.get(request_id)
        if st is not None:
            self.stopped.append(request_id)
            for seq in st["seqs"]:
                if seq["finish"] is None:
                    seq["finish"], seq["reason"] = "stop", stop_reason

    def has_unfinished(self) -> bool:
        return bool(self.active)

    def reset_prefix_cache(self) -> None:
        self.reset_calls += 1
        self.seen_prompts.clear()

    @property
    def stats(self) -> dict:
        return {**self._stats, "running": len(self.active), "waiting": 0, "cache_usage": 0.0}

    def _next(self, seq, params) -> int:
        pos = len(seq["out"])
        token = seq["ids"][pos] if pos < len(seq["ids"]) else self.eos_id
        c = seq["c"]
        if c is not None:
            mask = c.allowed()
            if mask is not None and not mask[token]:
                token = int(mask.nonzero()[0])  # the scripted id is not allowed: take the first that is
        return token

    def step(self, on_launch=None) -> list[RequestOutput]:
        self.thread_ids.add(threading.get_ident())
        if on_launch is not None:  # no device: its work is "queued" at once
            on_launch()
        if self.step_s:
            time.sleep(self.step_s)
        self.steps += 1
        outputs = []
        for rid, st in list(self.active.items()):
            req, params = st["req"], st["req"].params
            for seq in st["seqs"]:
                seq["new"] = []
                for _ in range(self.tokens_per_step):
                    if seq["finish"] is not None:
                        break
                    token = self._next(seq, params)
                    if params.logprobs is not None:
                        seq["lps"].append(fake_logprob(len(seq["out"]), token, params.logprobs))
                    seq["out"].append(token)
                    seq["new"].append(token)
                    self._stats["generation_tokens_total"] += 1
                    if seq["c"] is not None:
                        seq["c"].accept(token)
                    if (token == self.eos_id and not params.ignore_eos) or (
                            seq["c"] is not None and seq["c"].is_finished()):
                        seq["finish"] = "stop"
                    elif len(seq["out"]) >= params.max_new_tokens:
                        seq["finish"] = "length"
            finished = all(s["finish"] is not None for s in st["seqs"])
            prompt_lps = None
            if params.prompt_logprobs is not None:
                prompt_lps = [None] + [fake_logprob(p, t, params.prompt_logprobs)
                                       for p, t in enumerate(req.prompt_ids[1:])]
            outputs.append(RequestOutput(
                rid, list(req.prompt_ids),
                [SequenceOutput(i, list(s["new"]), list(s["lps"][len(s["out"]) - len(s["new"]):])
                                if params.logprobs is not None else None, "", s["finish"],
                                s.get("reason", self.eos_id if s["finish"] == "stop" else None))
                 for i, s in enumerate(st["seqs"])],
                finished, st["cached"], prompt_lps, {"queue_time": 0.0, "arrival": st["arrival"]}))
            if finished:
                del self.active[rid]
        return outputs
