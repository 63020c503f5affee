"""Image processor: resize plan and limits, patch layout, normalization, chessboard compositing, decoding of
JPEG/PNG/WebP/GIF, error messages, and the hand-off to the tower."""

import base64
import dataclasses
import io

import numpy as np
import pytest
import torch
from PIL import Image

from kimik3.model.vision import MMProjector, VisionTower, encode_images
from kimik3.vision import ProcessorConfig, load_image, process_images, resize_plan


def _image(w, h, mode="RGB", seed=0):
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    arr = rng.integers(0, 256, (h, w, channels), dtype=np.uint8)
    return Image.fromarray(arr[:, :, 0] if channels == 1 else arr, mode)


def _encode(image, fmt, **kw):
    buf = io.BytesIO()
    image.save(buf, fmt, **kw)
    return buf.getvalue()


def _unpatch(pixel_values, grid):
    """[rows*cols, 3, 14, 14] -> uint8-valued [H'', W'', 3] (undoing (x/255 - 0.5)/0.5), written independently."""
    _, rows, cols = grid
    img = pixel_values.view(rows, cols, 3, 14, 14).permute(0, 3, 1, 4, 2).reshape(rows * 14, cols * 14, 3)
    return torch.round((img.double() * 0.5 + 0.5) * 255).to(torch.int64).numpy()


def test_published_defaults():
    cfg = ProcessorConfig()
    assert (cfg.patch_size, cfg.merge_kernel_size) == (14, 2)
    assert (cfg.in_patch_limit, cfg.patch_limit_on_one_side) == (65536, 512)
    assert cfg.image_mean == cfg.image_std == (0.5, 0.5, 0.5) and cfg.factor == 28
    assert (cfg.chessboard_square_size, cfg.chessboard_square_on_top_left) == (8, True)
    assert (cfg.chessboard_white_value, cfg.chessboard_gray_value) == (255, 180)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.patch_size = 16
    with pytest.raises(ValueError, match="in_patch_limit"):
        ProcessorConfig(in_patch_limit=0)


@pytest.mark.parametrize("size, resized, grid, tokens", [
    ((1, 1), (1, 1), (1, 2, 2), 1),
    ((13, 29), (13, 29), (1, 4, 2), 2),
    ((1000, 3), (1000, 3), (1, 2, 72), 36),
    ((3000, 2000), (3000, 2000), (1, 144, 216), 7776),  # 214 x 142 floored patches: inside the budget
    ((8000, 6000), (4142, 3107), (1, 222, 296), 16428),  # patch budget: s = sqrt(65536 / (571 * 428))
    ((10000, 100), (7168, 71), (1, 6, 512), 768),  # one-side limit: s = 512 * 14 / 10000
    ((100000, 1), (7167, 1), (1, 2, 512), 256),  # int(100000 * 0.07168) floors to 7167
])
def test_resize_plan(size, resized, grid, tokens):
    plan = resize_plan(*size)
    assert (plan.new_width, plan.new_height) == resized
    assert plan.grid_thw == grid and plan.num_tokens == tokens and plan.num_patches == grid[1] * grid[2]
    assert (plan.new_width + plan.pad_width) % 28 == 0 and 0 <= plan.pad_width < 28
    assert (plan.new_height + plan.pad_height) % 28 == 0 and 0 <= plan.pad_height < 28
    assert grid[1] <= 512 and grid[2] <= 512
    # the budget counts floored patches of the original, so padding may add one row/column of tokens
    assert plan.num_patches <= 65536 + 2 * (grid[1] + grid[2])


@pytest.mark.parametrize("w, h", [(1, 1), (13, 29), (1000, 3), (3000, 2000)])
def test_unresized_images_keep_their_pixels(w, h):
    image = _image(w, h, seed=w)
    out = process_images([image])
    plan = resize_plan(w, h)
    assert out.pixel_values.dtype == torch.float32 and out.grid_thws.dtype == torch.int64
    assert out.pixel_values.shape == (plan.num_patches, 3, 14, 14)
    assert out.grid_thws.tolist() == [list(plan.grid_thw)] and out.sizes == [(w, h)]
    assert out.num_tokens == [plan.num_tokens]
    pixels = _unpatch(out.pixel_values, plan.grid_thw)
    assert (pixels[:h, :w] == np.asarray(image)).all()
    assert (pixels[h:] == 0).all() and (pixels[:, w:] == 0).all()  # zero padding -> -1 after normalization
    assert out.pixel_values.min() >= -1 and out.pixel_values.max() <= 1


