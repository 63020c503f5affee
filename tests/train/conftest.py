"""Training tests run on one intra-op thread (see `one_thread` in tests/conftest.py)."""

import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield
