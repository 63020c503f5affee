"""`kimik3 generate/chat/params/memory` as a new user meets them: text-only models, the context bound, bad
input (one line and status 2, never a traceback), styling only on a terminal, backslash escapes in --stop."""

import base64
import builtins
import io
import json

import pytest
import torch
from PIL import Image

import kimik3
from kimik3.cli import main
from kimik3.cli.chat import ChatPrinter
from kimik3.cli.common import unescape
from kimik3.config import K3Config
from kimik3.inference.engine import EngineConfig
from kimik3.model import K3ForConditionalGeneration
from kimik3.tokenizer import Tokenizer
from tests.helpers import CONFIGS, randomize

POSITIONS = 96  # the text-only checkpoint's max_position_embeddings: small, so "the whole context" is quick


@pytest.fixture(scope="module")
def text_ckpt(tmp_path_factory):
    """A text-only tiny K3 (no vision_config) with a 512-token vocabulary (256 byte ranks + K3's specials)."""
    d = json.loads((CONFIGS / "tiny.json").read_text())
    d.pop("vision_config", None)
    d.update(bos_token_id=256, eos_token_id=258, pad_token_id=511, media_placeholder_token_id=277)
    d["text_config"].update(vocab_size=512, bos_token_id=256, eos_token_id=258, pad_token_id=511,
                            max_position_embeddings=POSITIONS)
    cfg = K3Config.from_hf(d)
    assert cfg.vision is None and cfg.text.max_position_embeddings == POSITIONS
    model = randomize(K3ForConditionalGeneration(cfg, torch.float32), seed=5)
    path = kimik3.save(model, tmp_path_factory.mktemp("ck") / "text", experts="bf16", dtype=torch.float32)
    (path / "tiktoken.model").write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256)))
    return path


def run(args, capsys):
    rc = main(args)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_chat_with_the_default_model(capsys, monkeypatch, tmp_path):
    """The bundled demo model is text-only: `kimik3 chat` (no --model) answers, and /image says why not."""
    img = tmp_path / "a.png"
    Image.new("RGB", (30, 20), (1, 2, 3)).save(img)
    lines = iter(["hello", f"/image {img}", "/quit"])
    monkeypatch.setattr(builtins, "input", lambda prompt="": next(lines))
    rc, out, err = run(["chat", "--device", "cpu", "--max-new-tokens", "3", "--temperature", "0"], capsys)
    assert rc == 0, err
    assert "reads text only" in out and "attached" not in out and "/image FILE" not in out


def test_images_on_a_text_only_model_are_a_clear_error(text_ckpt, capsys, tmp_path):
    img = tmp_path / "a.png"
    Image.new("RGB", (30, 20), (1, 2, 3)).save(img)
    for cmd in (["generate", "--prompt", "what is it?"], ["chat"]):
        rc, out, err = run([*cmd, "--model", str(text_ckpt), "--image", str(img)], capsys)
        assert rc == 2 and "text-only" in err and "no vision_config" in err and "Traceback" not in err


def test_library_bounds_prompt_plus_new_tokens_by_the_model(text_ckpt):
    model = kimik3.load(text_ckpt, dtype=torch.float32).eval()
    sp = kimik3.inference.SamplingParams
    over = POSITIONS - 4  # 5 prompt tokens + this: one more than the model holds
    with pytest.raises(ValueError, match=f"5 tokens \\+ max_new_tokens {over} exceed the model's {POSITIONS} "):
        kimik3.inference.generate(model, [[1, 2, 3, 4, 5]], sp(max_new_tokens=over))
    with pytest.raises(ValueError, match=f"max_model_len {POSITIONS + 1} exceeds the model's {POSITIONS} positions"):
        kimik3.inference.generate(model, [[1]], sp(max_new_tokens=1), config=EngineConfig(max_model_len=POSITIONS + 1))
    with pytest.raises(ValueError, match=f"a prompt of {POSITIONS} tokens leaves no room"):
        kimik3.inference.generate(model, [[7] * POSITIONS], sp(max_new_tokens=1))
    with pytest.raises(ValueError, match="max_model_len must be an integer >= 2"):
        EngineConfig(max_model_len=1)
    out = kimik3.inference.generate(model, [[1, 2, 3, 4, 5]], sp(temperature=0, max_new_tokens=over - 1))[0]
    assert len(out.token_ids) == over - 1 or out.finish_reason == "stop"  # exactly fills the context: allowed
    huge = sp(temperature=0, max_new_tokens=10**9)  # with max_model_len: stops there, nothing 10**9 long allocated
    out = kimik3.inference.generate(model, [[1, 2, 3, 4, 5]], huge, config=EngineConfig(max_model_len=POSITIONS))[0]
    assert len(out.token_ids) <= POSITIONS - 5 and out.finish_reason in ("length", "stop")


