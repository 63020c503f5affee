"""A small trained vocabulary written to a real rank file, loaded once per session."""

from __future__ import annotations

import pytest

from kimik3.tokenizer import PATTERN, Tokenizer

from .bpe_helper import CORPUS, train_bpe, write_ranks


@pytest.fixture(scope="session")
def ranks() -> dict[bytes, int]:
    return train_bpe(CORPUS, num_merges=400, pattern=PATTERN)


@pytest.fixture(scope="session")
def rank_dir(tmp_path_factory, ranks):
    d = tmp_path_factory.mktemp("ckpt")
    write_ranks(ranks, d / "tiktoken.model")
    return d


@pytest.fixture(scope="session")
def tok(rank_dir) -> Tokenizer:
    return Tokenizer.from_file(rank_dir)
