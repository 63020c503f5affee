"""Image preprocessing for the vision tower (spec 4.1): decode, NaViT resize plan, bicubic resize, transparency
onto a chessboard, zero padding to multiples of 28, normalization, and 14x14 patches.

It follows the released `KimiK3VisionProcessor` with `transparent_bg_fill_stage = "after_resize"`: the decoded
image is resized in its own PIL mode and converted to RGB (or composited) only afterwards. PIL therefore
resamples palette images with NEAREST and RGBA with premultiplied alpha, exactly as the reference does; the
array arithmetic below repeats the reference's numpy dtypes so the pixel values match bit for bit.
EXIF orientation is not applied (the reference does not either).
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

ImageSource = Image.Image | str | os.PathLike | bytes | bytearray | memoryview


@dataclass(frozen=True, kw_only=True)
class ProcessorConfig:
    """The published `media_proc_cfg` of `preprocessor_config.json` (image fields), as defaults.

    Attributes:
        patch_size: pixels per patch side (14).
        merge_kernel_size: patches per merged LLM token side (2); images pad to multiples of 28.
        in_patch_limit: patch budget of one image before padding (65,536).
        patch_limit_on_one_side: most patches along one side (512, i.e. 7,168 px).
        image_mean, image_std: per-channel normalization of x / 255 (0.5 each: values land in [-1, 1]).
        chessboard_*: background for transparent pixels: squares of 8 px, white (255) on the top-left
            square, gray (180) on the others.
    """

    patch_size: int = 14
    merge_kernel_size: int = 2
    in_patch_limit: int = 65536
    patch_limit_on_one_side: int = 512
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    chessboard_square_size: int = 8
    chessboard_square_on_top_left: bool = True
    chessboard_white_value: int = 255
    chessboard_gray_value: int = 180

    def __post_init__(self) -> None:
        for name in ("patch_size", "merge_kernel_size", "in_patch_limit", "patch_limit_on_one_side",
                     "chessboard_square_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"ProcessorConfig.{name} must be positive, got {getattr(self, name)}")
        if len(self.image_mean) != 3 or len(self.image_std) != 3 or 0 in self.image_std:
            raise ValueError(f"ProcessorConfig.image_mean/image_std must be 3 values, std non-zero; got "
                             f"{self.image_mean}, {self.image_std}")
        for name in ("chessboard_white_value", "chessboard_gray_value"):
            if not 0 <= getattr(self, name) <= 255:
                raise ValueError(f"ProcessorConfig.{name} must be in 0..255, got {getattr(self, name)}")

    @property
    def factor(self) -> int:
        """Pixels per LLM token side (28): padded sizes are multiples of this."""
        return self.patch_size * self.merge_kernel_size


@dataclass(frozen=True)
class ResizePlan:
    """Where one image of `width` x `height` goes: resized to (new_width, new_height), then zero-padded."""

    new_width: int
    new_height: int
    pad_width: int
    pad_height: int
    patch_size: int
    merge_kernel_size: int

    @property
    def grid_thw(self) -> tuple[int, int, int]:
        """(1, H''/14, W''/14): frames, patch rows, patch columns after padding."""
        p = self.patch_size
        return 1, (self.new_height + self.pad_height) // p, (self.new_width + self.pad_width) // p

    @property
    def num_patches(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w

    @property
    def num_tokens(self) -> int:
        """LLM tokens after the tower's 2x2 merge: (H''/28) * (W''/28)."""
        _, h, w = self.grid_thw
        return (h // self.merge_kernel_size) * (w // self.merge_kernel_size)


def resize_plan(width: int, height: int, cfg: ProcessorConfig | None = None) -> ResizePlan:
    """The NaViT resize rule: shrink (never enlarge) to the patch budgets, then pad right/bottom to 28.

    s = min(1, sqrt(in_patch_limit / (max(1, W // 14) * max(1, H // 14))), 512*14 / W, 512*14 / H);
    W' = max(1, int(W * s)), H' = max(1, int(H * s)). The budget uses floored patch counts of the original,
    so after padding an image may exceed in_patch_limit by a few rows of patches (as the reference does).
    """
    cfg = cfg or ProcessorConfig()
    if width < 1 or height < 1:
        raise ValueError(f"image size must be at least 1x1, got {width}x{height}")
    p, side = cfg.patch_size, cfg.patch_limit_on_one_side
    scale = min(1.0, math.sqrt(cfg.in_patch_limit / (max(1, width // p) * max(1, height // p))),
                side * p / width, side * p / height)
    new_w = min(max(1, int(width * scale)), side * p)
    new_h = min(max(1, int(height * scale)), side * p)
    f = cfg.factor
    return ResizePlan(new_w, new_h, (f - new_w % f) % f, (f - new_h % f) % f, p, cfg.merge_kernel_size)


@dataclass(frozen=True)
class VisionInputs:
    """Processor output for a list of images, in order.

    Attributes:
        pixel_values: fp32 [num_patches, 3, 14, 14], patches of all images, each image row-major.
        grid_thws: int64 [num_images, 3] of (t=1, patch rows, patch columns).
        sizes: each image's original (width, height) in pixels (the chat prompt reports these).
        num_tokens: LLM tokens per image, (rows / 2) * (columns / 2).
    """

    pixel_values: torch.Tensor
    grid_thws: torch.Tensor
    sizes: list[tuple[int, int]]
    num_tokens: list[int]


def _label(source: ImageSource, name: str | None) -> str:
    if name is not None:
        return name
    if isinstance(source, (str, os.PathLike)):
        s = os.fspath(source)
        return "<data URL>" if s.startswith("data:") else s
    if isinstance(source, Image.Image):
        return f"<PIL image {source.mode} {source.width}x{source.height}>"
    return f"<{len(source)} bytes>" if isinstance(source, (bytes, bytearray, memoryview)) else repr(source)


def load_image(source: ImageSource, *, name: str | None = None) -> Image.Image:
    """Decode an image with Pillow: a path, raw bytes, a `data:...;base64,` URL, or an already open image.

    The pixels are decoded now (not lazily), and only the first frame of an animated GIF/WebP is kept.

    Raises:
        FileNotFoundError: a path that is not a file.
        ValueError: naming the file (or `name`, or "<N bytes>") for empty, corrupt, truncated or non-image data.
        TypeError: a source of another type.
    """
    if isinstance(source, Image.Image):
        return source
    label = _label(source, name)
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
    elif isinstance(source, (str, os.PathLike)):
        s = os.fspath(source)
        if s.startswith("data:"):
            try:
                data = base64.b64decode(s.split(",", 1)[1], validate=True)
            except (IndexError, binascii.Error) as e:
                raise ValueError(f"{label}: not a valid base64 data URL ({e})") from None
        else:
            path = Path(s)
            if not path.is_file():
                raise FileNotFoundError(f"image file not found: {path}")
            data = path.read_bytes()
    else:
        raise TypeError(f"image must be a path, bytes, a data URL or a PIL.Image, got {type(source).__name__}")
    if not data:
        raise ValueError(f"{label}: empty file, expected image data (JPEG, PNG, WebP, GIF, ...)")
    buffer = io.BytesIO(data)
    try:
        image = Image.open(buffer)
        image.load()
    except UnidentifiedImageError:
        raise ValueError(f"{label}: not a readable image (a format Pillow does not recognise; expected JPEG, "
                         "PNG, WebP, GIF, ...)") from None
    except Exception as e:  # untrusted bytes: Pillow's decoders raise OSError, SyntaxError, EOFError, ValueError...
        # Pillow names the in-memory buffer it read (`<_io.BytesIO object at 0x...>`): name the file instead
        detail = str(e).replace(repr(buffer), repr(label))
        raise ValueError(f"{label}: not a readable image ({type(e).__name__}: {detail})") from e
    if image.width < 1 or image.height < 1:
        raise ValueError(f"{label}: image has no pixels ({image.width}x{image.height})")
    return image


def chessboard(height: int, width: int, cfg: ProcessorConfig) -> np.ndarray:
    """uint8 [height, width, 3] background; square (0, 0) is white when `chessboard_square_on_top_left`."""
    s = cfg.chessboard_square_size
    parity = (np.arange(height)[:, None] // s + np.arange(width)[None, :] // s) % 2
    gray = parity == (1 if cfg.chessboard_square_on_top_left else 0)
    bg = np.where(gray, cfg.chessboard_gray_value, cfg.chessboard_white_value).astype(np.uint8)
    return np.repeat(bg[:, :, None], 3, axis=2)


def to_rgb_array(image: Image.Image, cfg: ProcessorConfig) -> np.ndarray:
    """uint8 [H, W, 3]: RGB as is; transparent images composited onto the chessboard; other modes converted.

    Compositing is alpha * rgb + (1 - alpha) * background in float32, truncated to uint8, as in the reference.
    An RGB image is taken as is even when it carries a `transparency` colour key (the reference does too).
    """
    if image.mode == "RGB":
        return np.asarray(image)
    if "A" not in image.getbands() and "transparency" not in image.info:
        return np.asarray(image.convert("RGB"))
    rgba = np.asarray(image.convert("RGBA"))
    alpha = rgba[:, :, 3:4].astype(np.float32) / 255.0
    out = alpha * rgba[:, :, :3] + (1 - alpha) * chessboard(rgba.shape[0], rgba.shape[1], cfg)
    return out.astype(np.uint8)


def image_pixels(image: Image.Image, plan: ResizePlan, cfg: ProcessorConfig) -> np.ndarray:
    """The resized, composited, zero-padded image: uint8 [H'', W'', 3]."""
    resized = image.resize((plan.new_width, plan.new_height), resample=Image.Resampling.BICUBIC)
    rgb = to_rgb_array(resized, cfg)
    return np.pad(rgb, ((0, plan.pad_height), (0, plan.pad_width), (0, 0)))


def patchify(pixels: np.ndarray, cfg: ProcessorConfig) -> np.ndarray:
    """uint8 [H'', W'', 3] -> normalized fp32 [rows * cols, 3, p, p], patches row-major, channel-first."""
    # same dtype steps as the reference: x / 255 in float64 rounded to float32, then -= mean, *= 1 / std
    x = (pixels / 255.0).astype(np.float32)
    x -= np.asarray(cfg.image_mean)
    x *= 1.0 / np.asarray(cfg.image_std)
    p = cfg.patch_size
    rows, cols = x.shape[0] // p, x.shape[1] // p
    return x.reshape(rows, p, cols, p, 3).transpose(0, 2, 4, 1, 3).reshape(rows * cols, 3, p, p)


def process_images(images: Sequence[ImageSource] | ImageSource, cfg: ProcessorConfig | None = None) -> VisionInputs:
    """Images -> the tower's inputs (spec 4.1). Each item is decoded with `load_image`.

    Returns:
        VisionInputs with pixel_values fp32 [sum of patches, 3, 14, 14], grid_thws int64 [n, 3], the original
        (width, height) of each image and its number of LLM tokens.

    Raises:
        FileNotFoundError / ValueError / TypeError from `load_image`; ValueError naming the image when its
        mode cannot be resized or converted to RGB.
    """
    cfg = cfg or ProcessorConfig()
    if isinstance(images, (Image.Image, str, os.PathLike, bytes, bytearray, memoryview)):
        images = [images]
    patches, grids, sizes, tokens = [], [], [], []
    for source in images:
        image = load_image(source)
        plan = resize_plan(image.width, image.height, cfg)
        try:
            pixels = image_pixels(image, plan, cfg)
        except (ValueError, OSError) as e:
            raise ValueError(f"{_label(source, None)}: cannot resize/convert an image of mode {image.mode} "
                             f"to RGB ({e})") from e
        patches.append(torch.from_numpy(np.ascontiguousarray(patchify(pixels, cfg))))
        grids.append(plan.grid_thw)
        sizes.append((image.width, image.height))
        tokens.append(plan.num_tokens)
    p = cfg.patch_size
    pixel_values = torch.cat(patches) if patches else torch.zeros(0, 3, p, p)
    grid_thws = torch.tensor(grids, dtype=torch.int64).reshape(-1, 3)
    return VisionInputs(pixel_values, grid_thws, sizes, tokens)
