"""Speculation keeps greedy tokens in bf16 on the CPU: the shipped demo model in its checkpoint's bf16, greedy with
suffix decoding and with the shipped drafter at k = 1..7 equals greedy without speculation, token for token, at the
engine's defaults (`kimik3 generate --speculative-method draft` printed other text in bf16: the short conv's decode
op summed its taps in another order than verification rows, and eager verification rows ran the chunked KDA kernel
where decode runs the recurrent one)."""

from __future__ import annotations

import pytest
import torch

import kimik3
from kimik3.inference.engine import Engine, EngineConfig, SpeculativeConfig
from kimik3.inference.sampling import SamplingParams
from kimik3.presets import DEMO_DRAFTER, DEMO_MODEL
from kimik3.quant import relayout_experts
from kimik3.tokenizer import Tokenizer
from tests.helpers import requires_cuda

PROMPTS = ["ROMEO:", "KING HENRY:\nOnce more unto the breach,"]
PARAMS = SamplingParams(temperature=0, max_new_tokens=96, ignore_eos=True)
CONFIG = dict(max_num_seqs=1, max_model_len=512)  # one prompt, as `kimik3 generate` runs it; the rest the defaults


def _demo(device: str):
    lm = kimik3.load(DEMO_MODEL, text_only=True, quiet=True, device=device).language_model.eval()
    assert lm.lm_head.weight.dtype == torch.bfloat16  # the checkpoint's dtype, what a user gets
    relayout_experts(lm)  # as `load_engine` (kimik3 generate) does: Humming's kernels where they run
    prompts = [Tokenizer.from_file(DEMO_MODEL / "tiktoken.model").encode(p) for p in PROMPTS]
    return lm, prompts, tokens(lm, prompts, None)


@pytest.fixture(scope="module")
def demo():
    return _demo("cpu")


@pytest.fixture(scope="module")
def demo_gpu():
    return _demo("cuda")


def tokens(lm, prompts, speculative: SpeculativeConfig | None) -> list[list[int]]:
    engine = Engine(lm, EngineConfig(**CONFIG, speculative=speculative))
    return [engine.generate([p], PARAMS)[0].outputs[0].token_ids for p in prompts]


@pytest.mark.parametrize("k", [1, 3, 7, *(pytest.param(k, marks=pytest.mark.slow) for k in (2, 4, 5, 6))])
@pytest.mark.parametrize("method", ["suffix", "draft"])
def test_speculative_greedy_is_plain_greedy_in_bf16(demo, method, k):
    lm, prompts, want = demo
    cfg = SpeculativeConfig(method, str(DEMO_DRAFTER) if method == "draft" else None, k)
    assert tokens(lm, prompts, cfg) == want


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("k", range(1, 8))
@pytest.mark.parametrize("method", ["suffix", "draft"])
def test_speculative_greedy_is_plain_greedy_in_bf16_gpu(demo_gpu, method, k):
    """The same on CUDA at the engine's defaults there (CUDA graphs for decode and verification steps). On the H200
    on 2026-12-04 `kimik3 generate --prompt "ROMEO:"` printed one text with and without speculation (suffix k = 7,
    draft k = 3 and 7); this runs both prompts at every k."""
    lm, prompts, want = demo_gpu
    cfg = SpeculativeConfig(method, str(DEMO_DRAFTER) if method == "draft" else None, k)
    assert tokens(lm, prompts, cfg) == want
