"""`kimik3 serve`: an OpenAI-compatible HTTP API over the continuous-batching engine.

    from kimik3.serve import Server, ServerConfig, build_app
    server = Server(ServerConfig(model_name="k3-shakespeare"))
    app = build_app(server)            # run with uvicorn; /health is 503 until
    server.attach(engine, tokenizer)   # the engine loop starts in its own thread

Needs the `serve` extra (fastapi, uvicorn, prometheus-client, llguidance).
"""

from kimik3.serve.app import Server, ServerConfig, build_app
from kimik3.serve.protocol import APIError

__all__ = ["APIError", "Server", "ServerConfig", "build_app"]
