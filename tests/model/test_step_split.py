"""`build_step`'s split of MLA's paths: by chunk length without `expanded_until` (a whole chunk of
EXPANDED_FROM_TOKENS tokens or more expanded), by position with it (a chunk cut in two: its rows below the bound
expanded, the rest latent), and the engine's bound (`prompt_expanded_until`)."""

import torch

from kimik3.model.step import build_step, prompt_expanded_until
from kimik3.ops.mla import EXPANDED_FROM_TOKENS as E

BS = 16


def step(cached, lens, expanded_until=None):
    tables = [list(range(i * 64, i * 64 + -(-(c + n) // BS))) for i, (c, n) in enumerate(zip(cached, lens))]
    return build_step(slots=list(range(len(lens))), cached=cached, lens=lens, tables=tables, block_size=BS,
                      conv_window=4, pad_block=0, device=torch.device("cpu"), expanded_until=expanded_until)


def test_by_chunk_length_by_default():
    s = step([0, 5], [E + 7, 9])
    assert s.long.rows.tolist() == list(range(E + 7))  # the long chunk, whole
    assert s.short_rows.tolist() == list(range(E + 7, E + 16)) and s.short_lens.tolist() == [14]
    s = step([0], [E - 1])
    assert s.long is None and s.short_rows is None  # every chunk short: all rows latent


def test_by_position_a_chunk_is_cut_in_two():
    # sequence 0: positions 64..263 of a prompt expanded below 256; sequence 1 decodes (its bound far below)
    s = step([64, 300], [200, 1], expanded_until=[256, 256])
    assert s.long.rows.tolist() == list(range(0, 192))  # positions 64..255
    assert s.long.key_valid.sum().item() == 256  # its keys: the 64 cached and its own 192
    assert s.short_rows.tolist() == list(range(192, 201))  # positions 256..263, then the decode row
    assert s.short_cu.tolist() == [0, 8, 9] and s.short_lens.tolist() == [264, 301]
    # a chunk wholly above its bound, or below it, is not cut
    s = step([256, 0], [7, 64], expanded_until=[256, 256])
    assert s.long.rows.tolist() == list(range(7, 71)) and s.short_rows.tolist() == list(range(7))


def test_the_engines_bound_is_the_prompts_last_multiple():
    assert [prompt_expanded_until(n) for n in (1, E - 1, E, E + 5, 2 * E + 1)] == [0, 0, E, E, 2 * E]
