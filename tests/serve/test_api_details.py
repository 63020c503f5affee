"""API details a new user meets: the completions context error names `prompt`, a 405 is the client's error,
unsupported completions fields are refused by name, GET /version."""

from __future__ import annotations

import httpx
import openai
import pytest

import kimik3
from tests.serve.conftest import running
from tests.serve.test_http import MODEL, _client, _server


def test_completions_context_error_names_prompt(demo_tok):
    server, _ = _server(demo_tok, lambda p, i: [])
    with running(server) as url:
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "word " * 600})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "prompt" and err["code"] == "context_length_exceeded"


def test_method_not_allowed_is_an_invalid_request(demo_tok):
    server, _ = _server(demo_tok, lambda p, i: [])
    with running(server) as url:
        r = httpx.get(f"{url}/v1/chat/completions")
        assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("extra, param", [({"suffix": "end"}, "suffix"), ({"best_of": 3}, "best_of"),
                                          ({"best_of": 2, "n": 1}, "best_of")])
def test_unsupported_completion_fields_are_refused(demo_tok, extra, param):
    server, engine = _server(demo_tok, lambda p, i: [5])
    with running(server) as url:
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        with pytest.raises(openai.BadRequestError):
            _client(url).completions.create(model=MODEL, prompt="x", max_tokens=1, **extra)
    assert engine.added == []


def test_best_of_equal_to_n_is_accepted(demo_tok):
    server, _ = _server(demo_tok, lambda p, i: [5])
    with running(server) as url:
        for extra in ({"best_of": 1}, {"best_of": 2, "n": 2}):
            r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1, **extra})
            assert r.status_code == 200, r.text


def test_version_endpoint(demo_tok):
    server, _ = _server(demo_tok, lambda p, i: [])
    with running(server) as url:
        assert httpx.get(f"{url}/version").json() == {"version": kimik3.__version__}
