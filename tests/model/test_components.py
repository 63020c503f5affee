"""Each text-model component against an independent computation written here from the spec (section 2)."""

import math

import pytest
import torch
import torch.nn.functional as F

from kimik3.model.kda import KimiDeltaAttention
from kimik3.model.mla import MultiHeadLatentAttention
from kimik3.model.mlp import MLP
from kimik3.model.moe import LatentMoE
from kimik3.model.norm import GatedRMSNorm, RMSNorm
from kimik3.ops.attnres import attn_res_mix
from kimik3.ops.situ import situ_glu
from tests.helpers import randomize, rel_err


def test_rmsnorm_gain_after_downcast():
    torch.manual_seed(0)
    norm = RMSNorm(64, eps=1e-5, dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64))
    x = torch.randn(5, 64, dtype=torch.bfloat16) * 3
    xd = x.double()
    normalized = (xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    assert torch.equal(norm(x), normalized * norm.weight)  # the bf16 product, not an fp32 one
    assert norm(x).dtype == torch.bfloat16


def test_gated_rmsnorm_fp32_island():
    torch.manual_seed(1)
    n = GatedRMSNorm(24, eps=1e-5)
    with torch.no_grad():
        n.weight.copy_(torch.randn(24))
    o, g = torch.randn(3, 4, 24, dtype=torch.bfloat16), torch.randn(3, 4, 24, dtype=torch.bfloat16)
    od = o.double()
    ref = od / torch.sqrt(od.pow(2).mean(-1, keepdim=True) + 1e-5) * n.weight.double() / (1 + torch.exp(-g.double()))
    out = n(o, g)
    assert out.dtype == torch.bfloat16 and n.weight.dtype == torch.float32
    assert rel_err(out, ref) < 4e-3  # one bf16 rounding


def test_situ_glu():
    g, u = torch.randn(1000, dtype=torch.float64) * 8, torch.randn(1000, dtype=torch.float64) * 40
    a = 4 * (torch.exp(g / 4) - torch.exp(-g / 4)) / (torch.exp(g / 4) + torch.exp(-g / 4)) / (1 + torch.exp(-g))
    ref = a * 25 * torch.tanh(u / 25)
    assert rel_err(situ_glu(g.float(), u.float(), 4.0, 25.0), ref) < 1e-6
    out = situ_glu(g.bfloat16(), u.bfloat16(), 4.0, 25.0)
    assert out.dtype == torch.bfloat16


def test_attn_res_mix_per_token_loop():
    torch.manual_seed(2)
    D, m = 16, 3
    sources = [torch.randn(2, 5, D) * (j + 1) for j in range(m)]
    partial = torch.randn(2, 5, D)
    nw, pw = torch.randn(D), torch.randn(1, D)
    out = attn_res_mix(torch.stack(sources), partial, nw, pw, 1e-5)
    ref = torch.empty(2, 5, D, dtype=torch.float64)
    for b in range(2):
        for t in range(5):
            vals = [s[b, t].double() for s in sources] + [partial[b, t].double()]
            scores = []
            for v in vals:
                rms = math.sqrt(sum(float(e) ** 2 for e in v) / D + 1e-5)
                scores.append(sum(float(v[d]) / rms * float(nw[d]) * float(pw[0, d]) for d in range(D)))
            mx = max(scores)
            ex = [math.exp(s - mx) for s in scores]
            ref[b, t] = sum(e / sum(ex) * v for e, v in zip(ex, vals))
    assert rel_err(out, ref) < 1e-6
    assert attn_res_mix(partial.new_empty(0, 2, 5, D), partial, nw, pw, 1e-5).allclose(partial)  # identity


def _naive_kda_layer(layer: KimiDeltaAttention, x: torch.Tensor) -> torch.Tensor:
    """Spec 2.4 written out: F.conv1d for the short convs, a per-token delta-rule loop, fp64."""
    B, T, _ = x.shape
    H, K = layer.num_heads, layer.head_dim
    xd = x.double()
    lin = lambda mod, inp: inp @ mod.weight.double().T  # noqa: E731

    def conv(mod, proj):
        y = lin(proj, xd).transpose(1, 2)  # [B, P, T]
        W = mod.weight.shape[-1]
        y = F.conv1d(F.pad(y, (W - 1, 0)), mod.weight.double(), groups=y.shape[1])
        return F.silu(y).transpose(1, 2).reshape(B, T, H, K)

    q, k, v = conv(layer.q_conv1d, layer.q_proj), conv(layer.k_conv1d, layer.k_proj), conv(layer.v_conv1d, layer.v_proj)
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    graw = lin(layer.f_b_proj, lin(layer.f_a_proj, xd)).view(B, T, H, K)
    A = torch.exp(layer.A_log.double()[:H]).view(1, 1, H, 1)
    g = -5.0 / (1 + torch.exp(-A * (graw + layer.dt_bias.double().view(H, K))))
    beta = torch.sigmoid(lin(layer.b_proj, xd))
    o = torch.zeros(B, T, H, K, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            S = torch.zeros(K, K, dtype=torch.float64)
            for t in range(T):
                S = torch.diag(torch.exp(g[b, t, h])) @ S
                u = beta[b, t, h] * (v[b, t, h] - S.T @ k[b, t, h])
                S = S + torch.outer(k[b, t, h], u)
                o[b, t, h] = S.T @ (q[b, t, h] * K**-0.5)
    gate = lin(layer.g_proj, xd).view(B, T, H, K)
    o = o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + 1e-5) * layer.o_norm.weight.double() * torch.sigmoid(gate)
    return lin(layer.o_proj, o.reshape(B, T, H * K))


@pytest.mark.parametrize("T", [1, 7, 70])
def test_kda_layer(tiny_config, T):
    torch.manual_seed(3)
    layer = randomize(KimiDeltaAttention(tiny_config.text, torch.float32), seed=3)
    x = torch.randn(2, T, tiny_config.text.hidden_size)
    assert rel_err(layer(x), _naive_kda_layer(layer, x)) < 1e-5


def test_kda_layer_bf16_keeps_islands(tiny_config):
    layer = randomize(KimiDeltaAttention(tiny_config.text, torch.bfloat16), seed=4)
    fp32 = {n for n, p in layer.named_parameters() if p.dtype == torch.float32}
    assert fp32 == {"A_log", "dt_bias", "q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight", "o_norm.weight"}
    x = torch.randn(1, 9, tiny_config.text.hidden_size, dtype=torch.bfloat16)
    out = layer(x)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, _naive_kda_layer(layer, x)) < 2e-2


