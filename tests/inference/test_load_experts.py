"""`load_engine` keeps MXFP4 routed experts packed where Humming's kernels will run them (re-laid out in place),
instead of decoding them to bf16 first (4x the bytes, and the bf16 grouped GEMM instead of Humming's); elsewhere it
decodes them once, as before."""

import dataclasses

import pytest
import torch

from kimik3.checkpoint.source import read_config
from kimik3.inference import SamplingParams, load, load_engine
from kimik3.model.moe import Experts, MXFP4Experts
from kimik3.presets import DEMO_MODEL


@pytest.fixture
def backend(monkeypatch):
    """Make `experts_backend` answer as it would on a Hopper GPU (or not), recording what it was asked."""
    import kimik3.ops.moe as moe

    asked = []

    def choose(answer):
        monkeypatch.setattr(moe, "experts_backend", lambda *a: asked.append(a) or answer)
        return asked

    return choose


def test_packed_where_humming_runs_them(backend):
    asked = backend("humming")
    assert load.experts_packed(DEMO_MODEL, "cuda", None, adapters=False)
    cfg = read_config(DEMO_MODEL)
    assert asked == [(torch.device("cuda"), torch.bfloat16, cfg.text.moe.latent_dim, cfg.text.moe.expert_dim)]


def test_decoded_elsewhere(backend, monkeypatch):
    asked = backend("triton")
    assert not load.experts_packed(DEMO_MODEL, "cuda", torch.bfloat16, adapters=False)  # Humming cannot take them
    assert not load.experts_packed(DEMO_MODEL, "cpu", None, adapters=False) and len(asked) == 1  # never asked
    assert load.experts_packed(DEMO_MODEL, "cpu", None, adapters=True)  # adapters run over the stored codes
    cfg = read_config(DEMO_MODEL)
    dense = dataclasses.replace(cfg, storage=dataclasses.replace(cfg.storage, experts="bf16"))
    monkeypatch.setattr(load, "read_config", lambda path: dense)
    backend("humming")
    assert not load.experts_packed(DEMO_MODEL, "cuda", None, adapters=False)  # packing dense experts would be lossy


@torch.no_grad()
def test_the_engine_loads_what_experts_packed_says(monkeypatch):
    """Packed, the demo's experts are MXFP4Experts (on the CPU nothing re-lays them out) and greedy text is the
    decoded model's: MXFP4 values are exact in bf16."""
    params = SamplingParams(temperature=0, max_new_tokens=12)
    prompt = [list(b"ROMEO:")]
    texts = []
    for packed in (False, True):
        monkeypatch.setattr(load, "experts_packed", lambda *a, packed=packed, **k: packed)
        engine = load_engine(DEMO_MODEL, device="cpu")
        kinds = {type(m) for m in engine.model.modules() if isinstance(m, (Experts, MXFP4Experts))}
        assert kinds == {MXFP4Experts if packed else Experts}
        texts.append(engine.generate(prompt, params)[0].outputs[0].token_ids)
    assert texts[0] == texts[1]
