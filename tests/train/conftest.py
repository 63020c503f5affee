"""Training tests: one intra-op thread while they run (restored after).

Their tensors are tiny, so threading only adds synchronization; on a busy 2-core machine two spinning OpenMP
threads made elementwise ops ~100x slower. One thread also makes in-process runs reproducible bit for bit.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