def test_mla_layer(tiny_config):
    torch.manual_seed(5)
    c = tiny_config.text.mla
    layer = randomize(MultiHeadLatentAttention(tiny_config.text, torch.float32), seed=5)
    B, T = 2, 11
    x = torch.randn(B, T, tiny_config.text.hidden_size)
    xd = x.double()
    w = lambda mod: mod.weight.double()  # noqa: E731

    def rms(z, n, eps):
        return z / torch.sqrt(z.pow(2).mean(-1, keepdim=True) + eps) * w(n)

    H, N, R, V, C = c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
    q = (rms(xd @ w(layer.q_a_proj).T, layer.q_a_layernorm, 1e-6) @ w(layer.q_b_proj).T).view(B, T, H, N + R)
    ckv = xd @ w(layer.kv_a_proj_with_mqa).T
    kv = (rms(ckv[..., :C], layer.kv_a_layernorm, 1e-6) @ w(layer.kv_b_proj).T).view(B, T, H, N + V)
    k = torch.cat([kv[..., :N], ckv[..., C:].unsqueeze(2).expand(B, T, H, R)], -1)
    attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), kv[..., N:].transpose(1, 2),
                                          is_causal=True, scale=(N + R) ** -0.5)
    gated = attn.transpose(1, 2).reshape(B, T, H * V) * torch.sigmoid(xd @ w(layer.g_proj).T)
    ref = gated @ w(layer.o_proj).T
    assert rel_err(layer(x), ref) < 1e-5


