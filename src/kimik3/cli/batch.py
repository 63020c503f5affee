"""`kimik3 generate --input FILE.jsonl --output FILE.jsonl`: an offline batch through the serving engine.

Each input line is one JSON object, one request:
    {"id": "q1", "prompt": "Once upon"}                              raw text, continued
    {"id": "q2", "messages": [{"role": "user", "content": "Hi"}]}    a chat (K3's chat format; "thinking": bool)
    {"prompt_ids": [8448, 17, 99]}                                   token ids as given
plus any SamplingParams field to override the command's flags for that line ("max_new_tokens", "temperature",
"n", "logprobs", "seed", "stop", ...; OpenAI's "max_tokens" and "max_completion_tokens" mean max_new_tokens, and
"stop" may be one string, as OpenAI's).
`--output -` writes the results to standard output.
Each output line (in input order) holds the id (default: the line number), prompt_tokens, cached_tokens and the
choices: index, text, token_ids, finish_reason (and logprobs when asked).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import sys
from pathlib import Path

from kimik3.cli.engine_args import add_engine_args

ALIASES = ("max_tokens", "max_completion_tokens")  # OpenAI's names for max_new_tokens


def add_args(parser, source_group) -> None:
    """The batch flags, added to `kimik3 generate` (--input joins its prompt-source group)."""
    source_group.add_argument("--input", metavar="FILE.jsonl",
                              help="batch mode: one request per line (see kimik3.cli.batch), through the engine")
    parser.add_argument("--output", metavar="FILE.jsonl",
                        help="batch mode: where the results go (one per line; - for standard output)")
    parser.add_argument("--overwrite", action="store_true", help="batch mode: replace an existing --output file")
    add_engine_args(parser, max_num_seqs="1 for --prompt, 64 for --input")


def read_requests(path: Path, base) -> list[tuple[str, dict, object, int]]:
    """(id, the line's request object, its SamplingParams, line number) per non-empty line; errors name the line."""
    from kimik3.inference import SamplingParams

    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    if not path.is_file():
        raise FileNotFoundError(f"--input {path}: no such file")
    out = []
    for no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"--input {path} line {no}: not JSON ({e.msg})") from None
        if not isinstance(obj, dict) or sum(k in obj for k in ("prompt", "messages", "prompt_ids")) != 1:
            raise ValueError(f"--input {path} line {no}: expected an object with exactly one of prompt, messages, "
                             "prompt_ids")
        aliases = [k for k in ALIASES if k in obj]
        if len(aliases) + ("max_new_tokens" in obj) > 1:
            raise ValueError(f"--input {path} line {no}: give one of max_new_tokens, {', '.join(ALIASES)}")
        for k in aliases:
            obj["max_new_tokens"] = obj.pop(k)
        if isinstance(obj.get("stop"), str):  # OpenAI's stop is a string or a list of them
            obj["stop"] = [obj["stop"]]
        known = fields | {"id", "prompt", "messages", "prompt_ids", "thinking"}
        unknown = sorted(set(obj) - known)
        if unknown:
            hints = [f"{k} (did you mean {m[0]}?)" if (m := difflib.get_close_matches(k, known, 1)) else k
                     for k in unknown]
            raise ValueError(f"--input {path} line {no}: unknown keys: {', '.join(hints)}")
        bad = _bad_prompt(obj)
        if bad:
            raise ValueError(f"--input {path} line {no}: {bad}")
        over = {k: tuple(v) if isinstance(v, list) else v for k, v in obj.items() if k in fields}
        try:
            params = dataclasses.replace(base, **over)
        except (ValueError, TypeError) as e:
            raise ValueError(f"--input {path} line {no}: {e}") from None
        out.append((str(obj.get("id", no)), obj, params, no))
    if not out:
        raise ValueError(f"--input {path}: no requests")
    return out


