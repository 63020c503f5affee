"""kimik3: Kimi K3 in readable, exact, fast PyTorch."""

from kimik3.config import K3Config

__all__ = ["K3Config"]
__version__ = "0.1.0"
