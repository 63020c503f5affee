"""The whole tiny model on the GPU (fla KDA, SDPA/latent MLA, fast MoE and AttnRes) vs the CPU reference,
the cache invariant with the GPU kernels, and CUDA-graph decode == eager."""

import copy
import json

import pytest
import torch

from kimik3.config import K3Config
from kimik3.inference import SamplingParams, generate
from kimik3.inference.cuda_graph import GraphedDecoder
from kimik3.model import K3ForCausalLM
from tests.conftest import CONFIGS, randomize, rel_err


@pytest.fixture(scope="module")
def cfg():
    # fla's kernels want a power-of-two head dim of at least 32: the tiny config with KDA head_dim 64
    d = json.loads((CONFIGS / "tiny.json").read_text())
    d["text_config"]["linear_attn_config"]["head_dim"] = 64
    return K3Config.from_hf(d).text


@pytest.fixture(scope="module")
def cpu_model(cfg):
    return randomize(K3ForCausalLM(cfg, torch.float32), seed=51).eval()


def build(cfg, src, dtype, device="cpu"):
    """A model in `dtype` (fp32 islands kept fp32) holding `src`'s weights."""
    m = K3ForCausalLM(cfg, dtype)
    m.load_state_dict(src.state_dict())
    return m.to(device).eval()


@torch.no_grad()
@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 3e-2), (torch.float32, 5e-3)])
def test_gpu_model_matches_cpu_reference(cfg, cpu_model, dtype, tol):
    ids = torch.randint(0, 300, (2, 150))
    ref = build(cfg, cpu_model, dtype)(ids).float()
    out = build(cfg, cpu_model, dtype, "cuda")(ids.cuda()).float().cpu()
    print(f"gpu vs cpu {dtype}: {rel_err(out, ref):.2e}")
    assert rel_err(out, ref) < tol


@torch.no_grad()
def test_gpu_prefill_decode_equals_full(cpu_model):
    model = copy.deepcopy(cpu_model).cuda()
    ids = torch.randint(0, 300, (3, 90), device="cuda")
    full = model(ids)
    cache = model.new_cache(3, 90)
    parts = [model(ids[:, :40], cache=cache)] + [model(ids[:, t:t + 1], cache=cache) for t in range(40, 90)]
    err = rel_err(torch.cat(parts, 1), full)
    print(f"gpu fp32 prefill+decode vs full: {err:.2e}")
    assert err < 5e-3


@torch.no_grad()
def test_cuda_graph_decode_equals_eager(cfg, cpu_model):
    model = build(cfg, cpu_model, torch.bfloat16, "cuda")
    ids = torch.randint(0, 300, (4, 33), device="cuda")
    eager_cache, graph_cache = model.new_cache(4, 64), model.new_cache(4, 64)
    model(ids, cache=eager_cache), model(ids, cache=graph_cache)
    decoder = GraphedDecoder(model, graph_cache)
    tokens = torch.randint(0, 300, (4,), device="cuda")
    for _ in range(10):
        a = model(tokens[:, None], cache=eager_cache)[:, -1]
        b = decoder(tokens).clone()
        assert rel_err(b.float(), a.float()) < 1e-2
        tokens = a.argmax(-1)
    p = SamplingParams(temperature=0, max_new_tokens=12)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10]]
    assert [c.token_ids for c in generate(model, prompts, p, cuda_graph=True)] == \
        [c.token_ids for c in generate(model, prompts, p)]


@torch.no_grad()
def test_left_padded_batch_on_gpu(cpu_model):
    model = copy.deepcopy(cpu_model).cuda()
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13]]
    p = SamplingParams(temperature=0, max_new_tokens=8)
    batched = [c.token_ids for c in generate(model, prompts, p)]
    alone = [generate(model, [q], p)[0].token_ids for q in prompts]
    assert batched == alone
