"""`kimik3 chat --model PATH [--image FILE]`: an interactive chat REPL in K3's chat format.

Commands: /reset (forget the conversation), /think on|off, /image FILE (attach to your next message), /quit.
Ctrl-C stops the answer being written (the conversation keeps what was said); Ctrl-D or /quit leaves.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

from kimik3.cli.common import (
    add_model_args,
    add_sampling_args,
    check_context,
    context_window,
    end_ids,
    load_model_and_tokenizer,
    sampling_params,
)

DIM, RESET = "\033[2m", "\033[0m"


def use_style() -> bool:
    """ANSI styling only on a terminal (never in a file or a pipe), and never under NO_COLOR (no-color.org)."""
    return sys.stdout.isatty() and not os.environ.get("NO_COLOR")


def add_parser(sub) -> None:
    p = sub.add_parser("chat", help="interactive chat with a checkpoint")
    add_model_args(p)
    add_sampling_args(p)
    p.add_argument("--image", action="append", default=[], help="image for the first message (repeatable)")
    p.add_argument("--no-think", action="store_true", help="start with thinking off")
    p.add_argument("--system", default=None, help="a system message")
    p.set_defaults(run=run)


def user_turn(model, tok, history: list[dict], text: str, image_paths: list[str], *, thinking: bool):
    """Token ids of the conversation plus a new user message (images first), and the images' tensors."""
    from kimik3.tokenizer import encode_chat
    from kimik3.vision import expand_media_pads, process_images

    paths = [p for m in history for p in m.get("_images", [])] + list(image_paths)
    vis = process_images(paths) if paths else None
    sizes = iter(vis.sizes if vis else [])
    messages = []
    for m in [*history, {"role": "user", "content": text, "_images": list(image_paths)}]:
        parts = [{"type": "image", "width": w, "height": h} for w, h in (next(sizes) for _ in m.get("_images", []))]
        content = parts + [{"type": "text", "text": m["content"]}] if parts else m["content"]
        messages.append({**{k: v for k, v in m.items() if k != "_images"}, "content": content})
    ids = encode_chat(tok, messages, thinking=thinking)
    if vis is None:
        return ids, {}
    ids = expand_media_pads(ids, vis.num_tokens, model.config.media_placeholder_token_id)
    return ids, {"pixel_values": vis.pixel_values, "grid_thws": vis.grid_thws}


class ChatPrinter:
    """Parses streamed ids into reasoning (printed dim on a terminal, plain elsewhere) and the answer."""

    def __init__(self, tok, *, thinking: bool, style: bool | None = None):
        from kimik3.tokenizer import ResponseParser

        self.parser = ResponseParser(tok, start_in="think" if thinking else "response")
        self.dim, self.reset = (DIM, RESET) if (use_style() if style is None else style) else ("", "")
        self.reasoned = False  # reasoning was shown and the answer has not started

    def feed(self, token_id: int, *, show: bool = True) -> None:
        delta = self.parser.feed([token_id])
        if show:
            if delta.reasoning_content:
                sys.stdout.write(self.dim + delta.reasoning_content + self.reset)
                self.reasoned = True
            if delta.content:
                if self.reasoned and not self.dim:  # unstyled, a line break is what tells the two apart
                    sys.stdout.write("\n")
                self.reasoned = False
                sys.stdout.write(delta.content)
            sys.stdout.flush()

    def finish(self, *, show: bool = False):
        parsed = self.parser.finish()
        if show:
            if parsed.reasoning_content:
                print(self.dim + parsed.reasoning_content + self.reset)
            print(parsed.content)
        else:
            print()
        return parsed


@dataclass
class Session:
    """What the REPL carries between turns."""

    thinking: bool
    history: list[dict] = field(default_factory=list)  # messages; user ones keep their image files in _images
    pending_images: list[str] = field(default_factory=list)  # attached to the next user message


def run(args) -> int:
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    from kimik3.vision import load_image

    for image in args.image:  # a missing or unreadable file fails now, not after the load
        load_image(image)
    # the vision tower when the checkpoint has one (required with --image): text-only models chat too
    model, tok, path = load_model_and_tokenizer(args, vision=True if args.image else None)
    session = Session(thinking=not args.no_think, pending_images=list(args.image))
    if args.system:
        session.history.append({"role": "system", "content": args.system})
    image_help = ", /image FILE" if model.has_vision else ""
    print(f"kimik3 chat with {path} -- /reset, /think on|off{image_help}, /quit; Ctrl-C stops an answer")
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            print()
            continue
        if line.startswith("/"):
            if command(line, session, args, model, path):
                return 0
        elif line:
            answer(line, session, args, model, tok)


def command(line: str, session: Session, args, model, path) -> bool:
    """Run one /command; True means leave."""
    from kimik3.vision import load_image

    cmd, _, arg = line.partition(" ")
    arg = arg.strip()
    if cmd in ("/quit", "/exit"):
        return True
    if cmd == "/reset":
        session.history = session.history[:1] if args.system else []
        session.pending_images = []
        print("(conversation cleared)")
    elif cmd == "/think" and arg in ("on", "off"):
        session.thinking = arg == "on"
        print(f"(thinking {arg})")
    elif cmd == "/image" and arg and not model.has_vision:
        print(f"error: the model at {path} reads text only (no vision tower); it cannot take images")
    elif cmd == "/image" and arg:
        try:
            load_image(arg)
            session.pending_images.append(arg)
            print(f"(image {arg} attached to your next message)")
        except (ValueError, OSError) as e:
            print(f"error: {e}")
    else:
        print(f"commands: /reset, /think on|off{', /image FILE' if model.has_vision else ''}, /quit")
    return False


def answer(line: str, session: Session, args, model, tok) -> None:
    """Stream the model's answer to a user message and add both to the history (Ctrl-C keeps what was said)."""
    from kimik3.inference import stream

    params = sampling_params(args)
    window = context_window(args, model)
    try:
        ids, images = user_turn(model, tok, session.history, line, session.pending_images,
                                thinking=session.thinking)
    except (ValueError, OSError) as e:
        print(f"error: {e}")
        return
    try:
        check_context(args, params, len(ids), window)
    except ValueError as e:
        print(f"error: {e}; /reset starts the conversation again")
        return
    printer = ChatPrinter(tok, thinking=session.thinking)
    try:
        for events in stream(model, [ids], params, tokenizer=tok, eos_token_ids=end_ids(model, tok),
                             max_context=window, **images):
            printer.feed(events[0].token_id)
    except KeyboardInterrupt:
        print(" (stopped)", end="")
    except ValueError as e:
        print(f"error: {e}")
        return
    parsed = printer.finish()
    session.history.append({"role": "user", "content": line, "_images": session.pending_images})
    session.history.append({"role": "assistant", "content": parsed.content,
                            "reasoning_content": parsed.reasoning_content})
    session.pending_images = []
