"""The server path against a real `kimik3 serve` process (the demo model, fp32, CPU): /v1/completions with echo +
logprobs + max_tokens 0 gives the prompt's logprobs and nothing else, and lm-eval's `local-completions` model over
the local task folder scores as the in-process model does, with the registered tokenizer (no
`tokenizer_backend=remote` needed). Ctrl-C (SIGINT to its pid) then stops the server cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import torch

pytest.importorskip("fastapi", reason="the serve extra is not installed")

from kimik3.presets import DEMO_MODEL  # noqa: E402
from tests.helpers import REPO, free_port  # noqa: E402
from tests.hf.test_harness import TASKS, _close, _manager, _offline_datasets  # noqa: E402, F401


@pytest.fixture(scope="module")
def served():
    """`kimik3 serve --model DEMO --port FREE` in its own process until /health answers 200; after the module,
    SIGINT to its pid: it must leave with status 0 (a stop asked for) and no traceback."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{REPO}"}
    # a child of a non-interactive shell may inherit SIGINT ignored; a user's terminal delivers it
    proc = subprocess.Popen([sys.executable, "-m", "kimik3", "serve", "--model", str(DEMO_MODEL), "--port", str(port),
                             "--device", "cpu", "--served-model-name", "demo", "--max-num-seqs", "4"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, f"kimik3 serve exited {proc.returncode}:\n{proc.stdout.read()[-3000:]}"
            assert time.monotonic() < deadline, "kimik3 serve did not become healthy in 300 s"
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            out = proc.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            out = proc.communicate()[0]
            raise AssertionError(f"kimik3 serve ignored SIGINT for 60 s:\n{out[-3000:]}") from None
    assert proc.returncode == 0, out[-3000:]
    assert "Traceback" not in out and "terminate called" not in out, out[-3000:]


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
    """The same task through lm-eval twice: `local-completions` against the server, then the in-process `kimik3`
    model; every choice's (loglikelihood, is greedy) and the accuracy agree."""
    from lm_eval import simple_evaluate

    from kimik3.hf.harness import KimiK3LM

    def run(model, **kw):
        out = simple_evaluate(model=model, tasks=["k3_mc"], task_manager=_manager(), log_samples=True, **kw)
        return out["results"]["k3_mc"], sorted(out["samples"]["k3_mc"], key=lambda s: s["doc_id"])

    args = f"model=demo,base_url={served}/v1/completions,tokenizer={DEMO_MODEL},num_concurrent=2,max_retries=1"
    remote, remote_samples = run("local-completions", model_args=args, batch_size=1)
    local, local_samples = run(KimiK3LM(model=k3_model, tokenizer=demo_tok, batch_size=4))
    assert len(remote_samples) == len(local_samples) == 6
    for a, b in zip(remote_samples, local_samples):
        for (la, ga), (lb, gb) in zip((r[0] for r in a["resps"]), (r[0] for r in b["resps"])):
            assert _close(float(la), float(lb)) and bool(ga) == bool(gb), (a["doc"], la, lb)
    assert remote["acc,none"] == local["acc,none"]
