"""The backend switches (`kimik3.ops.backend`): all ops, one op, the MoE kernels; and the one rule for a fast
path's missing dependency on CUDA (an error, never a silent fall back)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kimik3.ops import backend, rmsnorm
from kimik3.ops.backend import use_backend, use_fast

CUDA_LIKE = SimpleNamespace(is_cuda=True)  # use_fast reads only where the tensor lives


def test_one_op_can_take_its_reference_while_the_others_stay_fast():
    assert use_fast(CUDA_LIKE, "rmsnorm") and use_fast(CUDA_LIKE, "kda") and use_fast(CUDA_LIKE, "moe")
    with use_backend(rmsnorm="torch"):
        assert not use_fast(CUDA_LIKE, "rmsnorm") and use_fast(CUDA_LIKE, "kda")
        with use_backend(kda="torch"):  # nested blocks add up
            assert not use_fast(CUDA_LIKE, "kda") and not use_fast(CUDA_LIKE, "rmsnorm")
        assert use_fast(CUDA_LIKE, "kda")
    with use_backend(moe="torch"):
        assert not use_fast(CUDA_LIKE, "moe") and use_fast(CUDA_LIKE, "mla")
    with use_backend("torch"):
        assert not any(use_fast(CUDA_LIKE, op) for op in (*backend.OPS, "moe"))
    assert not use_fast(torch.zeros(1), "rmsnorm")


def test_bad_switches_are_refused():
    with pytest.raises(ValueError, match="use_backend\\(rmsnrom='torch'\\): ops are"):
        with use_backend(rmsnrom="torch"):
            pass
    with pytest.raises(ValueError, match="use_backend\\(kda='fast'\\)"):
        with use_backend(kda="fast"):
            pass


def test_the_gated_norm_on_cuda_without_fla_names_the_gpu_extra(monkeypatch):
    monkeypatch.setattr(rmsnorm, "use_fast", lambda t, op: True)
    monkeypatch.setattr(rmsnorm, "has_fla", lambda: False)
    o, gate = torch.randn(2, 8), torch.randn(2, 8)
    with pytest.raises(ImportError, match=r"the gated RMSNorm on CUDA runs fla-core's kernels.*kimik3\[gpu\]"):
        rmsnorm.gated_rms_norm(o, gate, torch.ones(8), 1e-5)