def test_normalization_is_bit_exact():
    """Every uint8 value, with the reference's rounding steps: fp32(v / 255), then fp32(that - 0.5), then * 2."""
    values = torch.arange(256)
    image = Image.fromarray(values.to(torch.uint8).numpy()[None, :, None].repeat(3, axis=2))
    got = process_images([image]).pixel_values[:, 0, 0, :].flatten()[:256]  # row 0 of each patch, in order
    want = ((values.double() / 255).float().double() - 0.5).float() * 2
    assert torch.equal(got, want)
    assert got[0] == -1 and got[255] == 1


def test_downscale_is_pil_bicubic():
    image = _image(8000, 60, seed=1)
    out = process_images([image])
    assert out.grid_thws.tolist() == [[1, 4, 512]] and out.num_tokens == [512]  # 7168 x 53 -> pad to 56
    want = np.asarray(image.resize((7168, 53), Image.Resampling.BICUBIC))
    pixels = _unpatch(out.pixel_values, (1, 4, 512))
    assert (pixels[:53] == want).all() and (pixels[53:] == 0).all()


def test_png_alpha_composited_on_chessboard():
    rgba = np.zeros((20, 40, 4), dtype=np.uint8)  # fully transparent black
    rgba[2, 30] = (10, 200, 30, 255)  # opaque
    rgba[3, 30] = (10, 200, 30, 128)  # half transparent, over square (0, 3): gray
    rgba[3, 33] = (10, 200, 30, 128)  # over square (0, 4): white
    out = process_images([_encode(Image.fromarray(rgba, "RGBA"), "PNG")])
    assert out.sizes == [(40, 20)] and out.grid_thws.tolist() == [[1, 2, 4]]
    px = _unpatch(out.pixel_values, (1, 2, 4))
    # square (row // 8, col // 8): white on the top-left, gray where row + col squares is odd
    for (y, x), value in {(0, 0): 255, (0, 8): 180, (8, 0): 180, (8, 8): 255, (9, 17): 180, (19, 39): 255,
                          (19, 31): 180}.items():
        assert (px[y, x] == value).all(), (y, x, px[y, x])
    assert px[2, 30].tolist() == [10, 200, 30]
    a = np.float32(128) / np.float32(255.0)
    for (y, x), bg in {(3, 30): 180, (3, 33): 255}.items():
        want = [int(a * np.float32(c) + (np.float32(1) - a) * np.float32(bg)) for c in (10, 200, 30)]
        assert px[y, x].tolist() == want
    assert (px[20:] == 0).all() and (px[:, 40:] == 0).all()  # padding is black, not chessboard


def test_transparent_image_after_resize():
    """The chessboard is laid on the resized image (fill stage "after_resize"), in resized pixel units."""
    clear = Image.new("RGBA", (10000, 20), (255, 0, 0, 0))
    px = _unpatch(process_images([clear]).pixel_values, (1, 2, 512))
    assert px[:14].reshape(-1, 3).tolist()[:8] == [[255] * 3] * 8  # new height 14: one row of squares
    assert (px[0, 8] == 180).all() and (px[13, 16] == 180).all() and (px[13, 8] == 255).all()
    assert (px[14:] == 0).all()


def test_rgb_jpeg_webp_round_trips():
    image = _image(50, 37, seed=2)
    for fmt, kw in (("JPEG", {"quality": 90}), ("WEBP", {"lossless": True}), ("PNG", {})):
        data = _encode(image, fmt, **kw)
        out = process_images([data])
        decoded = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
        px = _unpatch(out.pixel_values, (1, 4, 4))
        assert out.sizes == [(50, 37)] and out.num_tokens == [4]
        assert (px[:37, :50] == decoded).all(), fmt
        if fmt != "JPEG":
            assert (decoded == np.asarray(image)).all()


