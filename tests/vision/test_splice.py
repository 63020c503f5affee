"""Images spliced into the prompt: each media pad takes one projected image token, in order."""

import pytest
import torch
from PIL import Image

from kimik3.model import K3ForConditionalGeneration
from kimik3.model.vision import encode_images
from kimik3.vision import expand_media_pads, process_images
from tests.helpers import randomize, rel_err


@pytest.fixture(scope="module")
def model(tiny_config):
    return randomize(K3ForConditionalGeneration(tiny_config, torch.float32), seed=41).eval()


def _images():
    a = Image.new("RGB", (40, 30), (200, 10, 10))
    b = Image.frombytes("RGB", (70, 56), bytes(range(256)) * (70 * 56 * 3 // 256) + bytes(70 * 56 * 3 % 256))
    return process_images([a, b])


@torch.no_grad()
def test_pads_take_image_tokens_in_order(model, tiny_config):
    pad = tiny_config.media_placeholder_token_id
    vis = _images()
    ids = expand_media_pads([5, pad, 7, 8, pad, 9], vis.num_tokens, pad)
    assert len(ids) == 4 + sum(vis.num_tokens)
    ids_t = torch.tensor([ids])
    embeds = model.embed(ids_t, vis.pixel_values, vis.grid_thws)
    feats = torch.cat(encode_images(model.vision_tower, model.mm_projector, vis.pixel_values, vis.grid_thws))
    assert torch.equal(embeds[0][ids_t[0] == pad], feats)
    text = model.language_model.model.embed_tokens(ids_t)
    assert torch.equal(embeds[0][ids_t[0] != pad], text[0][ids_t[0] != pad])
    logits = model(ids_t, pixel_values=vis.pixel_values, grid_thws=vis.grid_thws)
    assert logits.shape == (1, len(ids), tiny_config.text.vocab_size) and torch.isfinite(logits).all()


@torch.no_grad()
def test_cached_prefill_with_images_then_decode(model, tiny_config):
    pad = tiny_config.media_placeholder_token_id
    vis = _images()
    ids = torch.tensor([expand_media_pads([5, pad, 7, pad, 9, 11, 12], vis.num_tokens, pad)])
    full = model(ids, pixel_values=vis.pixel_values, grid_thws=vis.grid_thws)
    cache = model.new_cache(1, ids.shape[1])
    pre = model(ids[:, :-2], cache=cache, pixel_values=vis.pixel_values, grid_thws=vis.grid_thws)
    dec = [model(ids[:, t:t + 1], cache=cache) for t in (ids.shape[1] - 2, ids.shape[1] - 1)]
    assert rel_err(torch.cat([pre, *dec], 1), full) < 1e-5


def test_mismatched_pads_and_images_are_clear_errors(model, tiny_config):
    pad = tiny_config.media_placeholder_token_id
    vis = _images()
    with pytest.raises(ValueError, match="2 image placeholders .* but 1 images"):
        expand_media_pads([pad, 1, pad], vis.num_tokens[:1], pad)
    ids = torch.tensor([expand_media_pads([1, pad, 2, pad], vis.num_tokens, pad)])
    with pytest.raises(ValueError, match="<\\|media_pad\\|> positions but the images give"):
        model(ids[:, :-3], pixel_values=vis.pixel_values, grid_thws=vis.grid_thws)
    text_only = K3ForConditionalGeneration(tiny_config, torch.float32, text_only=True)
    with pytest.raises(ValueError, match="no vision tower"):
        text_only(ids, pixel_values=vis.pixel_values, grid_thws=vis.grid_thws)


@torch.no_grad()
def test_prompts_without_images(model):
    assert model(torch.tensor([[1, 2, 3]])).shape == (1, 3, 300)