def test_cli_stops_at_the_context_with_a_note(text_ckpt, capsys):
    base = ["generate", "--model", str(text_ckpt), "--prompt", "ROMEO:", "--temperature", "0"]
    rc, out, err = run([*base, "--max-new-tokens", "1000000000"], capsys)
    assert rc == 0, err
    assert f"the context holds {POSITIONS} tokens (the model's max_position_embeddings)" in err
    assert "not max_new_tokens 1,000,000,000" in err
    rc, out, err = run([*base, "--max-new-tokens", "100000", "--max-model-len", "12"], capsys)
    assert rc == 0 and "the context holds 12 tokens (--max-model-len)" in err
    rc, out, err = run([*base, "--max-new-tokens", "3"], capsys)
    assert rc == 0 and "note" not in err  # fits: nothing to say


@pytest.mark.parametrize("extra, message", [
    (["--temperature", "inf"], "temperature must be a finite number, got inf"),
    (["--temperature", "nan"], "temperature must be a finite number, got nan"),
    (["--temperature", "-0.5"], "temperature must be >= 0"),
    (["--repetition-penalty", "inf"], "repetition_penalty must be a finite number"),
    (["--seed", str(2**70)], "seed must be None or an integer"),
    (["--max-new-tokens", "0"], "max_new_tokens must be an integer >= 1"),
    (["--max-model-len", "1"], "--max-model-len must be an integer >= 2"),
    (["--max-model-len", str(POSITIONS + 1)], f"exceeds the model's {POSITIONS} positions"),
    (["--max-context", str(POSITIONS + 1)], f"--max-model-len {POSITIONS + 1} exceeds the model's"),
    (["--max-context", "12", "--max-model-len", "13"], "--max-context is the old name of --max-model-len"),
    (["--max-num-seqs", "0"], "--max-num-seqs must be an integer >= 1"),
    (["--max-num-batched-tokens", "8"], "--max-num-batched-tokens must be an integer >= 64"),
    (["--no-prefix-cache", "--prefix-cache-bytes", "100"], "--prefix-cache-bytes sizes the prefix cache"),
    (["--device", "banana"], "banana"),
    (["--threads", "10000"], "--threads must be from 1 to"),  # torch took it and segfaulted in the first matmul
    (["--threads", "0"], "--threads must be from 1 to"),
    (["--stop", r"\xZZ"], r"--stop '\xZZ': malformed escape \xZZ: \x takes 2 hex digits"),
    (["--stop", r"ab\u12"], r"\u takes 4 hex digits"),
])
def test_generate_rejects_bad_values_before_loading(text_ckpt, capsys, monkeypatch, extra, message):
    if extra[0] != "--device":  # the device is the loader's to check
        monkeypatch.setattr(kimik3, "load", lambda *a, **k: pytest.fail("loaded before checking the flags"))
    rc, _, err = run(["generate", "--model", str(text_ckpt), "--prompt", "x", *extra], capsys)
    # one error line (a deprecated alias's warning may come before it)
    assert rc == 2 and message in err and "Traceback" not in err, err
    assert err.count("\n") == 1 + err.count(": warning: "), err


def test_a_misspelt_moe_backend_stops_before_loading(text_ckpt, capsys, monkeypatch):
    import kimik3

    monkeypatch.setenv("KIMIK3_MOE_BACKEND", "hummingbird")
    monkeypatch.setattr(kimik3, "load", lambda *a, **k: pytest.fail("loaded before checking KIMIK3_MOE_BACKEND"))
    for command in (["generate", "--prompt", "x"], ["serve", "--port", "0"]):
        rc, _, err = run([command[0], "--model", str(text_ckpt), *command[1:]], capsys)
        assert rc == 2 and "KIMIK3_MOE_BACKEND must be one of" in err and "Traceback" not in err, err


