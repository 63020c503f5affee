"""Suffix decoding: proposes the copy on copy-heavy text, little on random text, and indexes incrementally."""

import random

import pytest

from kimik3.inference.spec import Proposer, SuffixConfig, SuffixProposer, SuffixTrie


def _drafts(prop: SuffixProposer, prompt: list[int], output: list[int], k: int) -> list[int]:
    """Greedy 'decode' of `output` after `prompt`: the number of draft tokens that match the output at each step."""
    prop.observe(0, prompt)
    ids, hits, i = list(prompt), [], 0
    while i < len(output):
        draft = prop.propose(0, ids, k).tokens
        n = 0
        while n < len(draft) and i + n < len(output) and draft[n] == output[i + n]:
            n += 1
        step = output[i:i + n + 1]  # the accepted drafts + the target's own next token
        hits.append(n)
        prop.observe(0, step)
        ids += step
        i += len(step)
    prop.finish(0)
    return hits


def test_is_a_proposer():
    assert isinstance(SuffixProposer(), Proposer)


def test_editing_a_given_text_proposes_the_copy():
    rng = random.Random(0)
    text = [rng.randrange(1000) for _ in range(300)]
    edited = text[:100] + [5, 6, 7] + text[100:250] + text[260:]  # an insertion and a deletion
    hits = _drafts(SuffixProposer(), text + [999], edited, k=8)
    accepted = sum(hits)
    assert accepted >= 0.85 * len(edited), (accepted, len(edited))
    assert len(hits) <= len(edited) / 6  # most steps commit several tokens


def test_random_text_proposes_little():
    rng = random.Random(1)
    prompt = [rng.randrange(5000) for _ in range(200)]
    output = [rng.randrange(5000) for _ in range(200)]
    prop = SuffixProposer()
    prop.observe(0, prompt)
    ids, proposed = list(prompt), 0
    for t in output:
        proposed += len(prop.propose(0, ids, 8).tokens)
        prop.observe(0, [t])
        ids.append(t)
    assert proposed <= 10


def test_global_outputs_serve_a_later_request():
    rng = random.Random(2)
    answer = [rng.randrange(1000) for _ in range(64)]
    prop = SuffixProposer()
    prop.observe(0, [1, 2, 3])
    prop.observe(0, answer)
    prop.finish(0)
    prop.observe(1, [4, 5] + answer[:4])
    assert list(prop.propose(1, [4, 5] + answer[:4], 8).tokens) == answer[4:12]
    solo = SuffixProposer(SuffixConfig(global_outputs=False))
    solo.observe(0, [1, 2, 3] + answer)
    solo.finish(0)
    assert solo.propose(1, [4, 5] + answer[:4], 8).tokens == ()


def test_most_frequent_continuation_and_min_prob():
    trie_text = [1, 2, 3] * 3 + [1, 2, 4]  # after (1, 2): 3 three times, 4 once
    prop = SuffixProposer(SuffixConfig(min_match=2, min_prob=0.5))
    prop.observe(0, trie_text + [1, 2])
    assert prop.propose(0, trie_text + [1, 2], 1).tokens == (3,)
    strict = SuffixProposer(SuffixConfig(min_match=2, min_prob=0.9))
    strict.observe(0, trie_text + [1, 2])
    assert strict.propose(0, trie_text + [1, 2], 1).tokens == ()


def test_appending_is_incremental_and_equals_a_rebuild():
    rng = random.Random(3)
    text = [rng.randrange(8) for _ in range(500)]
    inc = SuffixTrie(depth=12)
    for t in text:
        before = inc.num_nodes
        inc.extend([t])
        assert inc.num_nodes - before <= 12  # at most one new node per open suffix: O(depth) per token
    whole = SuffixTrie(depth=12)
    whole.extend(text)

    def dump(node, prefix=()):
        yield prefix, node.count
        for t, c in sorted(node.children.items()):
            yield from dump(c, prefix + (t,))

    assert list(dump(inc.root)) == list(dump(whole.root))
    # the count of every substring of length <= depth is its number of occurrences
    for length in (1, 3, 12):
        for start in (0, 7, 100):
            sub = text[start:start + length]
            node = inc.root
            for t in sub:
                node = node.children[t]
            occ = sum(text[i:i + length] == sub for i in range(len(text) - length + 1))
            assert node.count == occ


@pytest.mark.parametrize("kw", [dict(min_match=0), dict(max_match=40, depth=32), dict(min_prob=2.0),
                                dict(max_spec_factor=0)])
def test_config_errors_name_the_field(kw):
    with pytest.raises(ValueError, match="SuffixConfig"):
        SuffixConfig(**kw)
