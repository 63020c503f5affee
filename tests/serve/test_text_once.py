"""Text is made once: the server decodes a request's ids, except where the engine matches its stop strings
(/v1/completions: the request ends at the very token), and then the server takes the engine's text; each generated
id is decoded once and a stop string matched once. The seam is typed: the engine and the tests' stand-in are
`EngineLike`."""

from __future__ import annotations

import httpx
import pytest
import torch

import kimik3
from kimik3.inference.engine import Engine, EngineConfig
from kimik3.presets import DEMO_MODEL
from kimik3.serve import Server, ServerConfig
from kimik3.serve.runner import EngineLike
from kimik3.tokenizer import Tokenizer
from tests.serve.conftest import running
from tests.serve.scripted import ScriptedEngine


@pytest.fixture(scope="module")
def model():
    return kimik3.load(DEMO_MODEL, dtype=torch.float32, text_only=True, quiet=True).eval()


def test_every_id_is_decoded_once_and_the_engine_matches_no_stop_string(model, monkeypatch):
    tok = Tokenizer.from_file(DEMO_MODEL)
    engine = Engine(model, EngineConfig(max_num_seqs=4, max_num_batched_tokens=256), eos_token_ids=(tok.eos_id,),
                    tokenizer=tok)  # as load_engine builds it: with the tokenizer
    decoded, added = [], []
    real_decode, real_add = tok.decode_bytes, engine.add_request
    monkeypatch.setattr(tok, "decode_bytes", lambda ids: (decoded.extend(ids), real_decode(ids))[1])
    monkeypatch.setattr(engine, "add_request", lambda r: (added.append(r), real_add(r))[1])
    server = Server(ServerConfig(model_name="demo"))
    server.attach(engine, tok, vocab_size=model.config.text.vocab_size)
    with running(server) as url:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 12, "temperature": 0,
                                                        "ignore_eos": True}, timeout=120).json()
        n = r["usage"]["completion_tokens"]
        assert n == 12 and len(decoded) == n  # the engine decoded none of them, the server each once
        assert added[-1].params.stop == () and added[-1].params.detokenize is False
        text = r["choices"][0]["text"]
        stop = text[3:6]
        decoded.clear()
        s = httpx.post(f"{url}/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 12, "temperature": 0,
                                                        "ignore_eos": True, "stop": [stop]}, timeout=120).json()
        # the engine matched the stop string over the text it made; the server decoded nothing more
        assert added[-1].params.stop == (stop,) and added[-1].params.detokenize is True
        assert len(decoded) == s["usage"]["completion_tokens"] < n
        decoded.clear()
        chat = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "Speak"}],
                                                                "max_tokens": 8, "stop": ["zz"]}, timeout=120).json()
        assert added[-1].params.stop == () and added[-1].params.detokenize is False  # chat's: over parsed content
        assert chat["usage"]["completion_tokens"] == 8
    assert s["choices"][0]["text"] == text[: text.find(stop)] and s["choices"][0]["stop_reason"] == stop
    assert s["choices"][0]["finish_reason"] == "stop"


def test_the_engine_and_the_scripted_stand_in_are_engine_like(model):
    assert isinstance(Engine(model, EngineConfig(max_num_seqs=1, max_model_len=64)), EngineLike)
    assert isinstance(ScriptedEngine(lambda p, i: [1], eos_id=2), EngineLike)


def test_a_request_for_no_text_gets_none_and_stop_strings_need_text(model):
    from kimik3.inference import SamplingParams

    tok = Tokenizer.from_file(DEMO_MODEL)
    engine = Engine(model, EngineConfig(max_num_seqs=2, max_model_len=64), tokenizer=tok)
    quiet, text = (engine.generate([tok.encode("ROMEO:")], SamplingParams(temperature=0, max_new_tokens=4,
                                                                          detokenize=d))[0].outputs[0]
                   for d in (False, True))
    assert quiet.token_ids == text.token_ids and quiet.text == "" and text.text == tok.decode(text.token_ids)
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=("x",), detokenize=False)
