"""lm-eval in process on kimik3's engine == full-forward loglikelihoods == lm-eval's `hf` backend == the server.

The tasks are the package's examples (kimik3/hf/tasks: YAML + JSONL, nothing downloaded): multiple choice
(loglikelihood), rolling loglikelihood, and greedy generate_until.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

pytest.importorskip("lm_eval", reason="lm-eval (the eval extra) is not installed")

from lm_eval.tasks import TaskManager  # noqa: E402

from kimik3.hf.harness import EXAMPLE_TASKS as TASKS  # noqa: E402
from kimik3.hf.harness import KimiK3LM  # noqa: E402
from kimik3.inference import SamplingParams  # noqa: E402
from kimik3.inference.generate import generate  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _offline_datasets(tmp_path_factory):
    """datasets' cache in a tmp folder, offline; run from a folder that is not the repository (the example tasks
    find their data beside themselves)."""
    old_cwd, old_env = os.getcwd(), dict(os.environ)
    os.chdir(tmp_path_factory.mktemp("elsewhere"))
    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
                      HF_DATASETS_CACHE=str(tmp_path_factory.mktemp("datasets")))
    yield
    os.chdir(old_cwd)
    os.environ.clear()
    os.environ.update(old_env)


@functools.lru_cache(maxsize=1)
def _manager() -> TaskManager:
    # only the local tasks: indexing lm-eval's thousands of built-in task files takes ~30 s per manager
    return TaskManager(include_path=str(TASKS), include_defaults=False)


def _instances(name: str) -> list:
    task = _manager().load([name])["tasks"][name]
    task.build_all_requests(rank=0, world_size=1)
    return task.instances


@pytest.fixture(scope="module")
def lm(k3_model, demo_tok):
    return KimiK3LM(model=k3_model, tokenizer=demo_tok, batch_size=4)


def full_forward(model, tok, context: str, continuation: str) -> tuple[float, bool]:
    """sum of log_softmax over the continuation's tokens, one forward of context + continuation (lm-eval's split:
    trailing spaces of the context move to the continuation; the continuation is the whole's ids past the
    context's)."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole = tok.encode(context + continuation, allow_special=True)
    k = len(tok.encode(context, allow_special=True))
    with torch.no_grad():
        logp = model(torch.tensor([whole]))[0].double().log_softmax(-1)
    rows, cont = logp[k - 1:len(whole) - 1], torch.tensor(whole[k:])
    return rows.gather(1, cont[:, None]).sum().item(), bool((rows.argmax(-1) == cont).all())


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-5 * max(1.0, abs(b))


def test_loglikelihood_equals_full_forward(lm, k3_model, demo_tok):
    instances = _instances("k3_mc")
    assert len(instances) == 18
    got = lm.loglikelihood(instances)
    for inst, (ll, greedy) in zip(instances, got):
        want_ll, want_greedy = full_forward(k3_model, demo_tok, *inst.args)
        assert _close(ll, want_ll), (inst.args, ll, want_ll)
        assert greedy == want_greedy


def test_a_shared_context_is_computed_once(k3_model, demo_tok):
    """Each question's context runs once (its end snapshot keeps its prompt logprobs in the engine's prefix cache),
    then each choice computes only its own tokens; a choice that is a prefix of another is not run at all. The
    model's embedding counts the tokens the engine forwarded."""
    lm = KimiK3LM(model=k3_model, tokenizer=demo_tok, batch_size=4)
    instances = _instances("k3_mc")
    pairs = [lm._encode_pair(*inst.args) for inst in instances]
    wholes = {tuple(c + x): len(c) for c, x in pairs}
    roots = [w for w in wholes if not any(o != w and o[:len(w)] == w for o in wholes)]
    assert len(roots) < len(wholes)  # " stage" is a prefix of " stage, and all the men"
    contexts = {w[:wholes[w]] for w in roots}
    want = sum(map(len, contexts)) + sum(len(w) - wholes[w] for w in roots)
    forwarded = []
    hook = k3_model.language_model.model.embed_tokens.register_forward_hook(
        lambda module, args, out: forwarded.append(args[0].numel()))
    try:
        got = lm.loglikelihood(instances)
    finally:
        hook.remove()
    assert sum(forwarded) == lm.scored_tokens == want
    assert want < sum(map(len, roots))  # what running each sequence whole would forward
    for inst, (ll, greedy) in zip(instances, got):
        want_ll, want_greedy = full_forward(k3_model, demo_tok, *inst.args)
        assert _close(ll, want_ll), (inst.args, ll, want_ll)
        assert greedy == want_greedy


