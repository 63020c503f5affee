"""`--speculative-method/--speculative-model/--num-speculative-tokens` on `generate` (with and without --input)
and `serve`: the same output as without, clear errors for bad values; `/metrics` exports the spec_decode counters."""

import pytest

from kimik3.cli import main
from kimik3.presets import DEMO_DRAFTER, DEMO_MODEL
from tests.cli.test_robustness import run, text_ckpt  # noqa: F401  (the fixture)

GEN = ["--prompt", "ROMEO:\nO, she doth", "--temperature", "0", "--max-new-tokens", "12", "--no-stream"]


@pytest.mark.parametrize("extra", [["--speculative-method", "suffix", "--num-speculative-tokens", "3"],
                                   ["--speculative-method", "draft", "--speculative-model", str(DEMO_DRAFTER)]])
def test_generate_with_speculation_prints_the_same_text(capsys, extra):
    rc, plain, _ = run(["generate", "--model", str(DEMO_MODEL), *GEN], capsys)
    rc2, spec, err = run(["generate", "--model", str(DEMO_MODEL), *GEN, *extra], capsys)
    assert rc == rc2 == 0 and spec == plain and len(plain) > len(GEN[1]), err


def test_the_demos_drafter_needs_no_path_and_verbose_reports_acceptance(capsys):
    """From an installed wheel the shipped drafter has no path a user knows: `--speculative-method draft` on the
    demo model picks it, `--speculative-model demo-draft` names it; `-v` prints the acceptance rate, and k: up to
    the ceiling when the engine picks it (the default), the ceiling with --no-adaptive-speculation."""
    rc, plain, _ = run(["generate", *GEN], capsys)
    for extra, k in ((["--speculative-method", "draft"], "k up to 4"),
                     (["--speculative-method", "draft", "--speculative-model", "demo-draft"], "k up to 4"),
                     (["--speculative-method", "draft", "--no-adaptive-speculation"], "k = 4")):
        rc2, spec, err = run(["generate", *GEN, *extra, "-v"], capsys)
        assert rc == rc2 == 0 and spec == plain, err
        (line,) = err.splitlines()
        assert line.startswith("kimik3 generate: 12 tokens in ")
        assert f"speculative draft, {k}: acceptance rate " in line and "mean accepted length" in line
    rc, _, err = run(["generate", *GEN, "-v"], capsys)
    assert rc == 0 and "acceptance" not in err and err.startswith("kimik3 generate: 12 tokens in ")


@pytest.mark.parametrize("extra, message", [
    (["--speculative-method", "suffix", "--num-speculative-tokens", "0"],
     "--num-speculative-tokens must be an integer >= 1"),
    (["--speculative-method", "draft"], "--speculative-method draft needs --speculative-model PATH (the drafter's "
     "folder): no drafter ships with"),
    (["--speculative-method", "draft", "--speculative-model", "demo-drafter"], "no drafter preset of that name "
     "(presets: demo-draft)"),
    (["--num-speculative-tokens", "3"], "need --speculative-method"),
    (["--no-adaptive-speculation"], "need --speculative-method"),
    (["--speculative-method", "draft", "--speculative-model", "/nonexistent"], "no such folder"),
    (["--speculative-method", "draft", "--speculative-model", str(DEMO_DRAFTER)], "speculative model"),
])
def test_bad_speculative_flags_are_one_line_errors(text_ckpt, capsys, extra, message):  # noqa: F811
    rc, _, err = run(["generate", "--model", str(text_ckpt), "--prompt", "x", *extra], capsys)
    assert rc == 2 and message in err and "Traceback" not in err, err


def test_serve_help_lists_the_speculative_flags(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    assert all(f in out for f in ("--speculative-method", "--speculative-model", "--num-speculative-tokens",
                                  "--adaptive-speculation"))


def test_metrics_export_the_spec_decode_counters():
    from prometheus_client.parser import text_string_to_metric_families

    from kimik3.serve.metrics import Metrics

    stats = dict(spec_decode_num_drafts=3, spec_decode_num_draft_tokens=12, spec_decode_num_accepted_tokens=7)
    text = Metrics(lambda: stats).render().decode()
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["kimik3:spec_decode_num_drafts_total"] == 3
    assert samples["kimik3:spec_decode_num_draft_tokens_total"] == 12
    assert samples["kimik3:spec_decode_num_accepted_tokens_total"] == 7