def test_generate_bad_files(text_ckpt, capsys, tmp_path):
    binary, empty, notes = tmp_path / "p.bin", tmp_path / "empty.txt", tmp_path / "notes.png"
    binary.write_bytes(b"\xff\xfe\xfa\x00")
    empty.write_text("")
    notes.write_text("not an image")
    no_tok = tmp_path / "no_tokenizer"
    no_tok.mkdir()
    for f in text_ckpt.iterdir():
        if f.name != "tiktoken.model":
            (no_tok / f.name).write_bytes(f.read_bytes())
    bad_gen = tmp_path / "bad_gen"
    bad_gen.mkdir()
    for f in text_ckpt.iterdir():
        (bad_gen / f.name).write_bytes(f.read_bytes())
    (bad_gen / "generation_config.json").write_text('{"temperature": "hot"}')
    m = ["--model", str(text_ckpt)]
    cases = [
        ([*m, "--prompt-file", str(tmp_path / "missing.txt")], "--prompt-file", "missing.txt: no such file"),
        ([*m, "--prompt-file", str(tmp_path)], f"--prompt-file {tmp_path}: a folder; expected a UTF-8 text file"),
        ([*m, "--prompt-file", str(binary)], "p.bin: not UTF-8 text", ""),
        ([*m, "--prompt-file", str(empty)], "empty.txt: the prompt is empty", ""),
        ([*m, "--prompt", "x", "--image", str(notes)], "notes.png: not a readable image", ""),
        (["--model", str(no_tok), "--prompt", "x"], "no tokenizer (tiktoken.model)", ""),
        (["--model", str(bad_gen), "--prompt", "x"], "generation_config.json: sampling parameter temperature", ""),
        (["--model", str(tmp_path / "nowhere"), "--prompt", "x"], "no model at", "nowhere"),
    ]
    for args, *messages in cases:
        rc, _, err = run(["generate", *args], capsys)
        assert rc == 2 and all(s in err for s in messages) and "BytesIO" not in err, (args, err)


def test_prompt_file_is_the_prompt(text_ckpt, capsys, tmp_path, monkeypatch):
    f = tmp_path / "prompt.txt"
    f.write_text("ROMEO:\nnaïve ")
    base = ["generate", "--model", str(text_ckpt), "--max-new-tokens", "4", "--temperature", "0"]
    rc, from_file, err = run([*base, "--prompt-file", str(f)], capsys)
    assert rc == 0, err
    assert run([*base, "--prompt", "ROMEO:\nnaïve "], capsys)[1] == from_file
    monkeypatch.setattr("sys.stdin", io.StringIO("ROMEO:\nnaïve "))
    assert run([*base, "--prompt-file", "-"], capsys)[1] == from_file


@pytest.mark.parametrize("config", ["nowhere", "empty_folder", "bad.json"])
@pytest.mark.parametrize("command", ["params", "memory"])
def test_params_and_memory_bad_configs(capsys, tmp_path, command, config):
    (tmp_path / "empty_folder").mkdir()
    (tmp_path / "bad.json").write_text("{not json")
    rc, _, err = run([command, str(tmp_path / config)], capsys)
    assert rc == 2 and config in err and "Traceback" not in err, err


def test_memory_refuses_a_context_past_the_model(capsys):
    for context in ("5000", "99999999999999999999"):
        rc, out, err = run(["memory", "tiny", "--context", context, "--json"], capsys)
        assert rc == 2 and out == "" and "exceeds the model's 4,096 positions" in err and err.count("\n") == 1, err
    rc, out, err = run(["memory", "tiny", "--context", "4096", "--json"], capsys)
    assert rc == 0 and err == ""
    assert run(["memory", "tiny", "--json"], capsys)[1] == out  # the default: the model's positions when fewer


def test_stop_escapes():
    for bad in (r"\xZZ", r"a\x4", r"\u12g4"):
        with pytest.raises(ValueError, match="malformed escape"):
            unescape(bad)
    assert unescape(r"\\xZZ") == r"\xZZ"  # an escaped backslash before x is no escape
    assert unescape(r"\n\n") == "\n\n"
    assert unescape(r"a\tb\r\\n") == "a\tb\r\\n"  # \\ is one backslash, so \\n stays a backslash and an n
    assert unescape(r"\x41\u00e9") == "Aé"
    assert unescape("naïve \\q \\") == "naïve \\q \\"  # unknown escapes and non-ASCII text are kept


def test_stop_flag_is_unescaped_end_to_end(text_ckpt, capsys):
    base = ["generate", "--model", str(text_ckpt), "--prompt", "ab", "--max-new-tokens", "12", "--temperature", "0"]
    rc, full, _ = run(base, capsys)
    tail = full[2:].rstrip("\n")
    char = next((c for c in tail[1:] if 32 < ord(c) < 127), None)
    assert rc == 0 and char is not None, full  # greedy text of printable bytes: something to stop at
    rc, cut, err = run([*base, "--stop", f"\\x{ord(char):02x}"], capsys)
    assert rc == 0, err
    assert cut == "ab" + tail[: tail.index(char)] + "\n"


