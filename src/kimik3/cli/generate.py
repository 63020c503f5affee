"""`kimik3 generate [--model PATH] (--prompt TEXT | --prompt-file FILE) [--chat] [--image FILE] [sampling flags]
[--stream]`."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from kimik3.cli import batch
from kimik3.cli.common import add_model_args, add_sampling_args, check_context, open_engine, sampling_params


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="continue a prompt (raw text, or one chat turn with --chat / --image)")
    add_model_args(p)
    add_sampling_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt-file", metavar="FILE", help="read the prompt from a UTF-8 text file (- = stdin)")
    batch.add_args(p, src)
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message in K3's chat format")
    p.add_argument("--no-think", action="store_true", help="chat with thinking off")
    p.add_argument("--image", action="append", default=[],
                   help="image file for the prompt (repeatable; implies --chat; needs a model with a vision tower)")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=None,
                   help="print tokens as they come (default: when the output is a terminal)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="after the text, on stderr: tokens, time and tokens/s; with speculative decoding its "
                        "acceptance rate and mean accepted length")
    p.add_argument("--parallel", choices=("tp", "ep"), default=None,
                   help="under torchrun: shard the model over the ranks (tp: attention heads and MLP widths, "
                        "ep: routed experts); rank 0 prints")
    p.set_defaults(run=run)


def read_prompt(args) -> str:
    """--prompt, or the text of --prompt-file (- = stdin); an empty prompt is an error."""
    if args.prompt is not None:
        text, where = args.prompt, "--prompt"
    elif args.prompt_file == "-":
        text, where = sys.stdin.read(), "--prompt-file - (stdin)"
    else:
        path = Path(args.prompt_file)
        if path.is_dir():
            raise IsADirectoryError(f"--prompt-file {path}: a folder; expected a UTF-8 text file")
        if not path.is_file():
            raise FileNotFoundError(f"--prompt-file {path}: no such file")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"--prompt-file {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        where = f"--prompt-file {path}"
    if not text:
        raise ValueError(f"{where}: the prompt is empty")
    return text


def report(tokens: int, seconds: float, engine) -> None:
    """The run in one line on stderr: tokens, time, rate, the engine's speculative counters (acceptance rate:
    accepted draft tokens / draft tokens; mean accepted length: tokens committed per verification step, the bonus
    included) and, with tiered experts, the expert cache's hit rate."""
    line = f"kimik3 generate: {tokens} tokens in {seconds:.2f} s ({tokens / max(seconds, 1e-9):.1f} tokens/s)"
    if engine.speculator is not None:
        spec, stats = engine.config.speculative, engine.speculator.stats
        drafted, accepted = stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens
        rate = f"{accepted / drafted:.1%}" if drafted else "n/a"
        k = f"k up to {spec.num_speculative_tokens}" if spec.adaptive else f"k = {spec.num_speculative_tokens}"
        line += (f"; speculative {spec.method}, {k}: acceptance rate {rate} "
                 f"({accepted} of {drafted} draft tokens in {stats.spec_decode_num_drafts} drafts), mean "
                 f"accepted length {stats.mean_accepted_length:.2f}")
    tiers = engine.stats
    if "expert_cache_hits" in tiers:  # --cpu-offload-gb: how often a routed expert was in the GPU's cache
        rows = tiers["expert_cache_hits"] + tiers["expert_cache_misses"]
        line += (f"; expert cache: {tiers['expert_cache_hits'] / max(rows, 1):.1%} hits of {rows} routed rows, "
                 f"{tiers['expert_cache_bytes_copied'] / 1e9:.2f} GB copied")
    print(line, file=sys.stderr)


def run(args) -> int:
    if args.input:  # batch mode: a JSONL file through the serving engine
        return batch.run(args)
    from kimik3.cli.chat import ChatPrinter, user_turn
    from kimik3.inference import engine_stream
    from kimik3.inference.engine import EngineConfig
    from kimik3.vision import load_image

    prompt = read_prompt(args)
    for image in args.image:  # a missing or unreadable file fails now, not after the load
        load_image(image)
    params = sampling_params(args)  # bad sampling values fail before the (long) load
    engine, _ = open_engine(args, EngineConfig(max_num_seqs=1), vision=bool(args.image))
    if args.parallel:  # the ranks' common seed, drawn at their start
        params = dataclasses.replace(params, seed=args.seed)
    tok = engine.tokenizer
    if args.stream is None:
        args.stream = sys.stdout.isatty()
    chat = args.chat or bool(args.image)
    if chat:
        ids, images = user_turn(engine, tok, [], prompt, args.image, thinking=not args.no_think)
        printer = ChatPrinter(tok, thinking=not args.no_think)
    else:
        ids, images, printer = tok.encode(prompt), {}, None
    check_context(args, params, len(ids), engine.max_model_len)
    if not chat and args.stream:  # a continuation reads on from its prompt
        print(prompt, end="", flush=True)
    out = []
    t0 = time.perf_counter()
    for events in engine_stream(engine, [ids], params, **images):
        for event in events:  # one prompt; several tokens in a step with speculative decoding
            if printer is not None:
                printer.feed(event.token_id, show=args.stream)
            elif args.stream:
                print(event.text, end="", flush=True)
            out.append(event.text)
    if printer is not None:
        printer.finish(show=not args.stream)
    elif not args.stream:
        print(prompt + "".join(out))
    else:
        print()
    sys.stdout.flush()
    if args.verbose:
        report(len(out), time.perf_counter() - t0, engine)
    if args.parallel:
        from kimik3.distributed import shutdown

        shutdown()
    return 0
