"""Chunked cross-entropy equals the plain loss, in value and in gradients; the module wrapper uses it."""

from __future__ import annotations

import pytest
import torch

from kimik3.model import K3ForCausalLM
from kimik3.train.data import IGNORE_INDEX
from kimik3.train.loss import CausalLMLoss, chunked_cross_entropy, plain_cross_entropy
from tests.helpers import randomize, rel_err


@pytest.mark.parametrize("chunk", [1, 7, 64, 1024])
def test_chunked_equals_plain(chunk):
    T, D, V = 50, 16, 37
    h = torch.randn(1, T, D, requires_grad=True)
    w = (0.3 * torch.randn(V, D)).requires_grad_()
    labels = torch.randint(0, V, (1, T))
    labels[0, ::5] = IGNORE_INDEX
    plain = plain_cross_entropy(h @ w.T, labels)
    g_plain = torch.autograd.grad(plain, (h, w))
    chunked = chunked_cross_entropy(h, w, labels, chunk)
    g_chunked = torch.autograd.grad(chunked, (h, w))
    assert chunked.dtype == torch.float32 and rel_err(chunked, plain) < 1e-6
    for a, b in zip(g_chunked, g_plain):
        assert rel_err(a, b) < 1e-6


def test_bf16_logits_are_upcast():
    h, w = torch.randn(9, 16, dtype=torch.bfloat16), torch.randn(11, 16, dtype=torch.bfloat16)
    labels = torch.randint(0, 11, (9,))
    assert chunked_cross_entropy(h, w, labels, 4).dtype == torch.float32
    assert rel_err(chunked_cross_entropy(h, w, labels, 4), plain_cross_entropy(h @ w.T, labels)) < 1e-6


def test_all_ignored_is_zero_with_a_graph():
    h = torch.randn(4, 8, requires_grad=True)
    loss = chunked_cross_entropy(h, torch.randn(5, 8), torch.full((4,), IGNORE_INDEX), 2)
    loss.backward()
    assert loss.item() == 0.0 and h.grad.abs().max() == 0


def test_module_matches_model_logits(tiny_config):
    lm = randomize(K3ForCausalLM(tiny_config.text, torch.float32), seed=3)
    ids = torch.randint(0, tiny_config.text.vocab_size, (1, 24))
    labels = torch.roll(ids, -1, 1)
    cu = torch.tensor([0, 10, 24])
    wrapped = CausalLMLoss(lm, chunk_tokens=5)
    loss = wrapped(ids, labels, cu)
    loss.backward()
    g_chunked = [None if p.grad is None else p.grad.clone() for p in lm.parameters()]
    lm.zero_grad()
    ref = plain_cross_entropy(lm(ids, cu_seqlens=cu), labels)
    ref.backward()
    assert rel_err(loss, ref) < 1e-6
    for a, p in zip(g_chunked, lm.parameters()):
        assert (a is None and p.grad is None) or rel_err(a, p.grad) < 1e-5


def test_bad_chunk():
    with pytest.raises(ValueError, match="loss_chunk_tokens"):
        chunked_cross_entropy(torch.randn(2, 3), torch.randn(4, 3), torch.zeros(2, dtype=torch.long), 0)