def test_reasoning_is_styled_only_on_a_terminal(text_ckpt, capsys):
    tok = Tokenizer.from_file(text_ckpt)
    for style, has_escape in ((False, False), (True, True)):
        printer = ChatPrinter(tok, thinking=True, style=style)
        for t in tok.encode("thinking..."):
            printer.feed(t)
        printer.finish()
        out = capsys.readouterr().out
        assert "thinking..." in out.replace("\033[2m", "").replace("\033[0m", "")
        assert ("\033[" in out) == has_escape
    # unstyled, a line break parts the reasoning from the answer
    sp = tok.encode_special
    ids = [*tok.encode("hmm"), sp("<|close|>"), *tok.encode("think"), sp("<|sep|>"), sp("<|open|>"),
           *tok.encode("response"), sp("<|sep|>"), *tok.encode("The answer.")]
    printer = ChatPrinter(tok, thinking=True, style=False)
    for t in ids:
        printer.feed(t)
    parsed = printer.finish()
    assert (parsed.reasoning_content, parsed.content) == ("hmm", "The answer.")
    assert capsys.readouterr().out == "hmm\nThe answer.\n"
    # the CLI into a file or pipe (capsys is not a terminal): plain text, reasoning included (the bundled model:
    # the chat prompt's system message about thinking effort is longer than the tiny checkpoint's context)
    for stream in ("--stream", "--no-stream"):
        rc, out, err = run(["generate", "--device", "cpu", "--prompt", "hi", "--chat", "--max-new-tokens", "8",
                            "--seed", "0", stream], capsys)
        assert rc == 0 and out.strip() and "\033" not in out, err
    rc, _, err = run(["generate", "--model", str(text_ckpt), "--prompt", "hi", "--chat"], capsys)
    assert rc == 2 and f"the context holds {POSITIONS} (the model's max_position_embeddings): no room" in err


def test_images_on_a_checkpoint_without_vision_tensors(capsys, tmp_path):
    """config.json has a vision_config but the shards hold no vision_tower.* tensors: text loads, images don't."""
    d = json.loads((CONFIGS / "tiny.json").read_text())
    d.update(bos_token_id=256, eos_token_id=258, pad_token_id=511, media_placeholder_token_id=277)
    d["text_config"].update(vocab_size=512, bos_token_id=256, eos_token_id=258, pad_token_id=511)
    cfg = K3Config.from_hf(d)
    model = randomize(K3ForConditionalGeneration(cfg, torch.float32, text_only=True), seed=6)
    path = kimik3.save(model, tmp_path / "ck", experts="bf16", dtype=torch.float32)
    written = json.loads((path / "config.json").read_text())
    written["vision_config"] = d["vision_config"]  # as other implementations' text-only test checkpoints do
    (path / "config.json").write_text(json.dumps(written))
    (path / "tiktoken.model").write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256)))
    img = tmp_path / "a.png"
    Image.new("RGB", (30, 20), (1, 2, 3)).save(img)
    base = ["generate", "--model", str(path), "--max-new-tokens", "2", "--temperature", "0"]
    rc, _, err = run([*base, "--prompt", "x"], capsys)
    assert rc == 0, err
    rc, _, err = run([*base, "--prompt", "what is it?", "--image", str(img)], capsys)
    assert rc == 2 and "holds no vision tower tensors" in err, err


def test_chat_says_when_the_conversation_fills_the_context(text_ckpt, capsys, monkeypatch):
    too_long = "a message far too long for what is left of a context of ninety-six tokens"
    lines = iter(["hi", too_long, "/reset", "hi", "/quit"])
    monkeypatch.setattr(builtins, "input", lambda prompt="": next(lines))
    rc, out, err = run(["chat", "--model", str(text_ckpt), "--no-think", "--max-new-tokens", "4", "--temperature",
                        "0"], capsys)
    assert rc == 0, err
    assert out.count(f"the context holds {POSITIONS} (the model's max_position_embeddings): no room") == 1
    assert "/reset starts the conversation again" in out and "(conversation cleared)" in out


def test_out_of_memory_is_one_line_and_other_errors_keep_their_traceback(text_ckpt, capsys, monkeypatch):
    import kimik3.inference as inference

    def failing(message):
        def stream(*a, **k):
            raise RuntimeError(message)
            yield  # a generator, like the real one

        return stream

    args = ["generate", "--model", str(text_ckpt), "--prompt", "x", "--max-new-tokens", "2"]
    monkeypatch.setattr(inference, "engine_stream", failing("DefaultCPUAllocator: can't allocate memory: you tried to "
                                                     "allocate 192000000192 bytes"))
    rc, _, err = run(args, capsys)
    assert rc == 1 and err.startswith("kimik3 generate: error: out of memory") and "192000000192 bytes" in err
    monkeypatch.setattr(inference, "engine_stream", failing("an internal bug"))
    with pytest.raises(RuntimeError, match="an internal bug"):
        main(args)
