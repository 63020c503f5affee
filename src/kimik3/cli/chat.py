"""`kimik3 chat --model PATH [--image FILE]`: an interactive chat REPL in K3's chat format.

Commands: /reset (forget the conversation), /think on|off, /image FILE (attach to your next message), /quit.
Ctrl-C stops the answer being written (the conversation keeps what was said); Ctrl-D or /quit leaves.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from dataclasses import dataclass, field

from kimik3.cli.common import add_model_args, add_sampling_args, check_context, open_engine, sampling_params
from kimik3.cli.engine_args import add_engine_args

DIM, RESET = "\033[2m", "\033[0m"


def use_style() -> bool:
    """ANSI styling only on a terminal (never in a file or a pipe), and never under NO_COLOR (no-color.org)."""
    return sys.stdout.isatty() and not os.environ.get("NO_COLOR")


def add_parser(sub) -> None:
    p = sub.add_parser("chat", help="interactive chat with a checkpoint")
    add_model_args(p)
    add_sampling_args(p)
    add_engine_args(p, max_num_seqs="1")
    p.add_argument("--image", action="append", default=[], help="image for the first message (repeatable)")
    p.add_argument("--no-think", action="store_true", help="start with thinking off")
    p.add_argument("--system", default=None, help="a system message")
    p.set_defaults(run=run)


def user_turn(engine, tok, history: list[dict], text: str, image_paths: list[str], *, thinking: bool):
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
    ids = expand_media_pads(ids, vis.num_tokens, engine.media_id)
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
    """What the REPL carries between turns: one engine (its prefix cache holds the conversation so far, so a turn
    computes only what is new), the sampling settings, the history."""

    engine: object
    params: object
    thinking: bool
    history: list[dict] = field(default_factory=list)  # messages; user ones keep their image files in _images
    pending_images: list[str] = field(default_factory=list)  # attached to the next user message


def run(args) -> int:
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    from kimik3.inference.engine import EngineConfig
    from kimik3.vision import load_image

    for image in args.image:  # a missing or unreadable file fails now, not after the load
        load_image(image)
    params = sampling_params(args)  # bad sampling values fail before the (long) load
    # the vision tower when the checkpoint has one (required with --image): text-only models chat too
    engine, path = open_engine(args, EngineConfig(max_num_seqs=1), vision=True if args.image else None)
    session = Session(engine, params, thinking=not args.no_think, pending_images=list(args.image))
    if args.system:
        session.history.append({"role": "system", "content": args.system})
    vision = engine.vision_model is not None
    image_help = ", /image FILE" if vision else ""
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
            if command(line, session, args, path):
                return 0
        elif line:
            answer(line, session, args)


def command(line: str, session: Session, args, path) -> bool:
    """Run one /command; True means leave."""
    from kimik3.vision import load_image

    vision = session.engine.vision_model is not None
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
    elif cmd == "/image" and arg and not vision:
        print(f"error: the model at {path} reads text only (no vision tower); it cannot take images")
    elif cmd == "/image" and arg:
        try:
            load_image(arg)
            session.pending_images.append(arg)
            print(f"(image {arg} attached to your next message)")
        except (ValueError, OSError) as e:
            print(f"error: {e}")
    else:
        print(f"commands: /reset, /think on|off{', /image FILE' if vision else ''}, /quit")
    return False


def answer(line: str, session: Session, args) -> None:
    """Stream the model's answer to a user message and add both to the history (Ctrl-C keeps what was said)."""
    from kimik3.inference import engine_stream

    engine, tok = session.engine, session.engine.tokenizer
    try:
        ids, images = user_turn(engine, tok, session.history, line, session.pending_images,
                                thinking=session.thinking)
    except (ValueError, OSError) as e:
        print(f"error: {e}")
        return
    try:
        check_context(args, session.params, len(ids), engine.max_model_len)
    except ValueError as e:
        print(f"error: {e}; /reset starts the conversation again")
        return
    printer = ChatPrinter(tok, thinking=session.thinking)
    try:
        with between_steps() as interrupted:
            for events in engine_stream(engine, [ids], session.params, **images):
                printer.feed(events[0].token_id)
                if interrupted:
                    raise KeyboardInterrupt
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


@contextlib.contextmanager
def between_steps():
    """Ctrl-C taken between two engine steps, never inside one (the engine is kept across turns: a step cut
    halfway would leave its bookkeeping half done): the yielded list becomes true, and the caller stops there."""
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield []
        return
    hits: list[bool] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: hits.append(True))
    try:
        yield hits
    finally:
        signal.signal(signal.SIGINT, previous)
