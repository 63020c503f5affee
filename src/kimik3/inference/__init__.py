"""Generation: sampling parameters, the serving engine (the one cached path), and `generate()` over it."""

from kimik3.inference.generate import Completion, TokenEvent, generate, stream
from kimik3.inference.sampling import SamplingParams

__all__ = ["Completion", "SamplingParams", "TokenEvent", "generate", "stream"]
