"""The adapter folder read by PEFT itself: PEFT's model over the dense base computes kimik3's LoRA logits.

PEFT wraps the module tree whose names are the released ones. kimik3's own `K3ForConditionalGeneration` has that
tree, so the first test hands it to PEFT directly (PEFT needs only an nn.Module); the second runs the same check
through `kimik3.hf`'s transformers class, once that package exists (it is being built beside this one).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kimik3 import lora
from tests.helpers import rel_err
from tests.lora.conftest import load_base, logits, randomize_adapter
from tests.lora.test_apply import IDS, TARGETS

pytestmark = pytest.mark.filterwarnings("ignore:The following rank_pattern keys")  # PEFT checks target_modules only
peft = pytest.importorskip("peft", reason="PEFT (the hf extra) reads the adapter in these tests")


@pytest.fixture(scope="module", params=["per_expert", "shared_outer"])
def adapter(request, base_dir, tmp_path_factory):
    """(folder, kimik3's logits with the adapter on the packed base): rank scaling on, so rank_pattern is used."""
    model = lora.apply(load_base(base_dir), lora.LoraConfig(rank=6, alpha=12.0, targets=TARGETS,
                                                            experts=request.param, rank_scaling=True))
    randomize_adapter(model, seed=3)
    folder = lora.save(model, tmp_path_factory.mktemp("peft") / "adapter")
    return folder, logits(model, IDS)


def test_peft_reads_the_adapter_onto_kimik3_modules(base_dir, adapter):
    folder, want = adapter
    base = load_base(base_dir, packed=False)  # PEFT's ParamWrapper needs the experts as dense parameters
    wrapped = peft.PeftModel.from_pretrained(base, str(folder)).eval()
    got = logits(wrapped, IDS)
    assert rel_err(got, want) < 1e-5
    again = wrapped.merge_and_unload()  # PEFT's own merge agrees with the adapter too
    assert rel_err(logits(again, IDS), want) < 1e-5


@pytest.mark.skipif(importlib.util.find_spec("kimik3.hf") is None,
                    reason="kimik3.hf (transformers classes over kimik3's modules) is not in this tree yet")
def test_peft_reads_the_adapter_through_kimik3_hf(base_dir, adapter):
    import transformers

    import kimik3.hf  # noqa: F401  (registers the auto classes)

    folder, want = adapter
    base = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    wrapped = peft.PeftModel.from_pretrained(base, str(folder)).eval()
    with torch.no_grad():
        got = wrapped(input_ids=IDS).logits
    assert rel_err(got.float(), want) < 1e-5
