"""lm-eval 0.4.13 in process: `KimiK3LM` (lm-eval model `kimik3`) scores and generates through kimik3's serving
engine, and `evaluate` runs tasks with it (`kimik3 eval`). Needs the `eval` extra.

Tokenization is lm-eval's own (TemplateLM: the trailing-space move of `_encode_pair`, the [BOS] prefix of an
empty context, rolling windows over max_length), so scores line up with lm-eval's `hf` backend over the
registered transformers classes. A loglikelihood is the sum over the continuation's tokens of the engine's prompt
logprobs (log_softmax of the logits before each token); greedy is whether each token was its position's top-1.

Shared prefixes are computed once: the (context + continuation) id sequences are deduplicated, a sequence that
is a prefix of another (a shorter continuation, a repeated context) reads its logprobs off the longer one's, and
a context that starts two or more of them runs first, alone: its end snapshot keeps its prompt logprobs in the
engine's prefix cache, and each continuation after it restores that and computes only its own tokens.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections import deque
from collections.abc import Sequence
from pathlib import Path

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from kimik3.checkpoint.source import read_config
from kimik3.inference import SamplingParams, load_engine
from kimik3.inference.engine import Engine, EngineConfig, Request
from kimik3.inference.engine.request import accumulate
from kimik3.inference.load import end_ids
from kimik3.tokenizer import Tokenizer


@register_model("kimik3")
class KimiK3LM(TemplateLM):
    """A kimik3 model for lm-eval.

    Args:
        pretrained: a checkpoint folder, .gguf file or hub id (loaded by `kimik3.inference.load_engine`), or pass
            `model` and `tokenizer`.
        dtype: compute dtype (default float32 on the CPU, the checkpoint's on CUDA).
        device: cpu or cuda (default cuda when available).
        batch_size: sequences the engine runs at once (its max_num_seqs).
        max_length: tokens one scored sequence may hold (default: the model's max_position_embeddings, as
            lm-eval's hf backend reads it); longer inputs are cut on the left, as lm-eval does.
        max_gen_toks: generation budget when a task gives none.
        config: the engine's knobs (`kimik3 eval`'s engine flags); its max_num_seqs is the batch size and its
            max_model_len, when set, max_length + 2 (a scored sequence's ids and the token sampled after them).
    """

    def __init__(self, pretrained: str | None = None, *, model=None, tokenizer: Tokenizer | None = None,
                 dtype: str | torch.dtype | None = None, device: str | None = None, batch_size: int | str = 8,
                 max_length: int | None = None, max_gen_toks: int = 256, revision: str | None = None,
                 config: EngineConfig | None = None):
        super().__init__()
        if (pretrained is None) == (model is None):
            raise ValueError("KimiK3LM: pass pretrained=PATH (or a hub id), or model= and tokenizer=")
        if model is not None and tokenizer is None:
            raise ValueError("KimiK3LM: model= needs tokenizer= (a kimik3.tokenizer.Tokenizer)")
        if config is None:
            config = EngineConfig(max_num_seqs=int(batch_size) if str(batch_size) != "auto" else 8)
        path = None
        if model is None:
            from kimik3.checkpoint.hub import resolve

            path = resolve(pretrained, revision)
            positions = read_config(path).text.max_position_embeddings
        else:
            positions = (model.config.text if hasattr(model.config, "text") else model.config).max_position_embeddings
        limit = max_length or (config.max_model_len - 2 if config.max_model_len else positions)
        self.max_length = int(limit)
        self.max_gen_toks = int(max_gen_toks)
        self.batch_size = config.max_num_seqs
        # one sequence holds at most max_length + 1 scored ids, or a context plus its generation budget
        config = dataclasses.replace(config, max_model_len=self.max_length + 2)
        if model is None:
            device = device or ("cuda" if torch.cuda.is_available() else "cpu")
            self.engine = load_engine(path, config, device=device,
                                      dtype=dtype or (torch.float32 if device == "cpu" else None))
        else:
            self.engine = Engine(model, config, eos_token_ids=end_ids(model, tokenizer), tokenizer=tokenizer)
        self.tok = self.engine.tokenizer
        self.scored_tokens = 0  # prompt tokens the engine computed for loglikelihoods (less prefix-cache hits)

    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.tok.bos_id  # what lm-eval's hf backend prefixes an empty context with (the tokenizer's BOS)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tok.encode(string, allow_special=True)  # as AutoTokenizer's encode reads special names

    def tok_decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids))

    def _run(self, requests: list[Request], after: dict[str, str] | None = None) -> dict[str, object]:
        """Run engine requests to the end; request id -> its whole output (the steps' deltas accumulated). A
        request in `after` (its id -> a leader's id) is added once its leader has finished, ahead of the rest,
        while the leader's end snapshot is fresh in the prefix cache."""
        after = after or {}
        followers: dict[str, list[Request]] = {}
        for r in requests:
            if r.request_id in after:
                followers.setdefault(after[r.request_id], []).append(r)
        ready = deque(r for r in requests if r.request_id not in after)
        done: dict = {}
        while ready or self.engine.has_unfinished():
            while ready and len(self.engine.requests) < self.batch_size:
                self.engine.add_request(ready.popleft())
            outs = self.engine.step()
            accumulate(done, outs)
            for out in outs:
                if out.finished:
                    ready.extendleft(reversed(followers.pop(out.request_id, [])))
        return done

    def token_logprobs(self, sequences: list[list[int]], contexts: list[int] | None = None,
                       ) -> dict[tuple[int, ...], list[tuple[float, bool]]]:
        """(logprob, is top-1) of every token after the first, per distinct sequence, prefixes sharing a score.
        `contexts[i]`: how many leading ids of sequences[i] are its context; a context that two or more
        sequences start with is computed once, before them (module docstring)."""
        unique = sorted(set(map(tuple, sequences)))
        owner: dict[tuple[int, ...], tuple[int, ...]] = {}
        for i in range(len(unique) - 1, -1, -1):  # a prefix sorts right before the sequences that extend it
            s = unique[i]
            nxt = unique[i + 1] if i + 1 < len(unique) else None
            owner[s] = owner[nxt] if nxt is not None and nxt[:len(s)] == s else s
        roots = sorted(set(owner.values()), key=len, reverse=True)
        split = {tuple(s): n for s, n in zip(sequences, contexts or [0] * len(sequences))}
        uses: dict[tuple[int, ...], int] = {}
        for r in roots:
            c = r[:split[r]]
            uses[c] = uses.get(c, 0) + 1
        shared = [c for c, n in uses.items() if n > 1 and 0 < len(c)]
        params = SamplingParams(max_new_tokens=1, temperature=0, prompt_logprobs=1, ignore_eos=True)
        leader = {c: f"ctx-{j}" for j, c in enumerate(shared)}
        requests = [Request(leader[c], list(c), params) for c in shared]
        requests += [Request(f"ll-{k}", list(r), params) for k, r in enumerate(roots)]
        after = {f"ll-{k}": leader[r[:split[r]]] for k, r in enumerate(roots) if r[:split[r]] in leader}
        outs = self._run(requests, after)
        self.scored_tokens += sum(len(o.prompt_ids) - o.cached_tokens for o in outs.values())
        scored = {}
        for k, r in enumerate(roots):
            entries = outs[f"ll-{k}"].prompt_logprobs[1:]
            scored[r] = [(e.logprob, e.top[0][0] == e.token_id) for e in entries]
        return {s: scored[owner[s]][:len(s) - 1] for s in unique}

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        seqs, spans = [], []
        for _, context_enc, continuation_enc in requests:
            whole = (context_enc + continuation_enc)[-(self.max_length + 1):]  # lm-eval's left truncation
            seqs.append(whole)
            spans.append(len(continuation_enc))
        table = self.token_logprobs(seqs, [max(len(w) - n, 0) for w, n in zip(seqs, spans)])
        results = []
        for whole, n in zip(seqs, spans):
            rows = table[tuple(whole)][len(whole) - 1 - n:]
            results.append((float(sum(lp for lp, _ in rows)), all(g for _, g in rows)))
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for k, (string,) in enumerate(req.args for req in requests):
            for context, cont in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append(((None, None), context, cont))
                owners.append(k)
        totals = [0.0] * len(requests)
        for k, (ll, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[k] += ll
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        engine_requests, stops = [], []
        for k, (context, gen_kwargs) in enumerate(req.args for req in requests):
            kw = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            until = handle_stop_sequences(kw.pop("until", None), eos=self.tok.decode([self.eot_token_id]))
            budget = kw.pop("max_gen_toks")
            if budget >= self.max_length:
                raise ValueError(f"max_gen_toks {budget} must be below the model's max_length {self.max_length}")
            ids = self.tok_encode(context)[-(self.max_length - budget):]
            temperature = float(kw.get("temperature", 0.0)) if kw.get("do_sample") else 0.0
            params = SamplingParams(max_new_tokens=budget, temperature=temperature, stop=tuple(until),
                                    seed=kw.get("seed"))
            engine_requests.append(Request(f"gen-{k}", ids, params))
            stops.append(until)
        outs = self._run(engine_requests)
        texts = []
        for k, until in enumerate(stops):
            text = self.tok_decode(outs[f"gen-{k}"].outputs[0].token_ids)
            for s in until:  # the text before the first stop sequence, as lm-eval's hf backend returns it
                text = text.split(s)[0]
            texts.append(text)
        return texts


# the example tasks shipped in the package (k3_mc, k3_ppl, k3_gen), always on the task path
EXAMPLE_TASKS = Path(__file__).resolve().parent / "tasks"


def evaluate(model: str, tasks: Sequence[str], *, include_path: str | None = None, limit: float | None = None,
             num_fewshot: int | None = None, batch_size: int = 8, device: str | None = None, dtype: str | None = None,
             revision: str | None = None, output_path: str | Path | None = None, log_samples: bool = False,
             config: EngineConfig | None = None) -> dict:
    """Run lm-eval `tasks` (names, globs or YAML files; lm-eval's, the EXAMPLE_TASKS, or those of the folder
    `include_path`) on a kimik3 model in process; returns lm-eval's results dict (written as JSON to `output_path`
    when given). An unknown task is a ValueError before the model loads."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    if include_path is not None and not Path(include_path).is_dir():
        raise FileNotFoundError(f"include_path {include_path}: no such folder (a folder of task YAML files)")
    manager = TaskManager(include_path=[str(EXAMPLE_TASKS)] + ([str(include_path)] if include_path else []))
    check_tasks(manager, tasks)
    lm = KimiK3LM(model, dtype=dtype, device=device, batch_size=batch_size, revision=revision, config=config)
    # lm-eval warns about --metadata for every task with a custom_dataset, which the examples use to find their data
    quiet = logging.getLogger("lm_eval.api.task")
    drop = _DropMessage("Custom kwargs can be passed to `--metadata`")
    quiet.addFilter(drop)
    try:
        results = simple_evaluate(model=lm, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit,
                                  task_manager=manager, log_samples=log_samples)
    finally:
        quiet.removeFilter(drop)
    if results is None:
        raise ValueError(f"lm-eval returned no results for tasks {list(tasks)}")
    if output_path is not None:
        Path(output_path).write_text(json.dumps(results, indent=2, default=str))
    return results


class _DropMessage(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def check_tasks(manager, tasks: Sequence[str]) -> None:
    """Every name a registered task, group or tag, a glob matching one, or a YAML file; else one ValueError with
    the closest names (lm-eval's own error comes after the model load, as a KeyError traceback)."""
    import difflib

    unknown = [t for t in tasks if not (manager.match_tasks([t]) or Path(t).is_file())]
    if unknown:
        near = {t: difflib.get_close_matches(t, manager.all_tasks, 3) for t in unknown}
        hints = [f"'{t}' (did you mean {', '.join(near[t])}?)" if near[t] else f"'{t}'" for t in unknown]
        raise ValueError(f"unknown lm-eval task {', '.join(hints)}: name a task, group or tag lm-eval lists "
                         f"(`lm-eval ls tasks`), one of the examples {', '.join(sorted(_examples()))}, or a YAML "
                         "file; --include-path adds a folder of your own")


def _examples() -> list[str]:
    return [p.stem for p in EXAMPLE_TASKS.glob("*.yaml")]
