"""FSDP2's "returned a view tensor" warning is not raised for the decoder layers, whose pass-through `blocks`
(an alias FSDP2's own post-backward function made of the input) is never written in place; other modules still
warn."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from kimik3.config import K3Config
from kimik3.distributed.parallelize import apply_fsdp
from kimik3.model import K3ForCausalLM
from kimik3.presets import resolve_config
from kimik3.train.loss import CausalLMLoss
from tests.helpers import free_port

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_decoder_layers_do_not_warn_of_views(one_rank):
    torch.manual_seed(0)
    cfg = K3Config.from_file(resolve_config("tiny")).text
    model = apply_fsdp(CausalLMLoss(K3ForCausalLM(cfg, torch.float32)))
    ids = torch.randint(0, cfg.vocab_size, (1, 24))
    with warnings.catch_warnings(record=True) as caught:  # the filters in force (apply_fsdp's included) apply
        model(ids, torch.roll(ids, -1, 1)).backward()
    assert [str(w.message) for w in caught if "returned a view tensor" in str(w.message)] == []


class _Viewer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)[:, :2]  # a view of the linear's output


def test_other_modules_returning_views_still_warn(one_rank):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    cfg = K3Config.from_file(resolve_config("tiny")).text
    apply_fsdp(CausalLMLoss(K3ForCausalLM(cfg, torch.float32)))  # installs the decoder layers' filter
    viewer = fully_shard(_Viewer())
    with warnings.catch_warnings(record=True) as caught:
        viewer(torch.randn(3, 4)).sum().backward()
    assert any("(FSDP_Viewer) returned a view tensor" in str(w.message) for w in caught)
