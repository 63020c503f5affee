"""Gradients of every piece of the model against fp64 finite differences (torch.autograd.gradcheck).

The model enters its fp32 islands with `.float()`. Under `fp64_islands()` an fp64 tensor's `.float()` is the
identity, so an fp64 module computes entirely in fp64 and gradcheck runs at its default tolerances. The routed
experts accumulate into an explicit fp32 buffer, so the MoE is checked with fp32 islands against central
differences at a matching tolerance, with the routing held fixed (top-k is piecewise constant).
"""

from __future__ import annotations

import contextlib
import copy
from unittest import mock

import pytest
import torch
from torch.func import functional_call

from kimik3.config import K3Config
from kimik3.model import K3ForCausalLM
from kimik3.model.kda import KimiDeltaAttention
from kimik3.model.mla import MultiHeadLatentAttention
from kimik3.model.moe import LatentMoE
from kimik3.ops.attnres import attn_res_mix
from kimik3.ops.situ import situ_glu
from tests.helpers import randomize, rel_err

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@contextlib.contextmanager
def fp64_islands():
    original = torch.Tensor.float

    def keep_fp64(self, *args, **kwargs):
        return self if self.dtype == torch.float64 else original(self, *args, **kwargs)

    with mock.patch.object(torch.Tensor, "float", keep_fp64):
        yield


def _gradcheck_module(module: torch.nn.Module, *inputs: torch.Tensor, kwargs: dict | None = None) -> None:
    """gradcheck of module(*inputs) w.r.t. the float inputs and every parameter, fp64, fast mode."""
    names = [n for n, _ in module.named_parameters()]
    params = [p.detach().clone().requires_grad_() for p in module.parameters()]
    floats = [x.detach().clone().requires_grad_() if x.is_floating_point() else x for x in inputs]

    def fn(*flat):
        xs, ps = flat[:len(floats)], flat[len(floats):]
        return functional_call(module, dict(zip(names, ps)), tuple(xs), kwargs or {})

    with fp64_islands():
        assert torch.autograd.gradcheck(fn, (*floats, *params), fast_mode=True)


def _text_config(tiny_config: K3Config, kinds: list[str], dense: int) -> K3Config:
    """The tiny config cut to `kinds` layers ("kda"/"mla"), the first `dense` with the dense MLP (no MoE)."""
    hf = copy.deepcopy(tiny_config.hf)
    t = hf["text_config"]
    t["num_hidden_layers"], t["first_k_dense_replace"] = len(kinds), dense
    t["linear_attn_config"]["kda_layers"] = [i + 1 for i, k in enumerate(kinds) if k == "kda"]
    t["linear_attn_config"]["full_attn_layers"] = [i + 1 for i, k in enumerate(kinds) if k == "mla"]
    t["attn_res_block_size"] = 2
    return K3Config.from_hf(hf)


@pytest.mark.parametrize("packed", [False, True])
def test_kda_layer(tiny_config, packed):
    layer = randomize(KimiDeltaAttention(tiny_config.text, torch.float64), seed=1).double()  # islands too
    x = torch.randn(1, 5, tiny_config.text.hidden_size, dtype=torch.float64)
    _gradcheck_module(layer, x, kwargs={"cu_seqlens": torch.tensor([0, 2, 5])} if packed else None)


@pytest.mark.parametrize("packed", [False, True])
def test_mla_layer(tiny_config, packed):
    layer = randomize(MultiHeadLatentAttention(tiny_config.text, torch.float64), seed=2).double()
    x = torch.randn(1, 6, tiny_config.text.hidden_size, dtype=torch.float64)
    _gradcheck_module(layer, x, kwargs={"cu_seqlens": torch.tensor([0, 4, 6])} if packed else None)


def test_attn_res_mix():
    D = 7
    blocks, partial = torch.randn(3, 2, 4, D, dtype=torch.float64), torch.randn(2, 4, D, dtype=torch.float64)
    norm_w, proj_w = 1 + 0.2 * torch.randn(D, dtype=torch.float64), 0.5 * torch.randn(1, D, dtype=torch.float64)
    args = [t.requires_grad_() for t in (blocks, partial, norm_w, proj_w)]
    with fp64_islands():
        assert torch.autograd.gradcheck(lambda b, p, n, w: attn_res_mix(b, p, n, w, 1e-5), args)


def test_situ_glu():
    gate, up = (6 * torch.randn(5, 9, dtype=torch.float64)).requires_grad_(), \
        (30 * torch.randn(5, 9, dtype=torch.float64)).requires_grad_()
    with fp64_islands():
        assert torch.autograd.gradcheck(lambda g, u: situ_glu(g, u, 4.0, 25.0), (gate, up))


