"""`kimik3 generate` and `kimik3 chat` end to end on a tiny checkpoint written by kimik3.save."""

import base64
import builtins
import json

import pytest
import torch
from PIL import Image

import kimik3
from kimik3.cli import main
from kimik3.config import K3Config
from kimik3.model import K3ForConditionalGeneration
from kimik3.quant import pack_experts
from tests.helpers import CONFIGS, randomize


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The tiny config with a 512-token vocabulary: 256 byte ranks + K3's 256 specials."""
    d = json.loads((CONFIGS / "tiny.json").read_text())
    specials = {"bos_token_id": 256, "eos_token_id": 258, "pad_token_id": 511, "media_placeholder_token_id": 277}
    d.update(specials)
    d["text_config"].update(vocab_size=512, bos_token_id=256, eos_token_id=258, pad_token_id=511)
    cfg = K3Config.from_hf(d)
    model = pack_experts(randomize(K3ForConditionalGeneration(cfg, torch.float32), seed=3))
    path = kimik3.save(model, tmp_path_factory.mktemp("ck") / "tiny", experts="mxfp4")
    (path / "tiktoken.model").write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256)))
    return path


def run(args, capsys):
    rc = main(args)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_generate_raw_greedy_is_deterministic(ckpt, capsys):
    args = ["generate", "--model", str(ckpt), "--prompt", "ROMEO:", "--max-new-tokens", "6", "--temperature", "0"]
    rc, out1, err = run(args, capsys)
    assert rc == 0, err
    assert out1.startswith("ROMEO:")
    assert run(args, capsys)[1] == out1
    rc, streamed, _ = run(args + ["--stream"], capsys)
    assert rc == 0 and streamed == out1  # the prompt, the continuation, a newline: as without --stream


def test_generate_chat_and_image(ckpt, capsys, tmp_path):
    rc, out, err = run(["generate", "--model", str(ckpt), "--prompt", "hi", "--chat", "--max-new-tokens", "4",
                        "--seed", "1"], capsys)
    assert rc == 0, err
    img = tmp_path / "a.png"
    Image.new("RGBA", (45, 30), (10, 200, 30, 128)).save(img)
    rc, out, err = run(["generate", "--model", str(ckpt), "--prompt", "what is it?", "--image", str(img),
                        "--max-new-tokens", "3", "--temperature", "0", "--stream"], capsys)
    assert rc == 0, err


@pytest.mark.parametrize("extra, message", [
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "0"], "top_p"),
    (["--max-model-len", "3"], "the context holds 3 (--max-model-len): no room"),
    (["--image", "missing.png"], "missing.png"),
])
def test_generate_bad_input(ckpt, capsys, extra, message):
    rc, out, err = run(["generate", "--model", str(ckpt), "--prompt", "a longer prompt", *extra], capsys)
    assert rc == 2 and message in err


def test_generate_no_model(capsys, tmp_path):
    rc, _, err = run(["generate", "--model", str(tmp_path / "none"), "--prompt", "x"], capsys)
    assert rc == 2 and "no model at" in err


def test_chat_repl(ckpt, capsys, monkeypatch, tmp_path):
    img = tmp_path / "b.jpg"
    Image.new("RGB", (33, 70), (120, 30, 200)).save(img)
    lines = iter(["hello", "/think off", "/image " + str(img), "what colour?", "/image nope.png", "/reset",
                  "again", "/bogus", "/quit"])
    monkeypatch.setattr(builtins, "input", lambda prompt="": next(lines))
    rc, out, err = run(["chat", "--model", str(ckpt), "--max-new-tokens", "3", "--temperature", "0"], capsys)
    assert rc == 0, err
    assert "(thinking off)" in out and "attached" in out and "error:" in out and "(conversation cleared)" in out
    assert "commands:" in out


def test_chat_ctrl_c_stops_the_answer_not_the_program(ckpt, capsys, monkeypatch):
    """A real SIGINT in the middle of an answer: taken between two engine steps (the engine lives across turns),
    the answer stops, its request is aborted, and the next turn runs on the same engine."""
    import signal

    from kimik3.inference.engine import Engine

    step, calls = Engine.step, []

    def step_then_interrupt(engine):
        out = step(engine)
        calls.append(len(engine.requests))
        if len(calls) == 2:
            signal.raise_signal(signal.SIGINT)  # the handler runs now, inside the step's caller
        return out

    monkeypatch.setattr(Engine, "step", step_then_interrupt)
    lines = iter(["hello", "again", "/quit"])
    monkeypatch.setattr(builtins, "input", lambda prompt="": next(lines))
    rc, out, err = run(["chat", "--model", str(ckpt), "--max-new-tokens", "6", "--temperature", "0"], capsys)
    assert rc == 0 and out.count("(stopped)") == 1, (out, err)
    assert len(calls) > 4  # the second turn ran its steps after the first was cut


def test_chat_keeps_one_engine_and_its_second_turn_hits_the_first(ckpt, capsys, monkeypatch):
    """The REPL holds one engine (load_engine's) for the conversation: the second turn's prompt starts with the
    first turn's, whose end snapshot the prefix cache kept, so only the new tokens are computed."""
    from kimik3.inference.engine import Engine

    engines = []
    init = Engine.__init__
    monkeypatch.setattr(Engine, "__init__", lambda self, *a, **k: (engines.append(self), init(self, *a, **k))[1])
    lines = iter(["hello", "and again", "/quit"])
    monkeypatch.setattr(builtins, "input", lambda prompt="": next(lines))
    rc, out, err = run(["chat", "--model", str(ckpt), "--max-new-tokens", "4", "--temperature", "0"], capsys)
    assert rc == 0, err
    (engine,) = engines
    assert engine.stats["prefix_hit_tokens"] > 0 and engine.stats["prompt_tokens_total"] > 300
