"""CPU thread choice for inference (kimik3.inference.threads): small models run on one thread unless the user
chose, large ones keep torch's count, GPU runs are left alone."""

import pytest
import torch
from torch import nn

from kimik3.inference.threads import SMALL_MODEL_PARAMS, pick_cpu_threads


@pytest.fixture
def threads(monkeypatch):
    """Start from 2 threads with no OMP_NUM_THREADS; restore the process's count afterwards."""
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def big_model() -> nn.Module:
    with torch.device("meta"):  # counted, never allocated
        return nn.Linear(SMALL_MODEL_PARAMS // 1000 + 1, 1000)


def test_small_model_on_cpu_gets_one_thread(threads):
    assert pick_cpu_threads(nn.Linear(8, 8), "cpu") == 1 == torch.get_num_threads()


def test_large_model_and_gpu_keep_torch_default(threads):
    assert pick_cpu_threads(big_model(), "cpu") == 2
    assert pick_cpu_threads(nn.Linear(8, 8), "cuda") == 2


def test_user_choice_wins(threads, monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    assert pick_cpu_threads(nn.Linear(8, 8), "cpu", requested=3) == 3
    torch.set_num_threads(2)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert pick_cpu_threads(nn.Linear(8, 8), "cpu") == 2
    # from 1 to the machine's CPUs: torch takes any count, and 10,000 crashed the process in its first matmul
    for bad in (0, 5, 10_000):
        with pytest.raises(ValueError, match=f"threads must be from 1 to 4 \\(this machine's CPUs\\), got {bad}"):
            pick_cpu_threads(nn.Linear(8, 8), "cpu", requested=bad)
    assert torch.get_num_threads() == 2
