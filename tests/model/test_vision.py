"""Vision tower, merger and projector: released names and counts, RoPE, positions, a spec-literal forward,
image isolation, fwd/bwd in fp32 and bf16, and argument errors."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kimik3.model.vision import (
    MMProjector,
    VisionTower,
    apply_rope_2d,
    encode_images,
    merge_patches,
    rope_2d_table,
    time_embedding,
)
from tests.helpers import REPO, randomize, rel_err

F32_EPS = torch.finfo(torch.float32).eps


class _Holder(nn.Module):
    """The parent's attribute names, so state-dict keys carry the released prefixes."""

    def __init__(self, cfg, dtype=None):
        super().__init__()
        self.vision_tower = VisionTower(cfg, dtype)
        self.mm_projector = MMProjector(cfg, dtype)


def _random(cfg, dtype=torch.float32, seed=0):
    model = randomize(_Holder(cfg, dtype), seed=seed)
    with torch.no_grad():  # norms near 1, so the blocks stay well conditioned
        g = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if isinstance(model.get_submodule(name.rsplit(".", 1)[0]), nn.RMSNorm):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
    return model


def _pixels(grid, seed=0):
    n = int(torch.tensor(grid).prod(1).sum())
    return torch.rand(n, 3, 14, 14, generator=torch.Generator().manual_seed(seed)) * 2 - 1


@pytest.fixture(scope="module")
def tiny(tiny_config):
    return _random(tiny_config.vision)


def test_released_param_counts(k3_config):
    with torch.device("meta"):
        model = _Holder(k3_config.vision)
    count = lambda m: sum(t.numel() for t in m.state_dict().values())  # noqa: E731
    assert count(model.vision_tower) == 401_214_464
    assert count(model.mm_projector) == 46_144_512


def test_state_dict_matches_released_inventory(k3_config):
    released = {}
    for row in json.loads((REPO / "tests" / "data" / "k3_tensors.json").read_text())["tensors"]:
        if row["name"].startswith(("vision_tower.", "mm_projector.")):
            for layer in row.get("layers", [None]):
                released[row["name"].replace("{layer}", str(layer))] = (tuple(row["shape"]), row["dtype"])
    assert len(released) == 3 + 2 + 6 * 27 + 1
    with torch.device("meta"):
        model = _Holder(k3_config.vision)  # default dtype: bfloat16, the checkpoint's
    ours = {k: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for k, t in model.state_dict().items()}
    assert ours == released


def test_norms(tiny_config):
    """Tower norms: nn.RMSNorm without eps -> fp32 machine eps, fp32 math, one rounding; projector eps 1e-5."""
    model = _Holder(tiny_config.vision, torch.bfloat16)
    norms = [m for m in model.vision_tower.modules() if isinstance(m, nn.RMSNorm)]
    assert len(norms) == 2 * tiny_config.vision.num_layers + 1 and all(m.eps is None for m in norms)
    assert model.mm_projector.post_norm.eps == 1e-5
    norm = nn.RMSNorm(64, dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(64))
    for scale in (3.0, 1e-3, 1e-5):  # at 1e-5 the rms is near sqrt(eps): a wrong eps shows
        x = (torch.randn(16, 64) * scale).bfloat16()
        xf = x.float()
        # torch 2.13 on CPU: the gain multiplies in fp32 before the single downcast (spec 4.2 says after it)
        want = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + F32_EPS) * norm.weight.float()).bfloat16()
        assert torch.equal(norm(x), want)