def _bad_prompt(obj: dict) -> str | None:
    """What is wrong with a line's prompt field (its type; ids and chat roles are checked once encoded)."""
    if "prompt" in obj and not (isinstance(obj["prompt"], str) and obj["prompt"]):
        return f"prompt must be a non-empty string, got {obj['prompt']!r}"
    ids = obj.get("prompt_ids", [0])
    if not (isinstance(ids, list) and ids and all(type(t) is int and t >= 0 for t in ids)):
        return f"prompt_ids must be a non-empty list of token ids (integers >= 0), got {ids!r}"[:200]
    if "messages" in obj and not (isinstance(obj["messages"], list) and obj["messages"]):
        return f"messages must be a non-empty list of message objects, got {obj['messages']!r}"[:200]
    return None


def encode_line(tok, obj: dict, vocab_size: int, where: str) -> list[int]:
    """The line's prompt ids; an error names the line (`where`)."""
    try:
        ids = encode(tok, obj)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise ValueError(f"{where}: {e}") from None
    outside = sorted({t for t in ids if t >= vocab_size})
    if outside:
        raise ValueError(f"{where}: prompt ids outside the model's vocabulary [0, {vocab_size}): {outside[:8]}")
    return ids


def encode(tok, obj: dict) -> list[int]:
    from kimik3.tokenizer import encode_chat

    if "prompt_ids" in obj:
        return [int(t) for t in obj["prompt_ids"]]
    if "messages" in obj:
        return encode_chat(tok, obj["messages"], thinking=bool(obj.get("thinking", True)))
    return tok.encode(obj["prompt"])


def run(args) -> int:
    from kimik3.cli.common import open_engine, sampling_params
    from kimik3.inference.engine import EngineConfig

    if not args.output:
        raise ValueError("--input needs --output FILE.jsonl")
    check_output(Path(args.input), args.output, args.overwrite)
    base = sampling_params(args)
    requests = read_requests(Path(args.input), base)
    engine, _ = open_engine(args, EngineConfig(), vision=False)
    tok = engine.tokenizer
    prompts = [encode_line(tok, obj, engine.vocab_size, f"--input {args.input} line {no}")
               for _, obj, _, no in requests]
    bar = _bar(len(prompts))
    try:
        outs = engine.generate(prompts, [p for _, _, p, _ in requests], progress=bar.update)
    finally:
        bar.close()
    lines = (json.dumps(result(rid, out, tok), ensure_ascii=False) + "\n"
             for (rid, _, _, _), out in zip(requests, outs))
    if args.output == "-":  # standard output, for a pipe (the summary goes to stderr)
        sys.stdout.writelines(lines)
        sys.stdout.flush()
    else:
        with open(args.output, "w", encoding="utf-8") as f:
            f.writelines(lines)
    s = engine.stats
    print(f"{len(outs)} requests, {s['prompt_tokens_total']} prompt tokens ({s['prefix_hit_tokens']} from the prefix "
          f"cache), {s['generation_tokens_total']} generated -> {args.output}", file=sys.stderr)
    return 0


def check_output(source: Path, output: str, overwrite: bool) -> None:
    """Never write the results onto the requests; replace another existing file only when asked."""
    from kimik3.cli.outputs import check_output as check_apart

    if output == "-":
        return
    check_apart(output, "--output", {"--input": source})
    out = Path(output)
    if out.exists() and not overwrite:
        raise FileExistsError(f"--output {output} exists; pass --overwrite to replace it")


def result(rid: str, out, tok) -> dict:
    choices = []
    for c in out.outputs:
        # the engine's visible text: stop strings cut, a stop id's marker never shown
        choice = {"index": c.index, "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
        if c.logprobs is not None:
            choice["logprobs"] = [{"token_id": lp.token_id, "logprob": lp.logprob, "top": lp.top} for lp in c.logprobs]
        choices.append(choice)
    return {"id": rid, "prompt_tokens": len(out.prompt_ids), "cached_tokens": out.cached_tokens, "choices": choices}


class _bar:
    """A rich progress bar on a terminal's stderr; a silent no-op otherwise."""

    def __init__(self, total: int):
        self.progress = None
        if sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(TextColumn("[bold]generate"), BarColumn(), MofNCompleteColumn(),
                                     TimeRemainingColumn(), console=Console(stderr=True))
            self.task = self.progress.add_task("generate", total=total)
            self.progress.start()

    def update(self, done: int, total: int) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=done)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