def test_rolling_loglikelihood_equals_full_forward(lm, k3_model, demo_tok):
    instances = _instances("k3_ppl")
    for inst, ll in zip(instances, lm.loglikelihood_rolling(instances)):
        (text,) = inst.args
        ids = [demo_tok.bos_id] + demo_tok.encode(text, allow_special=True)  # one window: [BOS] then the text
        with torch.no_grad():
            logp = k3_model(torch.tensor([ids]))[0].double().log_softmax(-1)
        want = logp[:-1].gather(1, torch.tensor(ids[1:])[:, None]).sum().item()
        assert _close(ll, want), (text, ll, want)


def test_generate_until_is_greedy_generation_cut_at_the_stops(lm, k3_model, demo_tok):
    instances = _instances("k3_gen")
    for inst, text in zip(instances, lm.generate_until(instances)):
        context, kw = inst.args
        out = generate(k3_model, [demo_tok.encode(context, allow_special=True)],
                       SamplingParams(max_new_tokens=kw["max_gen_toks"], temperature=0, ignore_eos=True))[0]
        want = demo_tok.decode(out.token_ids)
        for s in kw["until"]:
            want = want.split(s)[0]
        assert text == want


def test_equals_lm_evals_hf_backend(lm, hf_model, hf_tok):
    from lm_eval.models.huggingface import HFLM

    hf = HFLM(pretrained=hf_model, tokenizer=hf_tok, batch_size=4)
    assert hf.max_length == lm.max_length and hf.prefix_token_id == lm.prefix_token_id
    mc = _instances("k3_mc")
    for (a, ga), (b, gb) in zip(lm.loglikelihood(mc), hf.loglikelihood(mc)):
        assert _close(a, b) and ga == gb, (a, b)
    ppl = _instances("k3_ppl")
    for a, b in zip(lm.loglikelihood_rolling(ppl), hf.loglikelihood_rolling(ppl)):
        assert _close(a, b), (a, b)


def test_kimik3_eval_prints_the_table(capsys, tmp_path, monkeypatch):
    import lm_eval.tasks

    from kimik3.cli import main

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", functools.partial(TaskManager, include_defaults=False))

    out = tmp_path / "results.json"
    # the example tasks need no --include-path, and run from any folder (the fixture's is not the repository)
    code = main(["eval", "--tasks", "k3_mc,k3_ppl", "--batch-size", "4", "--device", "cpu", "--output-path", str(out)])
    printed = capsys.readouterr()
    assert code == 0, printed.err[-2000:]
    assert "k3_mc" in printed.out and "acc" in printed.out and "word_perplexity" in printed.out
    assert '"k3_mc"' in out.read_text()
    assert "Custom kwargs" not in printed.err and "higher_is_better is not" not in printed.err


def test_an_unknown_task_is_one_line_before_the_model_loads(capsys, monkeypatch, tmp_path):
    import lm_eval.tasks

    import kimik3
    from kimik3.cli import main

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", functools.partial(TaskManager, include_defaults=False))
    monkeypatch.setattr(kimik3, "load", lambda *a, **k: pytest.fail("loaded the model before checking --tasks"))
    assert main(["eval", "--tasks", "nonexistent_task,k3_mcq"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kimik3 eval: error: unknown lm-eval task 'nonexistent_task'") and err.count("\n") == 1
    assert "'k3_mcq' (did you mean k3_mc?)" in err
    assert main(["eval", "--tasks", "k3_mc", "--include-path", str(tmp_path / "nowhere")]) == 2
    assert "nowhere: no such folder" in capsys.readouterr().err
