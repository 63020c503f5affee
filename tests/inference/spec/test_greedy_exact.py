"""Speculative greedy == non-speculative greedy, token for token, on the demo model (offline loop of full
forwards), for both proposers and several prompts; and the shipped demo drafter is accepted."""

import pytest
import torch

import kimik3
from kimik3.inference.sampling import SamplingParams
from kimik3.inference.spec import SpecStats, SuffixProposer
from kimik3.inference.spec.dspark import DSparkProposer, load_drafter
from kimik3.inference.spec.offline import greedy_reference, speculative_generate
from kimik3.presets import DEMO_DRAFTER, DEMO_MODEL
from kimik3.tokenizer import Tokenizer
from tests.helpers import rel_err

PROMPTS = ["ROMEO:\nO, she doth teach the torches to burn bright!", "KING HENRY:\nOnce more unto the breach,",
           "HAMLET:\nTo be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n"
           "The slings and arrows of outrageous fortune,\nOr to take arms against a sea of troubles,\n"
           "HAMLET:\nTo be, or not to be,"]  # the last one repeats itself: suffix decoding drafts the copy
NEW = 12


@pytest.fixture(scope="module")
def demo():
    lm = kimik3.load(DEMO_MODEL, dtype=torch.float32, text_only=True, quiet=True).language_model.eval()
    tok = Tokenizer.from_file(DEMO_MODEL / "tiktoken.model")
    prompts = [tok.encode(p) for p in PROMPTS]
    return lm, prompts, [greedy_reference(lm, p, NEW) for p in prompts]


def test_suffix_greedy_is_exact(demo):
    lm, prompts, refs = demo
    stats = SpecStats()
    prop = SuffixProposer()
    for i, (p, ref) in enumerate(zip(prompts, refs)):
        assert speculative_generate(lm, prop, p, NEW, SamplingParams(temperature=0), 6, stats=stats, seq_id=i) == ref
    assert stats.spec_decode_num_accepted_tokens > 0  # the repeated prompt is copied


def test_dspark_greedy_is_exact_and_accepts(demo):
    lm, prompts, refs = demo
    stats = SpecStats()
    prop = DSparkProposer(load_drafter(DEMO_DRAFTER), lm)
    for i, (p, ref) in enumerate(zip(prompts, refs)):
        assert speculative_generate(lm, prop, p, NEW, SamplingParams(temperature=0), 7, stats=stats, seq_id=i) == ref
    assert stats.mean_accepted_length > 1.5, stats


def test_dspark_sampling_runs_with_draft_probs(demo):
    lm, prompts, _ = demo
    g = torch.Generator().manual_seed(0)
    prop = DSparkProposer(load_drafter(DEMO_DRAFTER), lm, sample=True, temperature=0.8, generator=g)
    out = speculative_generate(lm, prop, prompts[0], 8, SamplingParams(temperature=0.8, top_k=50), 7, generator=g)
    assert len(out) == 8 and all(0 <= t < lm.config.vocab_size for t in out)


def test_a_truncated_drafter_is_one_error_naming_its_file(tmp_path):
    folder = tmp_path / "draft"
    folder.mkdir()
    for f in DEMO_DRAFTER.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100_000])
    with pytest.raises(ValueError, match=f"^{weights}: truncated: "):
        load_drafter(folder)


@pytest.mark.parametrize("sample", [False, True])
def test_drafting_several_sequences_in_one_pass_drafts_what_each_alone_drafts(demo, sample):
    """`propose_batch` (contexts of 8, 9 and 38 positions padded on the left, k = 7, 3, 5) gives each sequence the
    draft `propose` gives it alone: the same tokens greedily, and with sampling the same distributions q."""
    from kimik3.inference.spec.taps import stack_taps, tapped

    lm, prompts, _ = demo
    drafter = load_drafter(DEMO_DRAFTER)

    def taps(ids):
        with torch.no_grad(), tapped(lm, drafter.config.target_layer_ids) as found:
            lm(torch.tensor([ids[:-1]]))
        return stack_taps(found)[0]

    def proposer():
        return DSparkProposer(drafter, lm, sample=sample, generator=torch.Generator().manual_seed(0))

    items = [(i, p, k, taps(p)) for i, (p, k) in enumerate(zip(prompts, (7, 3, 5)))]
    together = proposer().propose_batch(items)
    alone = [proposer().propose(*item) for item in items]
    assert [len(d.tokens) for d in together] == [7, 3, 5]
    for a, b in zip(together, alone):
        if sample:  # the first slot's q and confidence (after the same anchor; the draws share one generator)
            assert rel_err(a.probs[0], b.probs[0]) < 1e-5 and abs(a.confidence[0] - b.confidence[0]) < 1e-5
        else:
            assert a.tokens == b.tokens
            assert rel_err(torch.tensor(a.confidence), torch.tensor(b.confidence)) < 1e-5
