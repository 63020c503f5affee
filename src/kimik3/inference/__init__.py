"""Generation: sampling parameters, the serving engine (the one cached path), `load_engine`, and `generate()` over
it."""

from kimik3.inference.generate import Completion, TokenEvent, engine_stream, generate, stream
from kimik3.inference.load import load_engine
from kimik3.inference.sampling import SamplingParams

__all__ = ["Completion", "SamplingParams", "TokenEvent", "engine_stream", "generate", "load_engine", "stream"]
