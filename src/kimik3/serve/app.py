"""The OpenAI-compatible HTTP API (FastAPI) over an engine running in its own thread.

    server = Server(ServerConfig(model_name="k3-shakespeare"))
    app = build_app(server)                       # /health answers 503 until:
    server.attach(engine, tokenizer)              # (kimik3 serve loads the model after uvicorn is listening)

Endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health, GET /version, GET /metrics,
POST /tokenize, POST /detokenize, GET /tokenizer_info, POST /reset_prefix_cache. Errors use OpenAI's shape; nothing
a client sends causes a 5xx.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kimik3 import __version__
from kimik3.inference.sampling import SamplingParams
from kimik3.serve.handlers import chat_completion, completion
from kimik3.serve.metrics import Metrics
from kimik3.serve.protocol import APIError, parse_chat
from kimik3.serve.runner import EngineRunner

__all__ = ["Server", "ServerConfig", "build_app"]

log = logging.getLogger("kimik3.serve")
GRAMMAR_CACHE = 64
# a body larger than this is refused before it is read whole (16 MiB: a 1M-token prompt is ~4 MB of text)
MAX_REQUEST_BYTES = 16 * 2**20
MAX_JSON_DEPTH = 64  # deeper request bodies are refused (no OpenAI field nests near it; recursion is bounded)


@dataclass
class ServerConfig:
    """Front-end settings (engine settings belong to the engine).

    Attributes:
        model_name: the id clients send as `model` for the base (others get 404).
        adapters: LoRA adapters the engine serves, name -> folder (as vLLM's --lora-modules): a request whose
            `model` is a name runs that adapter; /v1/models lists them after the base.
        api_key: when set, every endpoint but /health needs `Authorization: Bearer <api_key>`.
        max_pending: admitted requests (running + waiting) at most; beyond it 503.
        defaults: sampling defaults for unset fields (`generation_defaults`: the checkpoint's generation_config.json
            over SamplingParams'; its max_new_tokens is not used: max_tokens defaults as OpenAI's).
        disconnect_poll_s: how often a non-streaming handler checks that its client is still there.
        max_request_bytes: the largest request body read (larger: 413, before it is parsed or tokenized).
    """

    model_name: str = "kimik3"
    adapters: dict[str, str] = field(default_factory=dict)
    api_key: str | None = None
    max_pending: int = 1024
    defaults: SamplingParams = field(default_factory=SamplingParams)
    disconnect_poll_s: float = 0.05
    max_request_bytes: int = MAX_REQUEST_BYTES


class Server:
    """Everything a request handler needs; `attach` makes it ready."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.runner: EngineRunner | None = None
        self.closing = False
        self.tokenizer = None
        self.vocab_size = 0
        self.max_model_len = 0
        self.created = int(time.time())
        self.metrics = Metrics(lambda: self.runner.stats if self.runner is not None else {})
        self._grammar_vocab = None
        self._grammars: OrderedDict[str, str] = OrderedDict()  # the most recent GRAMMAR_CACHE compiled grammars
        self._grammar_lock = threading.Lock()

    def attach(self, engine, tokenizer, *, vocab_size: int | None = None) -> None:
        """Start serving `engine` (the engine contract of kimik3.inference.engine) with `tokenizer`; `vocab_size`
        is the model's logits width when it exceeds the tokenizer's."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size or tokenizer.vocab_size
        self.max_model_len = engine.max_model_len
        self.runner = EngineRunner(engine, max_pending=self.config.max_pending)

    def begin_shutdown(self) -> None:
        """The server is stopping (a first Ctrl-C): requests in flight are aborted (a stream ends with an error
        event, a waiting request gets 503) and new ones refused, so the drain ends at once."""
        self.closing = True
        if self.runner is not None:
            self.runner.abort_all("the server is shutting down")

    def shutdown(self, timeout: float = 5.0) -> bool:
        """Stop the engine thread; whether it stopped within `timeout` seconds (it finishes its current step)."""
        return self.runner is None or self.runner.shutdown(timeout)

    @property
    def ready(self) -> bool:
        return self.runner is not None

    def grammar(self, kind: str, spec: Any, *, thinking: bool) -> str:
        """A compiled llguidance grammar, cached by its text (compiling a schema costs ~1 ms to ~1 s)."""
        from kimik3.inference.constraints import GrammarVocab, json_grammar, tool_call_grammar

        with self._grammar_lock:
            if self._grammar_vocab is None:
                self._grammar_vocab = GrammarVocab(self.tokenizer, max(self.vocab_size, self.tokenizer.vocab_size))
        lark = json_grammar(spec, thinking=thinking) if kind == "json" else tool_call_grammar(spec, thinking=thinking)
        with self._grammar_lock:  # handlers compile in worker threads (asyncio.to_thread)
            if lark not in self._grammars:
                try:
                    self._grammars[lark] = self._grammar_vocab.compile(lark)
                except ValueError as e:
                    raise APIError(str(e), param="response_format" if kind == "json" else "tools") from None
                while len(self._grammars) > GRAMMAR_CACHE:  # clients choose the schemas: keep the memory bounded
                    self._grammars.popitem(last=False)
            self._grammars.move_to_end(lark)
            return self._grammars[lark]

    def constraint_factory(self, grammar: str):
        from kimik3.inference.constraints import GrammarConstraint

        vocab = self._grammar_vocab
        return lambda: GrammarConstraint(vocab, grammar)

    def check_model(self, body: dict) -> str | None:
        """The adapter a request's `model` names (None: the base, or no model given); 404 for any other name."""
        model = body.get("model")
        if model is None or model == self.config.model_name:
            return None
        if isinstance(model, str) and model in self.config.adapters:
            return model
        served = ", ".join(map(repr, [self.config.model_name, *self.config.adapters]))
        raise APIError(f"model {model!r} does not exist; this server serves {served}", status=404, param="model",
                       code="model_not_found")

    def model_name(self, adapter: str | None) -> str:
        """The id a response names: the adapter's, else the base's."""
        return adapter if adapter is not None else self.config.model_name

    def max_tokens(self, prompt_len: int, requested: int | None, default: int | None = None,
                   prompt_param: str = "messages") -> int:
        """The generation budget; 400 context_length_exceeded when prompt + max_tokens exceed the model length
        (`param` is max_tokens, or `prompt_param` when the prompt alone fills the context)."""
        if requested is None:
            requested = default if default is not None else self.max_model_len - prompt_len
        if prompt_len + requested > self.max_model_len or requested < 1:
            raise APIError(f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                           f"requested {prompt_len + max(requested, 0)} tokens ({prompt_len} in the prompt, "
                           f"{max(requested, 0)} for the completion). Reduce the prompt or max_tokens.",
                           param="max_tokens" if prompt_len < self.max_model_len else prompt_param,
                           code="context_length_exceeded")
        return requested

    def new_id(self, prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def _body(request: Request, limit: int) -> dict:
    """The request's JSON object: at most `limit` bytes (413, read no further), nested at most MAX_JSON_DEPTH
    deep (400), else 400 naming what is wrong."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(f"the request body is {int(declared)} bytes; this server reads at most {limit} "
                       "(--max-request-bytes)", status=413)
    raw = bytearray()
    async for part in request.stream():
        raw += part
        if len(raw) > limit:
            raise APIError(f"the request body is over {limit} bytes (--max-request-bytes)", status=413)
    try:
        body = json.loads(bytes(raw) or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(f"the request body is not valid JSON: {e}") from None
    except RecursionError:  # deeper than Python's own limit (~1000 levels)
        raise APIError(f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    if _deeper_than(body, MAX_JSON_DEPTH):
        raise APIError(f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
    return body


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether lists and objects nest more than `limit` deep in `value` (without recursion)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth > limit:
                return True
            stack.extend((x, depth + 1) for x in (v.values() if isinstance(v, dict) else v))
    return False


@dataclass
class Call:
    """A generating or tokenizing request past the route preamble: its body and the adapter its `model` names."""

    body: dict
    adapter: str | None


def _ready(server: Server) -> None:
    if server.closing:
        raise APIError("the server is shutting down", status=503, code="server_shutdown")
    if not server.ready:
        raise APIError("the model is loading", status=503, code="model_loading")


async def _preamble(request: Request) -> Call:
    """Every route that reads a body: the server ready, the body read and checked, its model checked once."""
    server = request.app.state.server
    _ready(server)
    body = await _body(request, server.config.max_request_bytes)
    return Call(body, server.check_model(body))


Prepared = Annotated[Call, Depends(_preamble)]  # a route's parameter of this type runs the preamble first


def build_app(server: Server) -> FastAPI:
    """The FastAPI application of `server`."""
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        await asyncio.to_thread(server.shutdown)

    async def auth(request: Request) -> None:
        # a dependency, not an HTTP middleware: Starlette's BaseHTTPMiddleware wraps `receive`, and a handler
        # behind it no longer sees the client's disconnect
        key = server.config.api_key
        if key is not None and request.url.path != "/health" \
                and request.headers.get("authorization", "") != f"Bearer {key}":
            raise APIError("missing or wrong API key (Authorization: Bearer ...)", status=401, code="invalid_api_key")

    app = FastAPI(title="kimik3", docs_url=None, redoc_url=None, lifespan=lifespan, dependencies=[Depends(auth)])
    app.state.server = server

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return _error(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException):
        return _error(APIError(str(e.detail), status=e.status_code, code=str(e.status_code)))

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception):
        log.exception("internal error")
        return _error(APIError(f"internal error: {type(e).__name__}", status=500))

    def ready() -> None:
        _ready(server)

    @app.get("/health")
    async def health():
        ready()
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/v1/models")
    async def models():
        ready()
        base = server.config.model_name
        card = {"object": "model", "created": server.created, "owned_by": "kimik3",
                "max_model_len": server.max_model_len}
        return {"object": "list", "data": [{"id": base, **card, "root": base, "parent": None}]
                + [{"id": name, **card, "root": path, "parent": base} for name, path in server.config.adapters.items()]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request, call: Prepared):
        return await chat_completion(server, request, call.body, call.adapter)

    @app.post("/v1/completions")
    async def completions(request: Request, call: Prepared):
        return await completion(server, request, call.body, call.adapter)

    @app.post("/tokenize")
    async def tokenize(call: Prepared):
        body = call.body
        if "messages" in body:
            from kimik3.tokenizer import encode_chat

            plan = parse_chat(body, defaults=server.config.defaults, vocab_size=server.vocab_size)
            try:
                tokens = encode_chat(server.tokenizer, plan.messages, **plan.encode_kwargs)
            except (ValueError, TypeError, KeyError, AttributeError) as e:
                raise APIError(f"messages: {e}", param="messages") from None
        elif isinstance(body.get("prompt"), str):  # as /v1/completions reads a string prompt: markers are tokens
            tokens = server.tokenizer.encode(body["prompt"], allow_special=True)
        else:
            raise APIError("tokenize needs a string prompt or a messages list", param="prompt")
        return {"tokens": tokens, "count": len(tokens), "max_model_len": server.max_model_len}

    @app.post("/detokenize")
    async def detokenize(call: Prepared):
        tokens = call.body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                   and 0 <= t < server.tokenizer.vocab_size for t in tokens):
            raise APIError(f"tokens must be a list of ids in [0, {server.tokenizer.vocab_size})", param="tokens")
        return {"prompt": server.tokenizer.decode(tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        ready()
        tok = server.tokenizer
        return {"tokenizer_class": "kimik3.tokenizer.Tokenizer", "eos_token": "<|end_of_msg|>",
                "eos_token_id": tok.eos_id, "bos_token": None, "pad_token": "[PAD]", "vocab_size": tok.vocab_size,
                "model_max_length": server.max_model_len}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        ready()
        await server.runner.acall(lambda engine: engine.reset_prefix_cache())
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
