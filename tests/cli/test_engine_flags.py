"""The engine flags mean one thing on every command that has them: `generate` for one prompt and for `--input`,
`chat`, `serve` and `eval` build the engine of the flags given (over the command's defaults); `--max-context` is a
deprecated alias of `--max-model-len` that says so."""

from __future__ import annotations

import builtins

import pytest

from kimik3.cli.engine_args import engine_config
from kimik3.inference.engine import Engine, EngineConfig
from kimik3.presets import DEMO_DRAFTER, DEMO_MODEL
from tests.cli.test_robustness import run

ROMEO = ["--prompt", "ROMEO:", "--temperature", "0", "--no-stream"]


@pytest.fixture
def built(monkeypatch):
    """The configs of the engines the command builds, and the tokens their steps produced."""
    seen = {"configs": [], "tokens": 0}
    init, step = Engine.__init__, Engine.step

    def spy_init(self, model, config=None, **kw):
        seen["configs"].append(config)
        init(self, model, config, **kw)

    def spy_step(self):
        outs = step(self)
        seen["tokens"] += sum(len(o.token_ids) for out in outs for o in out.outputs)
        return outs

    monkeypatch.setattr(Engine, "__init__", spy_init)
    monkeypatch.setattr(Engine, "step", spy_step)
    return seen


def test_generate_stops_at_max_model_len(built, capsys):
    """`--max-model-len 20` bounds prompt + answer (the prompt is 2 tokens: 18 new ones), as the old
    `--max-context 20` did; it used to be ignored for one prompt (40 tokens came out)."""
    rc, _, err = run(["generate", *ROMEO, "--max-new-tokens", "40", "--max-model-len", "20"], capsys)
    assert rc == 0 and built["tokens"] == 18, err
    assert "the context holds 20 tokens (--max-model-len)" in err


def test_max_context_is_a_deprecated_alias(built, capsys):
    rc, _, err = run(["generate", *ROMEO, "--max-new-tokens", "40", "--max-context", "20"], capsys)
    assert rc == 0 and built["tokens"] == 18, err
    assert "kimik3 generate: warning: --max-context is deprecated: use --max-model-len" in err
    assert built["configs"][-1].max_model_len == 20


FLAGS = ["--max-num-seqs", "3", "--max-num-batched-tokens", "96", "--no-prefix-cache",
         "--speculative-method", "suffix", "--num-speculative-tokens", "2"]


def test_one_prompt_honors_every_engine_flag(built, capsys):
    rc, _, err = run(["generate", *ROMEO, "--max-new-tokens", "4", *FLAGS], capsys)
    assert rc == 0, err
    (config,) = built["configs"]
    assert (config.max_num_seqs, config.max_num_batched_tokens, config.enable_prefix_cache) == (3, 96, False)
    assert config.speculative.num_speculative_tokens == 2
    rc, _, err = run(["generate", *ROMEO, "--max-new-tokens", "4", "--prefix-cache-bytes", "12345"], capsys)
    assert rc == 0 and built["configs"][-1].prefix_cache_bytes == 12345, err


def test_batch_and_chat_honor_the_same_flags(built, capsys, tmp_path, monkeypatch):
    requests = tmp_path / "in.jsonl"
    requests.write_text('{"prompt": "ROMEO:"}\n')
    rc, _, err = run(["generate", "--input", str(requests), "--output", str(tmp_path / "out.jsonl"),
                      "--max-new-tokens", "3", *FLAGS], capsys)
    assert rc == 0, err
    lines = iter(["hello", "/quit"])
    monkeypatch.setattr(builtins, "input", lambda prompt="": next(lines))
    rc, _, err = run(["chat", "--max-new-tokens", "3", *FLAGS, "--max-model-len", "300"], capsys)
    assert rc == 0, err
    batch, chat = built["configs"]
    for config in (batch, chat):
        assert (config.max_num_seqs, config.max_num_batched_tokens, config.enable_prefix_cache) == (3, 96, False)
        assert config.speculative.num_speculative_tokens == 2
    assert chat.max_model_len == 300


def test_commands_differ_only_in_their_defaults():
    """A flag left unset takes the command's default config; a flag given is the same field everywhere."""
    from kimik3.cli import build_parser

    p = build_parser()
    for argv, base in ((["generate", "--prompt", "x"], EngineConfig(max_num_seqs=1)),
                       (["chat"], EngineConfig(max_num_seqs=1)), (["serve"], EngineConfig(warmup=True)),
                       (["eval", "--tasks", "t"], EngineConfig(max_num_seqs=8))):
        assert engine_config(p.parse_args(argv), base) == base
        args = p.parse_args([*argv, "--max-num-seqs", "5", "--max-model-len", "77"])
        assert engine_config(args, base) == EngineConfig(**{**vars(base), "max_num_seqs": 5, "max_model_len": 77})
    assert p.parse_args(["eval", "--tasks", "t", "--batch-size", "4"]).max_num_seqs == 4  # lm-eval's spelling
    assert engine_config(p.parse_args(["serve", "--no-warmup"]), EngineConfig(warmup=True)).warmup is False
    for argv in (["generate", "--prompt", "x"], ["chat"], ["serve"], ["eval", "--tasks", "t"]):
        assert engine_config(p.parse_args([*argv, "--deterministic"]), EngineConfig()).deterministic is True
        assert engine_config(p.parse_args([*argv, "--no-deterministic"]), EngineConfig()).deterministic is False


def test_deterministic_on_the_cpu_prints_the_same_text(capsys):
    """--deterministic on the CPU (where the default kernels are batch-invariant but for some bf16 GEMM shapes,
    which the flag runs in row groups) prints the same text."""
    outs = []
    for extra in ([], ["--deterministic"]):
        rc, out, err = run(["generate", *ROMEO, "--max-new-tokens", "12", "--device", "cpu", *extra], capsys)
        assert rc == 0, err
        outs.append(out)
    assert outs[0] == outs[1] and outs[0].strip()


def test_speculative_rules_are_the_configs_with_the_flags_names(capsys):
    # (draft without --speculative-model on the demo runs its shipped drafter: test_speculative_flags.py)
    for method, extra, message in (
            ("suffix", ["--num-speculative-tokens", "0"], "--num-speculative-tokens must be an integer >= 1"),
            ("suffix", ["--speculative-model", str(DEMO_DRAFTER)], "--speculative-model is for method 'draft'"),
            ("draft", ["--speculative-model", "/nonexistent"], "--speculative-model /nonexistent: no such")):
        rc, _, err = run(["generate", "--model", str(DEMO_MODEL), "--prompt", "x", "--speculative-method", method,
                          *extra], capsys)
        assert rc == 2 and message in err and "Traceback" not in err, err


def test_the_help_names_the_configs_default_k(capsys):
    from kimik3.cli import main
    from kimik3.inference.engine import SpeculativeConfig

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert f"(default {SpeculativeConfig().num_speculative_tokens})" in help_text
