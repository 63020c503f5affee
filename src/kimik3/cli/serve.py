"""`kimik3 serve [--model DIR] [--host 127.0.0.1] [--port 8000] [engine flags] [--served-model-name] [--api-key]
[--lora NAME=PATH ...]`: an OpenAI-compatible HTTP server (needs the `serve` extra)."""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import signal
import sys
import threading

from kimik3.cli.engine_args import add_engine_args, engine_config


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat and text completions, streaming, metrics)")
    p.add_argument("--model", default=None,
                   help="checkpoint folder or Hugging Face Hub id org/name (default: the bundled demo model)")
    p.add_argument("--revision", default=None, help="branch, tag or commit of a hub id (default: main)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float32", "float16"),
                   help="compute dtype (default: float32 on the CPU, the checkpoint's on CUDA)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads (default: 1 for models under 100M parameters, else torch's; OMP_NUM_THREADS "
                        "counts as asked)")
    add_engine_args(p, warmup=True)
    p.add_argument("--max-pending", type=int, default=1024,
                   help="admitted requests (running + waiting) at most; more get 503")
    p.add_argument("--max-request-bytes", type=int, default=None,
                   help="the largest request body read; a larger one gets 413 before it is parsed (default: 16 MiB)")
    p.add_argument("--shutdown-timeout", type=float, default=5.0,
                   help="seconds a stop (Ctrl-C, SIGTERM) waits for connections to close after the requests in flight "
                        "were ended (their streams with an error event); then it exits 0 (a second Ctrl-C: at once)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients send (default: the hub id, else the folder name)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (all but /health)")
    p.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                   help="serve a LoRA adapter folder (PEFT format, as kimik3 train writes) as model NAME (repeatable, "
                        "as vLLM's --lora-modules): a request's model field picks it; requests of different adapters "
                        "and of the base share each batch")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.set_defaults(run=run)


def adapters(args) -> dict[str, str]:
    """--lora NAME=PATH flags -> {name: path}, each folder's config and tensor names read: an adapter serving cannot
    run fails before the load, in one line."""
    from kimik3.lora.serving import check_servable

    out: dict[str, str] = {}
    for item in getattr(args, "lora", None) or []:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora {item!r}: expected NAME=PATH (a model name for requests, an adapter folder)")
        if name in out:
            raise ValueError(f"--lora {item!r}: the name {name!r} is given twice")
        check_servable(path)
        out[name] = path
    return out


def check_args(args, path):
    """Every flag checked before anything starts (the engine's against the checkpoint's config): the config."""
    from kimik3.checkpoint.source import read_config as model_config
    from kimik3.inference.engine import EngineConfig
    from kimik3.inference.threads import check_threads

    check_threads(args.threads, "--threads")
    if args.max_pending < 1:
        raise ValueError(f"--max-pending must be at least 1, got {args.max_pending}")
    if args.max_request_bytes is not None and args.max_request_bytes < 1024:
        raise ValueError(f"--max-request-bytes must be at least 1024, got {args.max_request_bytes}")
    if not args.shutdown_timeout >= 0:
        raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    args.adapters = adapters(args)
    positions = model_config(path).text.max_position_embeddings
    return engine_config(args, EngineConfig(warmup=True), positions)


def build_engine(args, path, config=None):
    """The engine for `args` (bench/bench_serve.py builds through the same flags), warmed up (compiled, its graphs
    captured) before it is returned, unless --no-warmup."""
    import torch

    from kimik3.inference import load_engine

    config = config or check_args(args, path)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if config.warmup:
        logging.getLogger("kimik3.serve").info("warming up: every prefill shape up to %d tokens and the decode "
                                               "graphs", config.max_num_batched_tokens)
    return load_engine(path, config, device=device, dtype=args.dtype or (torch.float32 if device == "cpu" else None),
                       adapters=getattr(args, "adapters", None) or None, threads=args.threads)


def _check_address(host: str, port: int) -> None:
    """Refuse an address we cannot listen on before loading: uvicorn would exit mid-load (its SystemExit racing
    the loading thread) with a traceback for a bad port, or a log line and status 3 for a port in use."""
    import socket

    if not 0 <= port <= 65535:
        raise ValueError(f"--port {port}: must be in 0..65535")
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a listener still conflicts
            s.bind(addr)
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port} ({e.strerror or e}); pick another --port or --host") from None


def run(args) -> int:
    try:
        import uvicorn

        from kimik3.serve import Server, ServerConfig, build_app
    except ImportError as e:
        raise ValueError(f"kimik3 serve needs the serve extra (pip install 'kimik3[serve]'): {e}") from None
    from kimik3.checkpoint.hub import is_hub_id
    from kimik3.cli.common import model_path
    from kimik3.inference.sampling import generation_defaults

    path = model_path(args)
    config = check_args(args, path)
    _check_address(args.host, args.port)
    # our own loggers at the asked level; torch's and other libraries' stay at warnings
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kimik3").setLevel(args.log_level.upper())
    name = args.served_model_name or (args.model if is_hub_id(args.model or "") else path.name)
    if name in args.adapters:
        raise ValueError(f"--lora {name}=...: {name!r} is the base model's name (--served-model-name)")
    server = Server(ServerConfig(model_name=name, adapters=args.adapters, api_key=args.api_key,
                                 max_pending=args.max_pending, defaults=generation_defaults(path),
                                 **({} if args.max_request_bytes is None else
                                    {"max_request_bytes": args.max_request_bytes})))
    app = build_app(server)
    failed: list[BaseException] = []

    def load() -> None:  # /health answers 503 while this runs
        try:
            engine = build_engine(args, path, config)
            server.attach(engine, engine.tokenizer, vocab_size=engine.vocab_size)
            logging.getLogger("kimik3.serve").info("serving %s as %r on http://%s:%d", path,
                                                   server.config.model_name, args.host, args.port)
        except BaseException as e:
            failed.append(e)
            logging.getLogger("kimik3.serve").exception("loading %s failed", path)
            uv.should_exit = True

    class Uvicorn(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            """The first stop ends the requests in flight, so the drain that follows is short, and at most
            --shutdown-timeout; another one changes nothing (uvicorn's forced exit would skip the app's shutdown)."""
            if self.should_exit:
                logging.getLogger("kimik3.serve").warning("stopping: at most %.0f s more", args.shutdown_timeout)
                return
            server.begin_shutdown()
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            """uvicorn's, without raising the signal again once it shut down (inside asyncio's runner that cancels
            the app's lifespan mid-shutdown and logs a traceback): a stop asked for ends here, with status 0."""
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    uv = Uvicorn(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                timeout_graceful_shutdown=args.shutdown_timeout))
    # a thread starts with a fresh context: run it in a copy of ours, so it keeps the command's MoE backend
    loader = threading.Thread(target=contextvars.copy_context().run, args=(load,), name="kimik3-load", daemon=True)
    loader.start()
    try:
        uv.run()
        code = 0
    except SystemExit as e:  # uvicorn exits when it cannot start (a bind that failed after our check)
        code = e.code if isinstance(e.code, int) and e.code else 1
    except KeyboardInterrupt:  # a Ctrl-C before uvicorn took the signals over
        code = 130
    if failed:
        print(f"kimik3 serve: error: {failed[0]}", file=sys.stderr)
        return 1
    # the engine thread ends after its current step (a second Ctrl-C skipped the app's own shutdown); the loader
    # may be inside torch still: finalizing the interpreter under a running thread aborts the process ("terminate
    # called without an active exception"), so then leave without finalizing
    if not server.shutdown(args.shutdown_timeout) or loader.is_alive():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
