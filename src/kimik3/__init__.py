"""kimik3: Kimi K3 in readable, exact, fast PyTorch."""

from kimik3.config import K3Config

__all__ = ["K3Config", "load", "save"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # `load` / `save` import torch and the model; resolving them lazily keeps `import kimik3` (and the
    # torch-free config) cheap
    if name in ("load", "save"):
        from kimik3 import checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(f"module 'kimik3' has no attribute '{name}'")
