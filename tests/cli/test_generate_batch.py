"""`kimik3 generate --input FILE.jsonl --output FILE.jsonl` over the demo model (the engine, fp32)."""

from __future__ import annotations

import json

import torch

from kimik3.cli import main


def test_batch_file_round_trip(tmp_path, capsys):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [{"id": "a", "prompt": "ROMEO:"}, {"prompt_ids": [17, 99, 301], "n": 2, "temperature": 0.7, "seed": 1},
             {"messages": [{"role": "user", "content": "Speak."}], "max_new_tokens": 2, "logprobs": 1},
             {"id": "d", "prompt": "ROMEO:"}]
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    assert main(["generate", "--input", str(src), "--output", str(dst), "--max-new-tokens", "4", "--temperature",
                 "0", "--dtype", "float32"]) == 0
    out = [json.loads(x) for x in dst.read_text().splitlines()]
    assert [o["id"] for o in out] == ["a", "2", "3", "d"]
    assert out[0]["choices"] == out[3]["choices"] and len(out[0]["choices"][0]["token_ids"]) == 4
    assert [c["index"] for c in out[1]["choices"]] == [0, 1]
    assert len(out[2]["choices"][0]["logprobs"]) == 2 and out[2]["prompt_tokens"] > 3
    assert "4 requests" in capsys.readouterr().err

    from kimik3.checkpoint.loader import load
    from kimik3.inference import SamplingParams, generate
    from kimik3.presets import DEMO_MODEL
    from kimik3.tokenizer import Tokenizer

    model = load(DEMO_MODEL, dtype=torch.float32, text_only=True, quiet=True).eval()
    tok = Tokenizer.from_file(DEMO_MODEL)
    ends = sorted({tok.eos_id, model.config.eos_token_id} - {None})
    want = generate(model, [tok.encode("ROMEO:")], SamplingParams(temperature=0, max_new_tokens=4), eos_token_ids=ends)
    assert out[0]["choices"][0]["token_ids"] == want[0].token_ids


def test_batch_file_errors_name_the_line(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "a"}\n{"prompt": "b", "temperature": -1}\n')
    assert main(["generate", "--input", str(src), "--output", str(tmp_path / "o.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "line 2" in err and "temperature" in err
    src.write_text('{"prompt": "a", "colour": 1}\n')
    assert main(["generate", "--input", str(src), "--output", str(tmp_path / "o.jsonl")]) == 2
    assert "unknown keys: colour" in capsys.readouterr().err
    src.write_text('{"prompt": "a", "temprature": 0.5}\n')
    assert main(["generate", "--input", str(src), "--output", str(tmp_path / "o.jsonl")]) == 2
    assert "temprature (did you mean temperature?)" in capsys.readouterr().err
    src.write_text('{"prompt": "a", "max_tokens": 3, "max_new_tokens": 4}\n')
    assert main(["generate", "--input", str(src), "--output", str(tmp_path / "o.jsonl")]) == 2
    assert "give one of max_new_tokens" in capsys.readouterr().err
    assert main(["generate", "--input", str(src)]) == 2
    assert "--output" in capsys.readouterr().err


def test_batch_file_bad_prompts_name_the_line(tmp_path, capsys):
    """A wrong prompt field is one line naming the file and line, never a traceback or an internal request id."""
    src = tmp_path / "in.jsonl"
    cases = [('{"prompt": 5}', "prompt must be a non-empty string"), ('{"prompt": ""}', "prompt must be"),
             ('{"prompt_ids": "abc"}', "prompt_ids must be a non-empty list"), ('{"prompt_ids": []}', "prompt_ids"),
             ('{"prompt_ids": [1, true]}', "prompt_ids"), ('{"messages": "hi"}', "messages must be a non-empty list"),
             ('{"prompt_ids": [99999999]}', "outside the model's vocabulary [0, 8704): [99999999]"),
             ('{"messages": [{"role": "robot", "content": "x"}]}', "role")]
    for line, message in cases:
        src.write_text('{"prompt": "a"}\n' + line + "\n")
        assert main(["generate", "--input", str(src), "--output", str(tmp_path / "o.jsonl")]) == 2, line
        err = capsys.readouterr().err
        assert f"--input {src} line 2: " in err and message in err and "generate-" not in err, (line, err)


def test_batch_file_takes_openai_max_tokens(tmp_path):
    """OpenAI's names for the output length, as a batch file written for the OpenAI API has them."""
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text('{"prompt_ids": [5, 6, 7], "max_tokens": 3, "ignore_eos": true}\n'
                   '{"prompt_ids": [8, 9], "max_completion_tokens": 2, "ignore_eos": true}\n')
    assert main(["generate", "--input", str(src), "--output", str(dst), "--temperature", "0"]) == 0
    out = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [len(o["choices"][0]["token_ids"]) for o in out] == [3, 2]


def test_batch_file_takes_a_single_stop_string(tmp_path):
    """OpenAI's `stop` may be one string: the same request as a one-element list."""
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text('{"prompt": "ROMEO:", "max_tokens": 40, "stop": "e"}\n'
                   '{"prompt": "ROMEO:", "max_tokens": 40, "stop": ["e"]}\n')
    assert main(["generate", "--input", str(src), "--output", str(dst), "--temperature", "0"]) == 0
    one, listed = (json.loads(line)["choices"][0] for line in dst.read_text().splitlines())
    assert one == listed and one["finish_reason"] == "stop" and "e" not in one["text"]


def test_batch_output_dash_is_standard_output(tmp_path, capsys, monkeypatch):
    """`--output -`: the result lines on stdout (for a pipe), the summary on stderr, no file named '-'."""
    monkeypatch.chdir(tmp_path)
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": "a", "prompt_ids": [5, 6], "max_tokens": 2, "ignore_eos": true}\n')
    assert main(["generate", "--input", str(src), "--output", "-", "--temperature", "0"]) == 0
    captured = capsys.readouterr()
    (line,) = captured.out.splitlines()
    assert json.loads(line)["id"] == "a" and "1 requests" in captured.err and not (tmp_path / "-").exists()


def test_batch_never_overwrites_its_input_or_an_unasked_file(tmp_path, capsys):
    src = tmp_path / "req.jsonl"
    src.write_text('{"prompt": "ROMEO:", "max_new_tokens": 2}\n')
    before = src.read_text()
    for out in (str(src), str(tmp_path / "." / "req.jsonl")):
        assert main(["generate", "--input", str(src), "--output", out, "--overwrite"]) == 2
        assert "is --input" in capsys.readouterr().err and src.read_text() == before
    mine = tmp_path / "mine.jsonl"
    mine.write_text("keep\n")
    assert main(["generate", "--input", str(src), "--output", str(mine)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--overwrite" in err and mine.read_text() == "keep\n"
    assert main(["generate", "--input", str(src), "--output", str(mine), "--overwrite", "--temperature", "0"]) == 0
    assert json.loads(mine.read_text().splitlines()[0])["id"]
