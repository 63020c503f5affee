"""`load_engine` keeps MXFP4 routed experts packed where Humming's kernels will run them (re-laid out in place),
instead of decoding them to bf16 first (4x the bytes, and the bf16 grouped GEMM instead of Humming's); elsewhere it
decodes them once, as before."""

import base64
import dataclasses
import json

import pytest
import torch

from kimik3.checkpoint.source import read_config
from kimik3.inference import SamplingParams, load, load_engine
from kimik3.model.moe import Experts, MXFP4Experts
from kimik3.presets import DEMO_MODEL
from tests.helpers import rel_err, requires_cuda


@pytest.fixture
def backend(monkeypatch):
    """Make `experts_backend` answer as it would on a Hopper GPU (or not), recording what it was asked."""
    import kimik3.ops.moe as moe

    asked = []

    def choose(answer):
        monkeypatch.setattr(moe, "experts_backend", lambda *a: asked.append(a) or answer)
        return asked

    return choose


def test_packed_where_humming_runs_them(backend, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    asked = backend("humming")
    assert load.experts_packed(DEMO_MODEL, "cuda", None, adapters=False)
    cfg = read_config(DEMO_MODEL)
    assert asked == [(torch.device("cuda"), torch.bfloat16, cfg.text.moe.latent_dim, cfg.text.moe.expert_dim)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # --device cuda without one: the load says so
    assert not load.experts_packed(DEMO_MODEL, "cuda", None, adapters=False) and len(asked) == 1


def test_decoded_elsewhere(backend, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
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


def _humming_width_checkpoint(root) -> str:
    """The tiny config at widths Humming takes (latent 256, expert 128), random bf16 weights, experts stored MXFP4."""
    import kimik3
    from kimik3.config import K3Config
    from kimik3.model import K3ForConditionalGeneration
    from kimik3.quant import pack_experts
    from tests.helpers import CONFIGS, randomize

    d = json.loads((CONFIGS / "tiny.json").read_text())  # with a 512-token vocabulary: 256 byte ranks + specials
    d.update(bos_token_id=256, eos_token_id=258, pad_token_id=511, media_placeholder_token_id=277)
    d["text_config"].update(vocab_size=512, bos_token_id=256, eos_token_id=258, pad_token_id=511,
                            routed_expert_hidden_size=256, moe_intermediate_size=128)
    model = pack_experts(randomize(K3ForConditionalGeneration(K3Config.from_hf(d), torch.bfloat16), seed=5))
    path = kimik3.save(model, root / "humming-widths", experts="mxfp4")
    (path / "tiktoken.model").write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256)))
    return path


@pytest.mark.gpu
@requires_cuda
@torch.no_grad()
def test_load_engine_runs_humming_on_the_stored_codes_gpu(tmp_path):
    """On a Hopper GPU with humming-kernels: the experts load packed and are re-laid out (no bf16 copy), and greedy
    decoding follows the engine that decodes them to bf16 (`KIMIK3_MOE_BACKEND=triton`) as other kernels do."""
    from kimik3.model.moe import RelaidExperts
    from kimik3.ops.backend import use_backend
    from kimik3.ops.moe import experts_backend

    if experts_backend(torch.device("cuda"), torch.bfloat16, 256, 128) != "humming":
        pytest.skip("Humming cannot run here (needs sm_90 and humming-kernels)")
    path = _humming_width_checkpoint(tmp_path)
    params = SamplingParams(temperature=0, max_new_tokens=8, logprobs=0)
    prompt = [list(range(3, 40))]
    engine = load_engine(path, device="cuda")
    experts = [m for m in engine.model.modules() if isinstance(m, (Experts, MXFP4Experts, RelaidExperts))]
    assert experts and all(isinstance(m, RelaidExperts) for m in experts)
    got = engine.generate(prompt, params)[0].outputs[0]
    with use_backend(moe="triton"):
        decoded = load_engine(path, device="cuda")
        assert all(isinstance(m, Experts) for m in decoded.model.modules() if isinstance(m, (Experts, MXFP4Experts)))
        ref = decoded.generate(prompt, params)[0].outputs[0]
    assert got.token_ids[:4] == ref.token_ids[:4]
    a = torch.tensor([lp.logprob for lp in got.logprobs[:4]])
    b = torch.tensor([lp.logprob for lp in ref.logprobs[:4]])
    assert rel_err(a, b) < 2e-2
