"""Request bodies a client can make hostile: nested deeper than any OpenAI field goes (400, never a 500 from a
RecursionError) and larger than --max-request-bytes (413 before it is read whole, parsed or tokenized)."""

from __future__ import annotations

import httpx

from kimik3.serve import Server, ServerConfig
from tests.serve.conftest import running
from tests.serve.scripted import ScriptedEngine


def _server(demo_tok, **kw) -> Server:
    server = Server(ServerConfig(model_name="m", **kw))
    server.attach(ScriptedEngine(lambda p, i: demo_tok.encode("Hi"), eos_id=demo_tok.eos_id), demo_tok)
    return server


def test_deep_nesting_is_a_400_not_a_500(demo_tok, caplog):
    with running(_server(demo_tok)) as url:
        for depth in (100, 100_000):  # within Python's recursion limit and past it
            body = '{"model": "m", "messages": ' + "[" * depth + "]" * depth + "}"
            for path in ("/v1/chat/completions", "/v1/completions", "/tokenize"):
                r = httpx.post(f"{url}{path}", content=body, headers={"content-type": "application/json"},
                               timeout=30)
                assert r.status_code == 400, (depth, path, r.text)
                err = r.json()["error"]
                assert err["type"] == "invalid_request_error" and "nests deeper than 64" in err["message"]
        ok = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                             "max_tokens": 3}, timeout=30)
        assert ok.status_code == 200
    assert "Traceback" not in caplog.text and "RecursionError" not in caplog.text


def test_a_body_past_the_limit_is_refused_before_it_is_read(demo_tok):
    with running(_server(demo_tok, max_request_bytes=4096)) as url:
        big = {"prompt": "x" * 5000, "max_tokens": 2}
        r = httpx.post(f"{url}/v1/completions", json=big, timeout=30)
        assert r.status_code == 413 and "at most 4096" in r.json()["error"]["message"]
        assert r.json()["error"]["type"] == "invalid_request_error"

        def chunks():  # no content-length: the reader stops at the limit
            yield b'{"prompt": "'
            for _ in range(100):
                yield b"x" * 1000
            yield b'"}'

        r = httpx.post(f"{url}/v1/completions", content=chunks(), headers={"content-type": "application/json"},
                       timeout=30)
        assert r.status_code == 413 and "over 4096 bytes" in r.json()["error"]["message"]
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "x" * 100, "max_tokens": 2},
                          timeout=30).status_code == 200
