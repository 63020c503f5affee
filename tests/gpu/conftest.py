import pytest
import torch

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
