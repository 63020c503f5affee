import os

import pytest
import torch

# fla's Triton kernels leave `tl.dot`'s precision to Triton, which runs fp32 operands as TF32 on Hopper: measured
# on the H200, fla's fp32 KDA is 1.1e-3 to 1.8e-3 (relative) from the fp32 reference in outputs, states and
# gradients, ~1000x the fp32 rounding level, and the tiny model amplifies that to 7e-2. The fp32 tests here
# check the algorithm at fp32, so Triton's fp32 dots are IEEE in this test session (read when a kernel compiles).
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/gpu/" in str(item.fspath):
            item.add_marker(pytest.mark.gpu)
            item.add_marker(cuda)


@pytest.fixture
def poison():
    """NaN-fill a tensor the op must overwrite completely."""
    def fill(t):
        return t.fill_(float("nan"))
    return fill
