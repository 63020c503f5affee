"""The server path: /v1/completions with echo + logprobs + max_tokens 0 gives the prompt's logprobs and nothing
else, and lm-eval's `local-completions` against a real `kimik3 serve` app (uvicorn in a thread) scores as the
in-process model does, with the registered tokenizer (no `tokenizer_backend=remote` needed)."""

from __future__ import annotations

import httpx
import pytest
import torch

pytest.importorskip("fastapi", reason="the serve extra is not installed")

from kimik3.inference.engine import Engine  # noqa: E402
from kimik3.presets import DEMO_MODEL  # noqa: E402
from kimik3.serve import Server, ServerConfig  # noqa: E402
from tests.hf.test_harness import _close, _instances, _offline_datasets  # noqa: E402, F401
from tests.serve.conftest import running  # noqa: E402


@pytest.fixture(scope="module")
def served(k3_model, demo_tok):
    server = Server(ServerConfig(model_name="demo"))
    server.attach(Engine(k3_model, max_num_seqs=4, eos_token_ids=(demo_tok.eos_id,), tokenizer=demo_tok), demo_tok,
                  vocab_size=k3_model.config.text.vocab_size)
    with running(server) as url:
        yield url


def test_echo_with_max_tokens_zero_is_the_prompts_logprobs(served, k3_model, demo_tok):
    ids = demo_tok.encode("Now is the winter of our discontent")
    r = httpx.post(f"{served}/v1/completions", json={"model": "demo", "prompt": ids, "max_tokens": 0, "echo": True,
                                                     "logprobs": 1, "temperature": 0}, timeout=60).json()
    choice = r["choices"][0]
    assert choice["text"] == demo_tok.decode(ids) and choice["finish_reason"] == "length"
    assert r["usage"]["completion_tokens"] == 0 and r["usage"]["prompt_tokens"] == len(ids)
    lps = choice["logprobs"]["token_logprobs"]
    assert len(lps) == len(ids) and lps[0] is None
    with torch.no_grad():
        want = k3_model(torch.tensor([ids]))[0].double().log_softmax(-1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])
    assert all(_close(a, b) for a, b in zip(lps[1:], want.flatten().tolist()))


@pytest.mark.parametrize("body", [{"max_tokens": 0}, {"max_tokens": 0, "echo": True, "stream": True}])
def test_max_tokens_zero_needs_echo(served, body):
    r = httpx.post(f"{served}/v1/completions", json={"model": "demo", "prompt": "Hi", **body}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_lm_eval_local_completions_equals_in_process(served, k3_model, demo_tok):
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from kimik3.hf.harness import KimiK3LM

    api = LocalCompletionsAPI(model="demo", base_url=f"{served}/v1/completions", tokenizer=str(DEMO_MODEL),
                              num_concurrent=1, max_retries=1, batch_size=1)
    mc = _instances("k3_mc")
    local = KimiK3LM(model=k3_model, tokenizer=demo_tok, batch_size=4).loglikelihood(mc)
    for (a, ga), (b, gb) in zip(api.loglikelihood(mc), local):
        assert _close(a, b) and ga == gb, (a, b)
