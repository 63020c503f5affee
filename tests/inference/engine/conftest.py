"""The engine's tests: the tiny config in fp32 on the reference ops, full forwards without a cache as the oracles
(greedy tokens and logprobs: independent of the engine, which `generate()` now is), NaN-poisoned free slots,
blocks and evicted snapshots."""

from __future__ import annotations

import pytest
import torch

from kimik3.inference import SamplingParams
from kimik3.inference.engine import Engine, EngineConfig
from kimik3.inference.spec.offline import greedy_reference
from kimik3.model import K3ForCausalLM
from tests.helpers import randomize


@pytest.fixture(scope="module")
def model(tiny_config):
    return randomize(K3ForCausalLM(tiny_config.text, torch.float32), seed=5).eval()


ENGINE_ARGS = ("eos_token_ids", "tokenizer", "model_id", "sync_tokens", "adapters")


def make_engine(model, **kw) -> Engine:
    """Small pools and chunks, snapshots on every grid point, NaN in everything freed; `kw` are EngineConfig fields
    and the Engine's own arguments (ENGINE_ARGS)."""
    args = dict(max_num_seqs=8, max_num_batched_tokens=128, max_model_len=512, block_size=16, snapshot_interval=64,
                poison=True)
    own = {k: kw.pop(k) for k in ENGINE_ARGS if k in kw}
    return Engine(model, EngineConfig(**{**args, **kw}), **own)


def greedy(max_new_tokens: int = 6, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=max_new_tokens, **kw)


def reference_tokens(model, prompts, params: SamplingParams | list[SamplingParams], eos_token_ids=()
                     ) -> list[list[int]]:
    """Greedy tokens by full forwards without a cache (`greedy_reference`), each cut after its first stop id (the
    params' stop_token_ids, and `eos_token_ids` unless ignore_eos), as the engine stops there."""
    out = []
    for prompt, p in zip(prompts, [params] * len(prompts) if isinstance(params, SamplingParams) else params):
        assert p.temperature == 0 and p.repetition_penalty == 1 and not p.logit_bias, \
            "the oracle decodes greedily from the raw logits"
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
        ids = greedy_reference(model, list(prompt), p.max_new_tokens)
        out.append(ids[: next((i + 1 for i, t in enumerate(ids) if t in stops), len(ids))])
    return out


@torch.no_grad()
def full_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), V] log-softmax of a full forward over prompt + output, at the rows predicting output."""
    ids = torch.tensor([prompt + output[:-1]])
    return model(ids)[0, len(prompt) - 1:].float().log_softmax(-1)


def random_prompts(vocab: int, lengths, generator_seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(generator_seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
