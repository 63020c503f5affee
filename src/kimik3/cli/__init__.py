"""The `kimik3` console script: one subcommand per job; each parses arguments and calls one function.

A subcommand is a module with `add_parser(sub)` (which sets `run=`): list it in COMMANDS. Errors a user can
cause (ValueError, OSError such as FileNotFoundError) print one line and exit 2; Ctrl-C exits 130 and a
closed output pipe 141 (the shell's codes for SIGINT and SIGPIPE), both without a traceback. Every command runs
under the MoE backend KIMIK3_MOE_BACKEND names (`kimik3.ops.backend.use_backend(moe=...)`). `console` is the
installed script and `python -m kimik3`; `main` is the same without the process-level Ctrl-C handling, for
callers in Python.
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import sys
import warnings

from kimik3 import __version__
from kimik3.cli import atlas, chat, convert, eval, generate, inspect, lora, memory, params, serve, train

# in the order `kimik3 --help` lists them
COMMANDS = (params, memory, inspect, convert, generate, chat, train, lora, atlas, serve, eval)

EXIT_USAGE, EXIT_SIGINT, EXIT_SIGPIPE = 2, 130, 141


class DefaultsFormatter(argparse.HelpFormatter):
    """`--help` names each option's default, unless its help text already does or there is none to name (an
    unset option, a switch that is off)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (action.default in (None, False, argparse.SUPPRESS) or "default" in text.lower()
                or not (action.option_strings or action.nargs in ("?", "*"))):
            return text
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kimik3", description="Kimi K3 in readable, exact, fast PyTorch.",
                                     formatter_class=DefaultsFormatter)
    parser.add_argument("--version", action="version", version=f"kimik3 {__version__}")
    sub = parser.add_subparsers(dest="command", required=True,
                                parser_class=functools.partial(argparse.ArgumentParser,
                                                               formatter_class=DefaultsFormatter))
    for module in COMMANDS:
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with warnings.catch_warnings():
        warnings.showwarning = _warning_printer(args.command)
        return _run(args)


def console() -> int:
    """The `kimik3` script: `main()`, and a Ctrl-C at any moment of the process exits 130.

    main's handler covers the command; this one covers the rest of the process: argument parsing and imports
    before it, and after it the interpreter's teardown (freeing a large model or atlas takes a noticeable
    moment), where a KeyboardInterrupt would otherwise end the process by the signal itself.
    """
    try:
        code = main()
    except KeyboardInterrupt:
        print(file=sys.stderr)
        code = EXIT_SIGINT
    signal.signal(signal.SIGINT, _exit_interrupted)
    return code


def _exit_interrupted(signum, frame) -> None:
    """Ctrl-C after the command ended: its outputs are written; stop now, as interrupted."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(EXIT_SIGINT)


def _run(args) -> int:
    from kimik3.ops.backend import moe_backend_from_env, use_backend

    try:
        # KIMIK3_MOE_BACKEND is read here, once, before anything loads; the ops read the context variable
        with use_backend(moe=moe_backend_from_env()):
            return args.run(args) or 0
    except KeyboardInterrupt:
        _quiet_stdout()
        print(file=sys.stderr)  # the shell's prompt starts on a line of its own after the ^C
        return EXIT_SIGINT
    except BrokenPipeError:  # `kimik3 generate | head -1`: the reader has what it wanted
        _quiet_stdout()
        return EXIT_SIGPIPE
    except (ValueError, OSError) as e:
        print(f"kimik3 {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (MemoryError, RuntimeError) as e:
        if not _out_of_memory(e):
            raise  # a bug: keep its traceback
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"kimik3 {args.command}: error: out of memory ({detail}); ask for fewer tokens (--max-new-tokens, "
              "--max-context), a smaller batch or dtype", file=sys.stderr)
        return 1


def _warning_printer(command: str):
    """Warnings as one line each (`kimik3 CMD: warning: ...`), each text once: Python's default shows the
    warning's source line, and repeats a text raised from two places (config.json is read by the CLI and again
    by the loader)."""
    seen = set()

    def show(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if (category, text) in seen:
            return
        seen.add((category, text))
        label = "warning" if category is UserWarning else category.__name__
        print(f"kimik3 {command}: {label}: {text}", file=file or sys.stderr)

    return show


def _out_of_memory(e: BaseException) -> bool:
    """torch reports a failed allocation as torch.OutOfMemoryError (CUDA) or as a RuntimeError from its CPU
    allocator, told apart only by its message."""
    return isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError" or "can't allocate memory" in str(e)


def _quiet_stdout() -> None:
    """Point stdout at /dev/null: its buffered text would otherwise be flushed at exit into a closed pipe (a
    second BrokenPipeError, printed as 'Exception ignored ...'), or after the user asked us to stop."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout already closed, or not a real file (a test's capture)
        pass
