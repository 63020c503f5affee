"""The demo model through transformers' auto classes, loaded once per session (fp32: exact comparisons)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers, peft) is not installed")

import kimik3  # noqa: E402
import kimik3.hf  # noqa: E402, F401  (registers kimi_k3)
from kimik3.presets import DEMO_MODEL  # noqa: E402


@pytest.fixture(scope="session")
def hf_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(DEMO_MODEL, dtype=torch.float32)


@pytest.fixture(scope="session")
def k3_model():
    return kimik3.load(DEMO_MODEL, dtype=torch.float32, quiet=True).eval()


@pytest.fixture(scope="session")
def hf_tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEMO_MODEL)


@pytest.fixture(scope="session")
def demo_tok():
    from kimik3.tokenizer import Tokenizer

    return Tokenizer.from_file(DEMO_MODEL)
