"""The acceptance rule keeps the target's processed distribution exactly (chi-square, with negative controls)."""

import pytest
import torch

from kimik3.inference.sampling import SamplingParams
from kimik3.inference.spec import target_probs, verify

V, TRIALS = 6, 12000
# chi-square critical value, 5 degrees of freedom, p = 0.001: a correct rule fails one seed in a thousand
CRITICAL = 20.52


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    if counts[~keep].sum() > 0:  # a token the target's top-k excludes: no distribution test needed
        return float("inf")
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def _expected(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """The processed distribution computed independently of the sampler: softmax(x / T) over the top-k."""
    x = logits / temperature
    x = x.masked_fill(x < x.topk(top_k, -1).values[..., -1:], float("-inf"))
    return x.softmax(-1)


def _always_accept(d, q, logits, params, g):
    return list(d) + [int(torch.multinomial(target_probs(logits, params)[len(d)], 1, generator=g))]


def _accept_if_p_above_q(d, q, logits, params, g):
    p = target_probs(logits, params)
    for i, t in enumerate(d):
        if p[i, t] < q[i, t]:
            return list(d[:i]) + [int(torch.multinomial((p[i] - q[i]).clamp(min=0), 1, generator=g))]
    return list(d) + [int(torch.multinomial(p[len(d)], 1, generator=g))]


def _run(rule, q_KV: torch.Tensor | None, seed: int = 0):
    """TRIALS verification steps of k=2 drafts drawn from q (or a fixed deterministic draft) against fixed target
    logits; returns (counts of the first token, counts of the second token where one was produced, expected)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(123)) * 1.5
    params = SamplingParams(temperature=0.8, top_k=5, seed=seed)
    first, second = torch.zeros(V), torch.zeros(V)
    for _ in range(TRIALS):
        if q_KV is None:
            d = [0, 1]
        else:
            d = [int(torch.multinomial(q_KV[i], 1, generator=gen)) for i in range(2)]
        out = rule(d, q_KV, logits, params, gen)
        assert out[:-1] == d[:len(out) - 1]
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    return first, second, _expected(logits, 0.8, 5)


Q = torch.tensor([[0.30, 0.05, 0.25, 0.10, 0.20, 0.10], [0.10, 0.40, 0.10, 0.10, 0.10, 0.20]])


@pytest.mark.parametrize("q", [Q, None], ids=["draft-model", "deterministic"])
def test_sampling_keeps_the_target_distribution(q):
    first, second, p = _run(verify, q)
    assert _chi2(first, p[0]) < CRITICAL
    assert _chi2(second, p[1]) < CRITICAL  # given the first token is kept, the second is drawn from p_1


@pytest.mark.parametrize("rule", [_always_accept, _accept_if_p_above_q])
def test_a_wrong_rule_fails_the_same_check(rule):
    first, _, p = _run(rule, Q)
    assert _chi2(first, p[0]) > 10 * CRITICAL


def test_greedy_is_exact_match_against_argmax():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    best = logits.argmax(-1).tolist()
    greedy = SamplingParams(temperature=0)
    assert verify(best[:3], None, logits, greedy) == best
    assert verify([best[0], (best[1] + 1) % 50, best[2]], None, logits, greedy) == best[:2]
    assert verify([], None, logits[:1], greedy) == best[:1]


def test_shape_errors_name_the_argument():
    with pytest.raises(ValueError, match="target_logits"):
        verify([1, 2], None, torch.zeros(2, 10), SamplingParams(temperature=0))
    with pytest.raises(ValueError, match="draft_probs"):
        verify([1, 2], torch.zeros(2, 9), torch.zeros(3, 10), SamplingParams())