def _rotate(x, rows, cols):
    """Spec 4.2 per element, fp64: pair p = (2p, 2p+1) turns by (col if p even else row) * 10000^(-4(p//2)/K)."""
    K = x.shape[-1]
    out = x.double().clone()
    for p in range(K // 2):
        f = 10000.0 ** (-4 * (p // 2) / K)
        ang = (cols if p % 2 == 0 else rows).double() * f
        c, s = torch.cos(ang)[:, None], torch.sin(ang)[:, None]
        a, b = x[..., 2 * p].double(), x[..., 2 * p + 1].double()
        out[..., 2 * p], out[..., 2 * p + 1] = a * c - b * s, a * s + b * c
    return out


def _rows_cols(grids):
    rows, cols = [], []
    for t, h, w in grids:
        r, c = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        rows.append(r.flatten().repeat(t))
        cols.append(c.flatten().repeat(t))
    return torch.cat(rows), torch.cat(cols)


def test_rope_2d_matches_explicit_rotation():
    grids = [(1, 3, 5), (2, 4, 2), (1, 37, 41)]
    rows, cols = _rows_cols(grids)
    x = torch.randn(len(rows), 2, 24)
    out = apply_rope_2d(x, rope_2d_table(grids, 24))
    assert out.dtype == torch.float32
    assert rel_err(out, _rotate(x, rows, cols)) < 1e-6
    assert torch.equal(apply_rope_2d(x.bfloat16(), rope_2d_table(grids, 24)).float(),
                       apply_rope_2d(x.bfloat16().float(), rope_2d_table(grids, 24)).bfloat16().float())


def _bilinear(grid, i, j, h, w):
    """align_corners=False: source coordinate (dst + 0.5) * in / out - 0.5, clamped at 0; edge index clamped."""
    H, W = grid.shape[:2]

    def src(dst, n_in, n_out):
        s = max((dst + 0.5) * n_in / n_out - 0.5, 0.0)
        i0 = min(int(math.floor(s)), n_in - 1)
        return i0, min(i0 + 1, n_in - 1), s - i0

    y0, y1, ly = src(i, H, h)
    x0, x1, lx = src(j, W, w)
    g = grid.double()
    return ((1 - ly) * ((1 - lx) * g[y0, x0] + lx * g[y0, x1]) + ly * ((1 - lx) * g[y1, x0] + lx * g[y1, x1]))


def test_pos_emb_interpolation(tiny):
    pos = tiny.vision_tower.patch_embed.pos_emb
    grid = pos.weight.detach()
    assert torch.equal(pos([(1, 8, 8)]), grid.flatten(0, 1))  # native size: the table itself, row-major
    for h, w in ((6, 12), (2, 2), (30, 4)):
        table = pos([(1, h, w)]).detach()
        assert table.shape == (h * w, grid.shape[-1])
        for i, j in ((0, 0), (h - 1, w - 1), (h // 2, w // 3), (1, w - 2)):
            assert rel_err(table[i * w + j], _bilinear(grid, i, j, h, w)) < 1e-6


def test_time_embedding(tiny):
    pos = tiny.vision_tower.patch_embed.pos_emb
    D = pos.weight.shape[-1]
    tau = torch.arange(4, dtype=torch.float64)[:, None]
    omega = 10000.0 ** (-torch.arange(D // 2, dtype=torch.float64) / (D // 2))
    want = torch.cat([torch.sin(tau * omega), torch.cos(tau * omega)], -1)
    assert rel_err(time_embedding(4, D), want) < 1e-6
    spatial = pos([(1, 4, 6)]).detach()
    video = pos([(3, 4, 6)]).detach().view(3, 24, D)
    for t in range(3):  # frame 0 is shifted too: +1 on the cos half
        assert rel_err(video[t], spatial + want[t].float()) < 1e-6


def test_merge_layout():
    t, h, w, D = 2, 4, 6, 3
    x = torch.randn(t, h, w, D)
    merged = merge_patches(x.flatten(0, 2), [(t, h, w)]).view(h // 2, w // 2, 4, D)
    for i in range(h // 2):
        for j in range(w // 2):
            for n, (a, b) in enumerate(((0, 0), (0, 1), (1, 0), (1, 1))):  # [p00 | p01 | p10 | p11]
                assert torch.allclose(merged[i, j, n], x[:, 2 * i + a, 2 * j + b].mean(0))


def _rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def _spec_forward(model, pixels, grids):
    """Spec 4.2-4.3 written independently in fp64 (bilinear resize via F.interpolate, tested above)."""
    tower, cfg = model.vision_tower, model.vision_tower.config
    H, K = cfg.num_heads, cfg.head_dim
    W = lambda m: m.weight.detach().double()  # noqa: E731
    pe = tower.patch_embed
    x = torch.einsum("ncij,dcij->nd", pixels.double(), W(pe.proj))
    pos = []
    for t, h, w in grids:
        g = F.interpolate(W(pe.pos_emb).permute(2, 0, 1)[None], size=(h, w), mode="bilinear", align_corners=False)
        g = g[0].permute(1, 2, 0).reshape(h * w, -1)
        pos += [g + (time_embedding(t, g.shape[-1]).double()[tau] if t > 1 else 0) for tau in range(t)]
    x = x + torch.cat(pos)
    rows, cols = _rows_cols(grids)
    image = torch.cat([torch.full((t * h * w,), n) for n, (t, h, w) in enumerate(grids)])
    for blk in tower.encoder.blocks:
        q, k, v = (_rms(x, blk.norm0.weight, F32_EPS) @ W(blk.wqkv).T).view(-1, 3, H, K).unbind(1)
        q, k = _rotate(q, rows, cols), _rotate(k, rows, cols)
        s = torch.einsum("thk,shk->hts", q, k) / math.sqrt(K)
        p = s.masked_fill(image[:, None] != image[None, :], float("-inf")).softmax(-1)
        x = x + torch.einsum("hts,shk->thk", p, v).flatten(1) @ W(blk.wo).T
        m = _rms(x, blk.norm1.weight, F32_EPS)
        x = x + F.gelu(m @ W(blk.mlp.fc0).T, approximate="tanh") @ W(blk.mlp.fc1).T
    x = _rms(x, tower.encoder.final_layernorm.weight, F32_EPS)
    merged, start = [], 0
    for t, h, w in grids:
        img = x[start:start + t * h * w].view(t, h, w, -1).mean(0)
        start += t * h * w
        for i in range(h // 2):
            for j in range(w // 2):
                merged.append(torch.cat([img[2 * i + a, 2 * j + b] for a in (0, 1) for b in (0, 1)]))
    proj = model.mm_projector
    y = F.gelu(torch.stack(merged) @ W(proj.proj[0]).T) @ W(proj.proj[2]).T
    return _rms(y, proj.post_norm.weight, proj.post_norm.eps)


GRIDS = [(1, 4, 6), (2, 2, 4), (1, 10, 8)]


def test_matches_spec_forward(tiny):
    grid_thws = torch.tensor(GRIDS)
    pixels = _pixels(GRIDS)
    with torch.no_grad():
        out = encode_images(tiny.vision_tower, tiny.mm_projector, pixels, grid_thws)
    assert [o.shape for o in out] == [(6, 80), (2, 80), (20, 80)]
    assert rel_err(torch.cat(out), _spec_forward(tiny, pixels, GRIDS)) < 1e-5


def test_sdpa_path_matches_reference_path(tiny, monkeypatch):
    """The tower through the SDPA fast path (forced on CPU) against the per-image fp32 reference loop."""
    import kimik3.ops.vision_attn as attn

    grid_thws, pixels = torch.tensor(GRIDS), _pixels(GRIDS, seed=6)
    with torch.no_grad():
        ref = tiny.vision_tower(pixels, grid_thws)
        monkeypatch.setattr(attn, "use_fast", lambda t, op: True)
        fast = tiny.vision_tower(pixels, grid_thws)
    assert not torch.equal(fast, ref)  # the two paths really differ in rounding
    assert rel_err(fast, ref) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_images_are_isolated(tiny_config, dtype):
    model = _random(tiny_config.vision, dtype, seed=3)
    grid_thws = torch.tensor(GRIDS)
    pixels = _pixels(GRIDS, seed=1)
    other = pixels.clone()
    other[24:] = _pixels(GRIDS, seed=2)[24:]  # images 2 and 3 change, image 1 (24 patches) does not
    with torch.no_grad():
        a = encode_images(model.vision_tower, model.mm_projector, pixels, grid_thws)
        b = encode_images(model.vision_tower, model.mm_projector, other, grid_thws)
    assert torch.equal(a[0], b[0])
    assert not torch.equal(a[1], b[1]) and not torch.equal(a[2], b[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fwd_bwd_finite(tiny_config, dtype):
    model = _random(tiny_config.vision, dtype, seed=5)
    grid_thws = torch.tensor(GRIDS)
    out = encode_images(model.vision_tower, model.mm_projector, _pixels(GRIDS, seed=4), grid_thws)
    assert all(o.dtype == dtype for o in out)
    torch.cat(out).float().square().mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    if dtype == torch.bfloat16:
        ref = _random(tiny_config.vision, torch.float32, seed=5)
        with torch.no_grad():
            want = encode_images(ref.vision_tower, ref.mm_projector, _pixels(GRIDS, seed=4), grid_thws)
        assert rel_err(torch.cat(out).detach(), torch.cat(want)) < 2e-2


def test_bad_arguments(tiny):
    tower = tiny.vision_tower
    px = _pixels([(1, 2, 2)])
    with pytest.raises(ValueError, match="frames"):
        tower(_pixels([(5, 2, 2)]), torch.tensor([[5, 2, 2]]))
    with pytest.raises(ValueError, match="merge"):
        tower(_pixels([(1, 3, 2)]), torch.tensor([[1, 3, 2]]))
    with pytest.raises(ValueError, match="describe 8 patches but pixel_values has 4"):
        tower(px, torch.tensor([[1, 2, 4]]))
    with pytest.raises(ValueError, match="grid_thws must be an integer tensor"):
        tower(px, torch.tensor([1, 2, 2]))
    with pytest.raises(ValueError, match="pixel_values must be"):
        tower(px[:, :, :7], torch.tensor([[1, 2, 2]]))
    assert tower(px[:0], torch.zeros(0, 3, dtype=torch.int64)).shape == (0, 160)


@pytest.mark.gpu
def test_cuda_bf16_matches_cpu_fp32_gpu(tiny_config):
    ref = _random(tiny_config.vision, torch.float32, seed=7)
    gpu = _random(tiny_config.vision, torch.bfloat16, seed=7).cuda()
    grid_thws = torch.tensor(GRIDS)
    with torch.no_grad():
        want = torch.cat(encode_images(ref.vision_tower, ref.mm_projector, _pixels(GRIDS), grid_thws))
        got = torch.cat(encode_images(gpu.vision_tower, gpu.mm_projector, _pixels(GRIDS).cuda(), grid_thws.cuda()))
    assert rel_err(got.float().cpu(), want) < 2e-2
