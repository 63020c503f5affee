"""lm-eval's `local-completions` loglikelihood against `kimik3 serve` equals the in-process computation.

lm-eval is a heavy install (datasets, evaluate, scikit-learn: ~750 MB), so this is a `slow` test run by hand:
    KIMIK3_LM_EVAL=/path/to/venv/bin/lm_eval pytest -m slow tests/serve/test_lm_eval.py
It drives lm-eval as a user does (its CLI, remote tokenizer over /tokenize and /tokenizer_info, a tiny local
task), then recomputes every (context, continuation) log-likelihood with one forward of the same model.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
import torch

import kimik3
from kimik3.inference.engine import Engine, EngineConfig
from kimik3.presets import DEMO_MODEL
from kimik3.serve import Server, ServerConfig
from tests.serve.conftest import running

DOCS = [{"context": "Now is the winter of our", "continuation": " discontent"},
        {"context": "To be, or not to be:", "continuation": " that is the question"},
        {"context": "Friends, Romans,", "continuation": " countrymen, lend me your ears"},
        {"context": "O Romeo, Romeo! wherefore art thou", "continuation": " Romeo?"},
        {"context": "All the world's a", "continuation": " stage"}]
TASK = """task: shakespeare_ll
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
metric_list:
  - metric: perplexity
  - metric: acc
"""


@pytest.mark.slow
def test_lm_eval_loglikelihood_equals_in_process(demo_tok, tmp_path):
    lm_eval = os.environ.get("KIMIK3_LM_EVAL") or shutil.which("lm_eval")
    if lm_eval is None:
        pytest.skip("lm-eval is not installed (set KIMIK3_LM_EVAL to its lm_eval script)")
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "shakespeare_ll.yaml").write_text(TASK.format(data=data))
    model = kimik3.load(DEMO_MODEL, dtype=torch.float32, text_only=True, quiet=True).eval()
    server = Server(ServerConfig(model_name="demo"))
    engine = Engine(model, EngineConfig(max_num_seqs=8), eos_token_ids=(demo_tok.eos_id,), tokenizer=demo_tok)
    server.attach(engine, demo_tok, vocab_size=model.config.text.vocab_size)
    with running(server) as url:
        env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        proc = subprocess.run(
            [lm_eval, "--model", "local-completions", "--model_args",
             f"model=demo,base_url={url}/v1/completions,tokenizer_backend=remote,num_concurrent=2,max_retries=1",
             "--batch_size", "2", "--tasks", "shakespeare_ll", "--include_path", str(tmp_path / "tasks"),
             "--output_path", str(tmp_path / "out"), "--log_samples"],
            check=False, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    samples = [json.loads(line) for f in (tmp_path / "out").rglob("samples_shakespeare_ll_*.jsonl")
               for line in f.read_text().splitlines()]
    assert len(samples) == len(DOCS)
    for s in samples:
        doc = s["doc"]
        got_ll, got_greedy = s["filtered_resps"][0]  # lm-eval logs them as strings
        got_ll, got_greedy = float(got_ll), got_greedy in (True, "True")
        # lm-eval's encode_pair: the whole string, then the context's ids; the continuation is the rest
        whole = demo_tok.encode(doc["context"] + doc["continuation"], allow_special=True)
        n_ctx = len(demo_tok.encode(doc["context"], allow_special=True))
        with torch.no_grad():
            logp = model(torch.tensor([whole]))[0].double().log_softmax(-1)
        cont = torch.tensor(whole[n_ctx:])
        rows = logp[n_ctx - 1:len(whole) - 1]
        want_ll = rows.gather(1, cont[:, None]).sum().item()
        want_greedy = bool((rows.argmax(-1) == cont).all())
        assert abs(got_ll - want_ll) <= 1e-5 * max(1.0, abs(want_ll)), (doc, got_ll, want_ll)
        assert got_greedy == want_greedy