@pytest.mark.parametrize("kinds", [["kda"], ["kda", "mla", "kda"]])
def test_dense_text_model(tiny_config, kinds):
    """Embedding, KDA/MLA, dense SiTU MLP, AttnRes (with stored blocks), final mix, norm and LM head, packed."""
    cfg = _text_config(tiny_config, kinds, dense=len(kinds))
    model = randomize(K3ForCausalLM(cfg.text, torch.float64), seed=4).double()
    ids = torch.randint(0, cfg.text.vocab_size, (1, 5))
    _gradcheck_module(model, ids, kwargs={"cu_seqlens": torch.tensor([0, 3, 5])})


@pytest.mark.parametrize("kind", ["kda", "mla"])
def test_fp32_gradients_match_fp64(tiny_config, kind):
    """The fp32 model's gradients (fp32 islands) are within fp32 noise of the fp64 ones."""
    cfg = _text_config(tiny_config, [kind, kind], dense=2)
    m64 = randomize(K3ForCausalLM(cfg.text, torch.float64), seed=5).double()
    m32 = copy.deepcopy(m64).float()
    ids = torch.randint(0, cfg.text.vocab_size, (1, 40))
    with fp64_islands():
        m64(ids).pow(2).mean().backward()
    m32(ids).pow(2).mean().backward()
    for (name, p64), p32 in zip(m64.named_parameters(), m32.parameters()):
        if p64.grad is None:  # layer 0's attention-input mix has no stored blocks to mix yet
            assert p32.grad is None and "layers.0.self_attention_res" in name
            continue
        assert rel_err(p32.grad, p64.grad) < 1e-4, name


def _moe_loss(moe: LatentMoE, params: dict, x: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    idx, _, _ = functional_call(moe.gate, {"weight": params["gate.weight"]}, (x,))
    return (functional_call(moe, params, (x,)) * u).sum(), idx.sort(-1).values  # the selected sets


def test_latent_moe_fixed_routing(tiny_config):
    """d loss / d every MoE parameter (router included, through the combine weights) vs central differences.

    fp64 parameters with the model's fp32 islands: a central difference carries fp32 rounding / eps (~4e-3
    relative at eps = 1e-3 here) plus O(eps^2) truncation (~1e-4 at 1e-2), so unit directions, eps = 1e-2 and
    2e-3 relative. The tokens are those with the widest top-k margins, and the routing is checked unchanged.
    """
    moe = randomize(LatentMoE(tiny_config.text, torch.float64), seed=6)
    candidates = torch.randn(256, tiny_config.text.hidden_size, dtype=torch.float64)
    with torch.no_grad():  # keep the 12 tokens whose k-th and (k+1)-th choices are furthest apart
        vals = (moe.gate(candidates)[2] + moe.gate.e_score_correction_bias).sort(-1, descending=True).values
        k = moe.gate.top_k
        x = candidates[(vals[:, k - 1] - vals[:, k]).topk(12).indices]
    u = torch.randn(12, tiny_config.text.hidden_size, dtype=torch.float64)
    params = {n: p.detach().clone().requires_grad_() for n, p in moe.named_parameters()}
    loss, idx0 = _moe_loss(moe, params, x, u)
    grads = dict(zip(params, torch.autograd.grad(loss, list(params.values()))))
    assert grads["gate.weight"].abs().max() > 0
    assert moe.gate.e_score_correction_bias.requires_grad is False
    eps = 1e-2
    for trial, names in enumerate([["gate.weight"], ["gate.weight"], list(params)]):
        g = torch.Generator().manual_seed(trial)
        direction = {n: torch.randn(params[n].shape, generator=g, dtype=torch.float64) for n in names}
        norm = sum(d.pow(2).sum() for d in direction.values()).sqrt()
        direction = {n: d / norm for n, d in direction.items()}  # a unit step moves no score by more than eps*|x|
        with torch.no_grad():
            values = []
            for sign in (1, -1):
                shifted = {n: p + sign * eps * direction[n] if n in direction else p for n, p in params.items()}
                value, idx = _moe_loss(moe, shifted, x, u)
                assert torch.equal(idx, idx0), "routing changed: pick a smaller eps"
                values.append(value)
        numeric = (values[0] - values[1]) / (2 * eps)
        analytic = sum((grads[n] * direction[n]).sum() for n in names)
        assert abs(numeric - analytic) <= 2e-3 * abs(analytic), (names[:2], numeric.item(), analytic.item())


def test_correction_bias_gets_no_gradient(tiny_config):
    model = randomize(K3ForCausalLM(tiny_config.text, torch.float32), seed=7)
    model(torch.randint(0, 300, (1, 9))).float().logsumexp(-1).mean().backward()
    names = dict(model.named_parameters())
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            assert name not in names and buf.grad is None and not buf.requires_grad
            gate = name.removesuffix("e_score_correction_bias") + "weight"
            assert names[gate].grad is not None and names[gate].grad.abs().max() > 0
