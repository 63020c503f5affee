"""A real uvicorn server on 127.0.0.1 (a free port) in a thread, around any engine with the engine contract."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

from kimik3.presets import DEMO_MODEL
from kimik3.tokenizer import Tokenizer
from tests.helpers import free_port


@contextlib.contextmanager
def running(server):
    """Serve `server` (a kimik3.serve.Server) with uvicorn; yields the base URL; stops it after."""
    import uvicorn

    from kimik3.serve import build_app

    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(build_app(server), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        uv.should_exit = True
        thread.join(10)
        server.shutdown()


@pytest.fixture(scope="session")
def demo_tok() -> Tokenizer:
    return Tokenizer.from_file(DEMO_MODEL)