def test_webp_with_alpha():
    rgba = np.full((16, 16, 4), 255, dtype=np.uint8)
    rgba[:, :, 3] = 0
    px = _unpatch(process_images([_encode(Image.fromarray(rgba, "RGBA"), "WEBP", lossless=True)]).pixel_values,
                  (1, 2, 2))
    assert (px[0, 0] == 255).all() and (px[0, 8] == 180).all() and (px[8, 8] == 255).all()


def test_gif_first_frame_and_transparency():
    frames = [Image.new("P", (30, 20), 1), Image.new("P", (30, 20), 2)]
    palette = [0, 0, 0, 40, 80, 120, 200, 10, 10] + [0] * (256 * 3 - 9)
    for f in frames:
        f.putpalette(palette)
    frames[0].putpixel((0, 0), 0)  # palette index 0 is the transparent one
    data = _encode(frames[0], "GIF", save_all=True, append_images=frames[1:], transparency=0, duration=50)
    assert getattr(Image.open(io.BytesIO(data)), "n_frames", 1) == 2
    px = _unpatch(process_images([data]).pixel_values, (1, 2, 4))
    assert px[0, 1].tolist() == px[19, 29].tolist() == [40, 80, 120]  # first frame's colour
    assert px[0, 0].tolist() == [255, 255, 255]  # transparent pixel -> white top-left square


def test_mixed_sources(tmp_path):
    path = tmp_path / "a.png"
    _image(30, 30, seed=3).save(path)
    b = _image(60, 20, "L", seed=4)
    out = process_images([path, str(path), _encode(b, "PNG"), b,
                          "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()])
    assert out.sizes == [(30, 30), (30, 30), (60, 20), (60, 20), (30, 30)]
    assert out.grid_thws.tolist() == [[1, 4, 4], [1, 4, 4], [1, 2, 6], [1, 2, 6], [1, 4, 4]]
    assert out.num_tokens == [4, 4, 3, 3, 4] and out.pixel_values.shape[0] == 16 * 3 + 12 * 2
    assert torch.equal(out.pixel_values[:16], out.pixel_values[-16:])
    assert process_images([]).pixel_values.shape == (0, 3, 14, 14)


def test_bad_inputs(tmp_path):
    empty = tmp_path / "empty.png"
    empty.write_bytes(b"")
    text = tmp_path / "notes.txt"
    text.write_text("not an image\n")
    corrupt = tmp_path / "corrupt.png"
    corrupt.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)
    truncated = tmp_path / "truncated.jpg"
    truncated.write_bytes(_encode(_image(64, 64), "JPEG")[:400])
    for path, why in ((empty, "empty"), (text, "not a readable image"), (corrupt, "not a readable image"),
                      (truncated, "not a readable image")):
        with pytest.raises(ValueError, match=why) as e:
            process_images([path])
        assert str(path) in str(e.value) and "BytesIO" not in str(e.value)  # the file, not Pillow's buffer
    with pytest.raises(ValueError, match=r"<12 bytes>: not a readable image"):
        load_image(b"garbagebytes")
    with pytest.raises(ValueError, match="upload.png: empty"):
        load_image(b"", name="upload.png")
    with pytest.raises(ValueError, match="data URL"):
        load_image("data:image/png;base64,@@@")
    with pytest.raises(FileNotFoundError, match="missing.png"):
        load_image(tmp_path / "missing.png")
    with pytest.raises(TypeError, match="int"):
        load_image(3)


def test_feeds_the_tower(tiny_config):
    torch.manual_seed(0)
    tower, projector = VisionTower(tiny_config.vision, torch.float32), MMProjector(tiny_config.vision, torch.float32)
    out = process_images([_image(45, 100), _image(3, 3)])
    with torch.no_grad():
        embeds = encode_images(tower, projector, out.pixel_values, out.grid_thws)
    assert [tuple(e.shape) for e in embeds] == [(n, tiny_config.text.hidden_size) for n in out.num_tokens]
    assert out.num_tokens == [8, 1]