def test_dense_mlp():
    torch.manual_seed(6)
    mlp = randomize(MLP(20, 36, 4.0, 25.0, torch.float32), seed=6)
    x = torch.randn(7, 20)
    g, u = x.double() @ mlp.gate_proj.weight.double().T, x.double() @ mlp.up_proj.weight.double().T
    h = 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)
    assert rel_err(mlp(x), h @ mlp.down_proj.weight.double().T) < 1e-6


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_latent_moe_dense_equivalent(tiny_config, dtype, tol):
    """All experts computed densely for every token; routing rebuilt from a full sort."""
    torch.manual_seed(7)
    cfg = tiny_config.text
    moe = randomize(LatentMoE(cfg, dtype), seed=7)
    x = torch.randn(2, 13, cfg.hidden_size).to(dtype)
    xd = x.double().reshape(-1, cfg.hidden_size)
    w = lambda p: p.double()  # noqa: E731
    scores = torch.sigmoid(xd @ w(moe.gate.weight).T)
    order = torch.argsort(scores + w(moe.gate.e_score_correction_bias), dim=-1, descending=True)
    A = cfg.moe.num_experts_per_token
    mask = torch.zeros_like(scores).scatter(-1, order[:, :A], 1.0)
    weights = scores * mask
    weights = weights / weights.sum(-1, keepdim=True) * cfg.moe.routed_scaling_factor
    z = xd @ w(moe.routed_expert_down_proj.weight).T
    gate = torch.einsum("nl,efl->nef", z, w(moe.experts.w1))
    up = torch.einsum("nl,efl->nef", z, w(moe.experts.w3))
    h = 4 * torch.tanh(gate / 4) * torch.sigmoid(gate) * 25 * torch.tanh(up / 25)
    y = torch.einsum("nef,elf->nel", h, w(moe.experts.w2))
    r = (weights.unsqueeze(-1) * y).sum(1)
    r = r / torch.sqrt(r.pow(2).mean(-1, keepdim=True) + 1e-5) * w(moe.routed_expert_norm.weight)
    sh = moe.shared_experts
    sg, su = xd @ w(sh.gate_proj.weight).T, xd @ w(sh.up_proj.weight).T
    shared = (4 * torch.tanh(sg / 4) * torch.sigmoid(sg) * 25 * torch.tanh(su / 25)) @ w(sh.down_proj.weight).T
    ref = r @ w(moe.routed_expert_up_proj.weight).T + shared
    out = moe(x)
    assert out.dtype == dtype and out.shape == x.shape
    assert rel_err(out.reshape(-1, cfg.hidden_size), ref) < tol


def test_router_bias_selects_only(tiny_config):
    moe = randomize(LatentMoE(tiny_config.text, torch.float32), seed=8)
    x = torch.randn(6, tiny_config.text.hidden_size)
    with torch.no_grad():
        moe.gate.e_score_correction_bias.zero_()
        moe.gate.e_score_correction_bias[5] = 10.0  # forces expert 5 into every selection
    idx, w, scores = moe.gate(x)
    assert (idx == 5).any(-1).all()
    assert torch.allclose(w.sum(-1), torch.ones(6))  # renormalized, from the unbiased scores
    assert torch.allclose(w, scores.gather(-1, idx) / scores.gather(-1, idx).sum(-1, keepdim=True))
    assert moe.gate.e_score_correction_bias.dtype == torch.float32
    assert "gate.e_score_correction_bias" in moe.state_dict()
    assert "gate.e_score_correction_bias" not in dict(moe.named_parameters())  # not trained by gradients


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_experts_equal_dequantized(tiny_config, dtype):
    from kimik3.ops.mxfp4 import decode, encode
    from kimik3.quant import pack_experts

    moe = randomize(LatentMoE(tiny_config.text, dtype), seed=9)
    with torch.no_grad():  # make the dense experts exactly representable, then pack them
        for name in ("w1", "w2", "w3"):
            w = getattr(moe.experts, name)
            w.copy_(decode(*encode(w), dtype))
    x = torch.randn(3, 7, tiny_config.text.hidden_size).to(dtype)
    dense = moe(x)
    pack_experts(moe)
    assert type(moe.experts).__name__ == "MXFP4Experts"
    assert torch.equal(moe(x), dense)
