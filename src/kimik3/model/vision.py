"""MoonViT-V2 vision tower, its 2x2 patch merger, and the projector into the text width (spec section 4).

Legend: N packed patches of all images and frames (sum of t*h*w), D tower width (1024), H heads (12),
K head dim (128), F tower MLP width (4096), M merged tokens (sum of h/2 * w/2), P merged width (4*D),
E text hidden (7168). A grid (t, h, w) counts frames and patch rows/columns of one image; its patches are
packed frame by frame, each frame row-major.

    x = patch_embed.proj(pixels) + pos_emb(grid)                    14x14 conv = one linear map per patch
    per block:  x = x + wo( attn_per_image( rope2d( wqkv( norm0(x) ) ) ) )
                x = x + mlp.fc1( gelu_tanh( mlp.fc0( norm1(x) ) ) )
    x = final_layernorm(x);  merge 2x2 windows, mean over frames      [N, D] -> [M, P]
    projector:  post_norm( proj.2( gelu_erf( proj.0(x) ) ) )          [M, P] -> [M, E]

The norms are `torch.nn.RMSNorm(D)` without eps, as in the reference: torch then uses the fp32 machine eps
(~1.19e-7) and normalizes in fp32 (spec 4.2 and section 8 item 9). Measured on torch 2.13 CPU and 2.11 CUDA,
the bf16 gain also multiplies in fp32, before the single rounding to bf16 (the spec says after the downcast);
calling nn.RMSNorm itself keeps whatever the installed torch does, which is what the reference does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kimik3.config import VisionConfig
from kimik3.ops.vision_attn import vision_attention

Grid = tuple[int, int, int]
ROPE_THETA = 10000.0
TIME_THETA = 10000.0


def parse_grids(grid_thws: Tensor, num_patches: int | None, max_frames: int, merge: tuple[int, int]) -> list[Grid]:
    """`grid_thws` [n_images, 3] -> [(t, h, w), ...], raising ValueError on anything the tower cannot take."""
    if grid_thws.dim() != 2 or grid_thws.shape[1] != 3 or grid_thws.is_floating_point():
        raise ValueError(f"grid_thws must be an integer tensor [n_images, 3] of (t, h, w), got "
                         f"{grid_thws.dtype} {tuple(grid_thws.shape)}")
    grids: list[Grid] = [(int(t), int(h), int(w)) for t, h, w in grid_thws.tolist()]
    for n, (t, h, w) in enumerate(grids):
        if not 1 <= t <= max_frames:
            raise ValueError(f"grid_thws[{n}]: t={t} frames; the tower takes 1..{max_frames} (init_pos_emb_time)")
        if h < 1 or w < 1 or h % merge[0] or w % merge[1]:
            raise ValueError(f"grid_thws[{n}]: (h, w)=({h}, {w}) must be positive multiples of the merge "
                             f"kernel {merge}")
    total = sum(t * h * w for t, h, w in grids)
    if num_patches is not None and total != num_patches:
        raise ValueError(f"grid_thws describe {total} patches but pixel_values has {num_patches}")
    return grids


def cu_seqlens_of(grids: list[Grid]) -> Tensor:
    """[n_images + 1] int64 image boundaries in the packed patch sequence (kept on the CPU: read as ints)."""
    lengths = torch.tensor([0] + [t * h * w for t, h, w in grids], dtype=torch.int64)
    return lengths.cumsum(0)


def rope_2d_table(grids: list[Grid], head_dim: int, device: torch.device | None = None) -> Tensor:
    """complex64 [N, K/2]: the 2-D rotary phases of every packed patch.

    Complex pair 2i (head elements 4i, 4i+1) turns by col * f_i and pair 2i+1 (elements 4i+2, 4i+3) by
    row * f_i, with f_i = 10000^(-4i/K), i < K/4; every frame of an image repeats its (row, col) phases.
    Computed in fp32 exactly as the reference's precomputed 512x512 table, for the grids at hand only.
    """
    freqs = 1.0 / (ROPE_THETA ** (torch.arange(0, head_dim, 4, device=device)[: head_dim // 4].float() / head_dim))
    tables = []
    for t, h, w in grids:
        flat = torch.arange(h * w, device=device).float()
        cols, rows = flat % w, torch.div(flat, w, rounding_mode="floor")
        angles = torch.stack([torch.outer(cols, freqs), torch.outer(rows, freqs)], dim=-1).flatten(1)
        tables.append(torch.polar(torch.ones_like(angles), angles).repeat(t, 1))
    return torch.cat(tables)


def apply_rope_2d(x_NHK: Tensor, cis_NC: Tensor) -> Tensor:
    """Rotate adjacent pairs (2j, 2j+1) of each head by the phases `cis` [N, K/2]; fp32 math, x.dtype out."""
    x_NHC = torch.view_as_complex(x_NHK.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(x_NHC * cis_NC.unsqueeze(1)).flatten(-2).to(x_NHK.dtype)


def time_embedding(num_frames: int, dim: int, device: torch.device | None = None) -> Tensor:
    """fp32 [num_frames, dim]: frame tau -> [sin(tau * w_i) | cos(tau * w_i)], w_i = 10000^(-i/(dim/2)).

    Frame 0 gets it too (zeros on the sin half, ones on the cos half), as in the reference.
    """
    omega = 1.0 / TIME_THETA ** (torch.arange(dim // 2, device=device, dtype=torch.float32) / (dim / 2.0))
    angles = torch.outer(torch.arange(num_frames, device=device, dtype=torch.float32), omega)
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class PosEmbedding(nn.Module):
    """`patch_embed.pos_emb` ("divided_fixed"): a learnable [64, 64, D] grid, bilinearly resized per image.

    The reference keeps the time embedding as a non-persistent buffer; it is not in the checkpoint, so it is
    recomputed here per call (t <= 4 rows): a model built on the meta device and then loaded stays correct.
    """

    def __init__(self, height: int, width: int, max_frames: int, dim: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.max_frames = max_frames
        self.weight = nn.Parameter(torch.empty(height, width, dim, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight.is_meta:  # normal_ on meta imports torch._dynamo (~1.5 s) and would fill nothing anyway
            return
        with torch.no_grad():
            self.weight.normal_()  # the reference's init (unit normal)

    def grid_table(self, h: int, w: int) -> Tensor:
        """[h*w, D] in the weight dtype: the grid resized to (h, w) (bilinear, half-pixel centres), row-major."""
        if (h, w) == tuple(self.weight.shape[:2]):
            return self.weight.flatten(0, 1)
        grid_1DHW = self.weight.permute(2, 0, 1).unsqueeze(0)
        resized_1Dhw = F.interpolate(grid_1DHW, size=(h, w), mode="bilinear", align_corners=False)
        return resized_1Dhw[0].permute(1, 2, 0).flatten(0, 1)

    def forward(self, grids: list[Grid]) -> Tensor:
        """-> [N, D] in the weight dtype, frames of an image stacked; frames get the time embedding when t > 1."""
        tables = []
        for t, h, w in grids:
            table = self.grid_table(h, w)
            if t > 1:
                time_TD = time_embedding(t, table.shape[-1], table.device).to(table.dtype)
                table = (table.unsqueeze(0) + time_TD.unsqueeze(1)).flatten(0, 1)
            tables.append(table)
        return torch.cat(tables)


class PatchEmbed(nn.Module):
    """`vision_tower.patch_embed`: Conv2d(3, D, 14, stride 14, no bias) on each [3, 14, 14] patch, + positions."""

    def __init__(self, cfg: VisionConfig, dtype: torch.dtype | None = None):
        super().__init__()
        p, D = cfg.patch_size, cfg.hidden_size
        self.proj = nn.Conv2d(3, D, kernel_size=p, stride=p, bias=False, dtype=dtype)
        self.pos_emb = PosEmbedding(cfg.pos_emb_height, cfg.pos_emb_width, cfg.pos_emb_time, D, dtype)

    def forward(self, pixel_values: Tensor, grids: list[Grid]) -> Tensor:
        """pixel_values [N, 3, p, p] (any float dtype; cast to the tower dtype) -> [N, D]."""
        x_ND = self.proj(pixel_values.to(self.proj.weight.dtype)).flatten(1)
        return x_ND + self.pos_emb(grids)


class VisionMLP(nn.Module):
    """`mlp`: fc1( gelu_tanh( fc0(x) ) ), bias-free."""

    def __init__(self, dim: int, hidden: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.fc0 = nn.Linear(dim, hidden, bias=False, dtype=dtype)
        self.fc1 = nn.Linear(hidden, dim, bias=False, dtype=dtype)

    def forward(self, x_ND: Tensor) -> Tensor:
        return self.fc1(F.gelu(self.fc0(x_ND), approximate="tanh"))


class VisionBlock(nn.Module):
    """`encoder.blocks.{b}`: pre-norm attention (fused q|k|v projection, 2-D RoPE) and MLP, no biases."""

    def __init__(self, cfg: VisionConfig, dtype: torch.dtype | None = None):
        super().__init__()
        D = cfg.hidden_size
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.norm0 = nn.RMSNorm(D, dtype=dtype)  # no eps on purpose: see the module docstring
        self.wqkv = nn.Linear(D, 3 * cfg.qkv_hidden_size, bias=False, dtype=dtype)
        self.wo = nn.Linear(cfg.qkv_hidden_size, D, bias=False, dtype=dtype)
        self.norm1 = nn.RMSNorm(D, dtype=dtype)
        self.mlp = VisionMLP(D, cfg.intermediate_size, dtype)

    def forward(self, x_ND: Tensor, cis_NC: Tensor, cu_seqlens: Tensor) -> Tensor:
        """x [N, D] -> [N, D]; `cis_NC` from `rope_2d_table`, `cu_seqlens` from `cu_seqlens_of`."""
        N = x_ND.shape[0]
        # the fused output is laid out [q (H*K) | k | v]
        q_NHK, k_NHK, v_NHK = self.wqkv(self.norm0(x_ND)).view(N, 3, self.num_heads, self.head_dim).unbind(1)
        q_NHK, k_NHK = apply_rope_2d(q_NHK, cis_NC), apply_rope_2d(k_NHK, cis_NC)
        o_NHK = vision_attention(q_NHK, k_NHK, v_NHK, cu_seqlens, scale=self.head_dim**-0.5)
        x_ND = x_ND + self.wo(o_NHK.flatten(1))
        return x_ND + self.mlp(self.norm1(x_ND))


class VisionEncoder(nn.Module):
    """`vision_tower.encoder`: the blocks and the final RMSNorm."""

    def __init__(self, cfg: VisionConfig, dtype: torch.dtype | None = None):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.blocks = nn.ModuleList(VisionBlock(cfg, dtype) for _ in range(cfg.num_layers))
        self.final_layernorm = nn.RMSNorm(cfg.hidden_size, dtype=dtype)

    def forward(self, x_ND: Tensor, grids: list[Grid]) -> Tensor:
        cis_NC = rope_2d_table(grids, self.head_dim, x_ND.device)
        cu_seqlens = cu_seqlens_of(grids)
        for block in self.blocks:
            x_ND = block(x_ND, cis_NC, cu_seqlens)
        return self.final_layernorm(x_ND)


def merge_patches(x_ND: Tensor, grids: list[Grid], merge: tuple[int, int] = (2, 2)) -> Tensor:
    """`sd2_tpool`: per image, each 2x2 window of patches -> one row [p00 | p01 | p10 | p11], mean over frames.

    x [N, D] -> [M, 4*D] in x.dtype, images in order, merged tokens row-major within an image.
    """
    kh, kw = merge
    D = x_ND.shape[-1]
    out, start = [], 0
    for t, h, w in grids:
        image = x_ND[start:start + t * h * w].view(t, h // kh, kh, w // kw, kw, D)
        windows = image.permute(0, 1, 3, 2, 4, 5).mean(dim=0)  # [h/2, w/2, 2, 2, D], temporal pooling
        out.append(windows.reshape((h // kh) * (w // kw), kh * kw * D))
        start += t * h * w
    return torch.cat(out) if out else x_ND.new_zeros(0, kh * kw * D)


def tokens_per_image(grid_thws: Tensor, merge: tuple[int, int] = (2, 2)) -> list[int]:
    """LLM tokens of each image: (h / 2) * (w / 2), whatever t (frames are pooled)."""
    return [(h // merge[0]) * (w // merge[1]) for _, h, w in grid_thws.tolist()]


class VisionTower(nn.Module):
    """`vision_tower.*`: MoonViT-V2 plus the parameter-free 2x2 merge.

    Args:
        cfg: `K3Config.vision`.
        dtype: parameter and compute dtype (default bfloat16, the checkpoint's). Pixel values are cast to it.
    """

    def __init__(self, cfg: VisionConfig, dtype: torch.dtype | None = None):
        super().__init__()
        dtype = torch.bfloat16 if dtype is None else dtype
        self.config = cfg
        self.patch_embed = PatchEmbed(cfg, dtype)
        self.encoder = VisionEncoder(cfg, dtype)

    def grids(self, pixel_values: Tensor | None, grid_thws: Tensor) -> list[Grid]:
        p = self.config.patch_size
        if pixel_values is not None and (pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (3, p, p)):
            raise ValueError(f"pixel_values must be [num_patches, 3, {p}, {p}], got {tuple(pixel_values.shape)}")
        n = None if pixel_values is None else pixel_values.shape[0]
        return parse_grids(grid_thws, n, self.config.pos_emb_time, self.config.merge_kernel_size)

    def _encode(self, pixel_values: Tensor, grids: list[Grid]) -> Tensor:
        if not grids:
            return self.patch_embed.proj.weight.new_zeros(0, self.config.hidden_size)
        return self.encoder(self.patch_embed(pixel_values, grids), grids)

    def forward(self, pixel_values: Tensor, grid_thws: Tensor) -> Tensor:
        """pixel_values [N, 3, p, p], grid_thws [n_images, 3] int -> merged features [M, 4*D] in the tower dtype.

        Image i owns `tokens_per_image(grid_thws)[i]` consecutive rows.
        """
        grids = self.grids(pixel_values, grid_thws)
        return merge_patches(self._encode(pixel_values, grids), grids, self.config.merge_kernel_size)


class MMProjector(nn.Module):
    """`mm_projector.*` (PatchMergerMLPV2): proj.0 (P->P) -> exact GELU -> proj.2 (P->E) -> post_norm (eps 1e-5)."""

    def __init__(self, cfg: VisionConfig, dtype: torch.dtype | None = None):
        super().__init__()
        dtype = torch.bfloat16 if dtype is None else dtype
        kh, kw = cfg.merge_kernel_size
        P, E = cfg.mm_hidden_size * kh * kw, cfg.text_hidden_size
        self.proj = nn.Sequential(nn.Linear(P, P, bias=False, dtype=dtype), nn.GELU(),
                                  nn.Linear(P, E, bias=False, dtype=dtype))
        self.post_norm = nn.RMSNorm(E, eps=cfg.projector_ln_eps, dtype=dtype)

    def forward(self, x_MP: Tensor) -> Tensor:
        """merged features [M, P] -> text-width embeddings [M, E]."""
        return self.post_norm(self.proj(x_MP))


def encode_images(tower: VisionTower, projector: MMProjector, pixel_values: Tensor,
                  grid_thws: Tensor) -> list[Tensor]:
    """Processor output -> one [tokens_i, E] tensor of text-width embeddings per image, in order.

    These rows replace image i's placeholder in the text sequence (spec 4.4).
    """
    x_ME = projector(tower(pixel_values, grid_thws))
    return list(x_ME.split(tokens_per_image(grid_thws, tower.config.merge_kernel_size)))
