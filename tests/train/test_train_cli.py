"""`kimik3 train` as a new user meets it: what its errors say, and that following their advice works."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import kimik3
from kimik3.cli import main
from kimik3.inference import SamplingParams, generate
from kimik3.presets import DEMO_MODEL
from kimik3.tokenizer import Tokenizer
from kimik3.train.data import prepare_shards

pytestmark = pytest.mark.filterwarnings("ignore:quantile balancing with q")
REPO = Path(__file__).resolve().parents[2]
BYTES = str(REPO / "configs/train/bytes.tiktoken")


def write_run(tmp_path: Path, name: str = "run.toml", model: str = 'config = "tiny"') -> Path:
    docs = tmp_path / "docs"
    docs.mkdir(exist_ok=True)
    for i in range(4):
        words = ["kimi", "delta", "attention", "router"]
        (docs / f"d{i}.txt").write_text(" ".join(words[j % 4] for j in range(40 + i)))
    toml = tmp_path / name
    toml.write_text(f'out_dir = "{tmp_path / "run"}"\n[model]\n{model}\n[data]\ntrain = "{docs}/*.txt"\n'
                    f'tokenizer = "{BYTES}"\nseq_len = 32\n[train]\nsteps = 1\n[log]\nprogress = false\n')
    return toml


def test_steps_zero_and_missing(tmp_path, capsys):
    toml = write_run(tmp_path)
    assert main(["train", str(toml), "--set", "train.steps=0"]) == 2
    assert "'train.steps' must be >= 1, got 0" in capsys.readouterr().err
    toml.write_text(toml.read_text().replace("steps = 1\n", ""))
    assert main(["train", str(toml)]) == 2
    assert "'train.steps' is required" in capsys.readouterr().err


def _advised_out_dir(err: str) -> str:
    found = re.search(r"--set out_dir=(\S+?)\)?[.;]?(\s|$)", err)
    assert found, err
    return found[1]


def test_resume_advice_leads_to_a_working_run(tmp_path, capsys):
    toml = write_run(tmp_path)
    assert main(["train", str(toml)]) == 0
    capsys.readouterr()
    # a changed data layout cannot resume: the advised folder starts over, and the advised weights start from it
    assert main(["train", str(toml), "--set", "data.seq_len=16"]) == 2
    err = capsys.readouterr().err
    assert "resuming would not continue that run" in err and "checkpoint.resume" not in err
    fresh = _advised_out_dir(err)
    assert not Path(fresh).exists()
    assert main(["train", str(toml), "--set", "data.seq_len=16", "--set", f"out_dir={fresh}"]) == 0
    weights = re.search(r'model.checkpoint = "([^"]+)"', err)[1]
    tuned = write_run(tmp_path, "tuned.toml", model=f'checkpoint = "{weights}"')
    assert main(["train", str(tuned), "--set", "data.seq_len=16", "--set", f"out_dir={tmp_path / 'tuned'}"]) == 0
    # resume = "never" on a folder with checkpoints: its advice works too
    assert main(["train", str(toml), "--set", 'checkpoint.resume="never"']) == 2
    fresh = _advised_out_dir(capsys.readouterr().err)
    assert main(["train", str(toml), "--set", 'checkpoint.resume="never"', "--set", f"out_dir={fresh}"]) == 0
    assert "done at step 1/1" in capsys.readouterr().out


def test_prepare_binary_file_names_it(tmp_path, capsys):
    blob = tmp_path / "weights.bin.txt"
    blob.write_bytes(bytes(range(256)) * 4)
    assert main(["train", "--prepare", str(tmp_path / "out"), "--tokenizer", BYTES, str(blob)]) == 2
    err = capsys.readouterr().err
    assert f"{blob}: not UTF-8 text (byte 128 is 0x80)" in err


def test_demo_model_and_prepare_agree_on_end_of_text(tmp_path, capsys):
    """`--prepare` ends each document with the tokenizer's [EOS]; the demo model declares that id as its
    end of text (config.json, generation_config.json), and its weights, trained on such documents, produce it
    where a work ends, while <|end_of_msg|> (its chat turns' end, never in its data) is far down the ranking."""
    tok = Tokenizer.from_file(DEMO_MODEL)
    (tmp_path / "a.txt").write_text("ROMEO:\nGood night.\n")
    meta = json.loads((prepare_shards([str(tmp_path / "a.txt")], str(DEMO_MODEL), tmp_path / "s") / "meta.json")
                      .read_text())
    eos = tok.encode_special("[EOS]")
    config = json.loads((DEMO_MODEL / "config.json").read_text())
    gen = json.loads((DEMO_MODEL / "generation_config.json").read_text())
    assert meta["eos_id"] == eos == config["eos_token_id"] == config["text_config"]["eos_token_id"] \
        == gen["eos_token_id"]
    model = kimik3.load(DEMO_MODEL, dtype=torch.float32, text_only=True, quiet=True)
    assert model.config.eos_token_id == eos
    ending = "High order in this great solemnity.\n\n[Exeunt.]\n"  # the last lines of Antony and Cleopatra
    with torch.no_grad():
        probs = model(torch.tensor([tok.encode(ending)]))
    probs = getattr(probs, "logits", probs)[0, -1].float().softmax(-1)
    assert int(probs.argmax()) == eos and int((probs > probs[tok.eos_id]).sum()) > 1000
    out = generate(model, [tok.encode(ending)], SamplingParams(temperature=0, max_new_tokens=8),
                   eos_token_ids=[model.config.eos_token_id])[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop"
    # `kimik3 generate` stops there too: nothing is written after the prompt
    assert main(["generate", "--prompt", ending, "--temperature", "0", "--max-new-tokens", "8", "--no-stream",
                 "--dtype", "float32"]) == 0
    assert capsys.readouterr().out == ending + "\n"


def test_prepare_chat_jsonl_then_train(tmp_path, capsys):
    """`--prepare` on chat JSONL writes the mask shards, and a run trains from that folder."""
    line = {"messages": [{"role": "user", "content": "kimi?"}, {"role": "assistant", "content": "delta " * 20}]}
    (tmp_path / "chat.jsonl").write_text((json.dumps(line) + "\n") * 6)
    assert main(["train", "--prepare", str(tmp_path / "shards"), "--tokenizer", BYTES,
                 str(tmp_path / "chat.jsonl")]) == 0
    assert "with the assistant mask of its chat documents" in capsys.readouterr().err
    assert json.loads((tmp_path / "shards" / "meta.json").read_text())["mask_files"] == ["mask-00000.bin"]
    toml = write_run(tmp_path)
    text = toml.read_text()
    assert f'train = "{tmp_path / "docs"}/*.txt"' in text
    toml.write_text(text.replace(f'train = "{tmp_path / "docs"}/*.txt"', f'train = "{tmp_path / "shards"}"'))
    assert main(["train", str(toml)]) == 0
    assert "done at step 1/1" in capsys.readouterr().out


def test_a_trainer_checkpoint_is_a_complete_model_folder(tmp_path, capsys):
    """The run's tokenizer as tiktoken.model (with tokenizer_config.json) and its document separator as
    eos_token_id: `generate` takes it."""
    toml = write_run(tmp_path)
    assert main(["train", str(toml)]) == 0
    model = tmp_path / "run" / "checkpoints" / "step-00000001" / "model"
    assert (model / "tiktoken.model").read_bytes() == Path(BYTES).read_bytes()
    hf = json.loads((model / "tokenizer_config.json").read_text())  # the HF tokenizer files too (docs/model.md)
    assert hf["tokenizer_class"] == "TikTokenTokenizer" and (model / "tokenization_kimi.py").is_file()
    eos = Tokenizer.from_file(BYTES).encode_special("[EOS]")
    assert eos == 257
    assert json.loads((model / "config.json").read_text())["eos_token_id"] == eos
    assert json.loads((model / "generation_config.json").read_text())["eos_token_id"] == eos
    capsys.readouterr()
    assert main(["generate", "--model", str(model), "--prompt", "def ", "--max-new-tokens", "3",
                 "--device", "cpu"]) == 0, capsys.readouterr().err


def test_negative_stop_at_is_refused(tmp_path, capsys):
    toml = write_run(tmp_path)
    assert main(["train", str(toml), "--stop-at", "-1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--stop-at" in err and not (tmp_path / "run").exists()


def test_threads_sets_the_thread_count(tmp_path, capsys):
    toml = write_run(tmp_path)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert main(["train", str(toml), "--threads", "1"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert main(["train", str(toml), "--threads", "0"]) == 2
    assert "--threads" in capsys.readouterr().err


def test_prepare_again_leaves_no_stale_shards(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("kimi delta attention " * 40)
    out = tmp_path / "shards"
    prepare_shards([str(text)], BYTES, out, shard_tokens=100)
    assert len(list(out.glob("tokens-*.bin"))) > 2
    text.write_text("short")
    prepare_shards([str(text)], BYTES, out, shard_tokens=100)
    assert sorted(p.name for p in out.glob("tokens-*.bin")) == json.loads((out / "meta.json").read_text())["files"]


def test_no_progress_says_it_resumed(tmp_path, capsys):
    toml = write_run(tmp_path)
    toml.write_text(toml.read_text().replace("steps = 1\n", "steps = 2\n"))
    assert main(["train", str(toml), "--stop-at", "1", "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["train", str(toml), "--no-progress"]) == 0
    assert "resumed from step 1" in capsys.readouterr().err


def test_no_progress_prints_a_log_line_every_log_every_steps(tmp_path, capsys):
    toml = write_run(tmp_path)
    toml.write_text(toml.read_text().replace("steps = 1\n", "steps = 5\n"))
    assert main(["train", str(toml), "--no-progress", "--set", "log.every=2", "--stop-at", "3"]) == 0
    err = capsys.readouterr().err
    lines = re.findall(r"kimik3 train: step (\d+)/5: loss (\d+\.\d+), ([\d,]+) tokens/s", err)
    assert [int(s) for s, _, _ in lines] == [2], err
    assert main(["train", str(toml), "--no-progress", "--set", "log.every=2"]) == 0
    err = capsys.readouterr().err
    assert "resumed from step 3" in err
    assert [int(s) for s, _, _ in re.findall(r"step (\d+)/5: loss (\d+\.\d+), ([\d,]+) tokens/s", err)] == [4, 5]


def test_a_start_override_on_a_resumed_run_is_named_not_ignored_silently(tmp_path, capsys):
    """`--set model.init_seed=5` on a folder that resumes: the run continues (its weights come from the
    checkpoint) and says that the override had no effect, with the folder that would apply it."""
    toml = write_run(tmp_path)
    assert main(["train", str(toml)]) == 0
    capsys.readouterr()
    assert main(["train", str(toml), "--set", "train.steps=2", "--set", "model.init_seed=5"]) == 0
    captured = capsys.readouterr()
    assert "done at step 2/2" in captured.out
    (line,) = [x for x in captured.err.splitlines() if "init_seed" in x]
    assert line.startswith("kimik3 train: warning: resuming ") and "model.init_seed 0 -> 5 has no effect" in line
    assert not Path(_advised_out_dir(line)).exists()
    assert main(["train", str(toml), "--set", "train.steps=3"]) == 0  # nothing overridden: nothing said
    assert "has no effect" not in capsys.readouterr().err


def test_threads_past_the_machine_is_one_line(tmp_path, capsys):
    assert main(["train", str(write_run(tmp_path)), "--threads", "10000"]) == 2
    assert "--threads must be from 1 to" in capsys.readouterr().err


@pytest.mark.parametrize("progress", ["--no-progress", "--set=log.progress=true"])  # a bar on no terminal: lines
def test_a_closed_output_pipe_saves_like_ctrl_c(tmp_path, progress):
    """`kimik3 train ... 2>&1 | head -1`: once the reader is gone the run stops after the current step and saves
    it (as Ctrl-C does), then exits 141; it used to die of the broken pipe with nothing saved."""
    import os
    import subprocess
    import sys

    toml = write_run(tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "kimik3", "train", str(toml), "--set", "train.steps=500",
                             "--set", "eval.every=1", "--set", "checkpoint.every=1000", progress],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    first = proc.stdout.readline()
    proc.stdout.close()  # as `head -1` exits
    assert proc.wait(timeout=300) == 141, first
    saved = sorted((tmp_path / "run" / "checkpoints").iterdir())
    assert len(saved) == 1 and 0 < int(saved[0].name.removeprefix("step-")) < 500
