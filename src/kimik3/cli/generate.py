"""`kimik3 generate --model PATH --prompt TEXT [--chat] [--image FILE] [sampling flags] [--stream]`."""

from __future__ import annotations

import argparse
import sys

from kimik3.cli.common import add_model_args, add_sampling_args, load_model_and_tokenizer, sampling_params


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="continue a prompt (raw text, or one chat turn with --chat / --image)")
    add_model_args(p)
    add_sampling_args(p)
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message in K3's chat format")
    p.add_argument("--no-think", action="store_true", help="chat with thinking off")
    p.add_argument("--image", action="append", default=[],
                   help="image file for the prompt (repeatable; implies --chat)")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=None,
                   help="print tokens as they come (default: when the output is a terminal)")
    p.add_argument("--parallel", choices=("tp", "ep"), default=None,
                   help="under torchrun: shard the model over the ranks (tp: attention heads and MLP widths, "
                        "ep: routed experts); rank 0 prints")
    p.set_defaults(run=run)


def run(args) -> int:
    from kimik3.cli.chat import ChatPrinter, user_turn
    from kimik3.inference import stream

    model, tok, _ = load_model_and_tokenizer(args, vision=bool(args.image))
    params = sampling_params(args)
    if args.stream is None:
        args.stream = sys.stdout.isatty()
    chat = args.chat or bool(args.image)
    if chat:
        ids, images = user_turn(model, tok, [], args.prompt, args.image, thinking=not args.no_think)
        printer = ChatPrinter(tok, thinking=not args.no_think)
    else:
        ids, images, printer = tok.encode(args.prompt), {}, None
        if args.stream:  # a continuation reads on from its prompt
            print(args.prompt, end="", flush=True)
    out = []
    sync = None
    if args.parallel:  # every rank continues with rank 0's tokens (their logits agree; this makes it certain)
        import torch.distributed as dist

        sync = lambda tokens: dist.broadcast(tokens, 0)  # noqa: E731
    for events in stream(model, [ids], params, tokenizer=tok, eos_token_ids=[tok.eos_id],
                         max_context=args.max_context, sync_tokens=sync, **images):
        event = events[0]
        if printer is not None:
            printer.feed(event.token_id, show=args.stream)
        elif args.stream:
            print(event.text, end="", flush=True)
        out.append(event.text)
    if printer is not None:
        printer.finish(show=not args.stream)
    elif not args.stream:
        print(args.prompt + "".join(out))
    else:
        print()
    sys.stdout.flush()
    if args.parallel:
        from kimik3.distributed import shutdown

        shutdown()
    return 0
