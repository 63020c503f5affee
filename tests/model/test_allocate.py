"""`allocate`: a meta-built model given memory as `to_empty` would give it (size, dtype, strides, device), without
to_empty's Python `empty_like` per tensor; modules that keep their own placement are left alone."""

import torch
from torch import nn

from kimik3.config import K3Config
from kimik3.model import K3ForConditionalGeneration
from kimik3.model.init import allocate
from kimik3.quant import pack_experts
from tests.helpers import CONFIGS


def _meta_model() -> nn.Module:
    with torch.device("meta"):
        model = K3ForConditionalGeneration(K3Config.from_file(CONFIGS / "demo.json"), torch.bfloat16)
        pack_experts(model)  # uint8 codes and scales beside the bf16 and fp32 tensors
    return model


def _layout(model: nn.Module) -> dict:
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    return {n: (t.shape, t.stride(), t.dtype, t.device, type(t)) for n, t in tensors.items()}


def test_allocate_gives_what_to_empty_gives():
    expected = _layout(_meta_model().to_empty(device="cpu"))
    got = allocate(_meta_model(), "cpu")
    assert _layout(got) == expected
    dtypes = {v[2] for v in expected.values()}
    assert {torch.bfloat16, torch.float32, torch.uint8} <= dtypes  # the case covers every kind the loader fills
    assert all(p.requires_grad for p in got.parameters())  # parameters stay parameters


def test_allocate_leaves_a_module_that_keeps_its_placement():
    class Pinned(nn.Module):  # as TieredExperts: its tensors stay where they were put
        def __init__(self):
            super().__init__()
            self.register_buffer("w", torch.empty(3, device="meta"))

        def _apply(self, fn, recurse=True):
            return self

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), Pinned())
    allocate(model, "cpu")
    assert model[0].weight.device.type == "cpu" and model[1].w.device.type == "meta"
