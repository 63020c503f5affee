"""Generation: sampling parameters, the batched sampler, and the readable static-batch generate loop."""

from kimik3.inference.generate import Completion, TokenEvent, generate, stream
from kimik3.inference.sampling import Sampler, SamplingParams

__all__ = ["Completion", "Sampler", "SamplingParams", "TokenEvent", "generate", "stream"]
