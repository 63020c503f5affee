"""Continuous batching with exact prefix caching of the hybrid KDA + MLA state (see engine.py)."""

from kimik3.inference.engine.config import EngineConfig, SpeculativeConfig
from kimik3.inference.engine.engine import Engine
from kimik3.inference.engine.request import Request, RequestOutput, SequenceOutput, TokenConstraint, TokenLogprob
from kimik3.inference.sampling import SamplingParams

__all__ = ["Engine", "EngineConfig", "Request", "RequestOutput", "SamplingParams", "SequenceOutput",
           "SpeculativeConfig", "TokenConstraint", "TokenLogprob"]
