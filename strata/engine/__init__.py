"""The engine: lanes over one shared KV pool, continuous batching, sampling."""

from strata.engine.config import EngineConfig
from strata.engine.types import FinishReason, SamplingParams, StreamEvent

__all__ = ["Engine", "EngineConfig", "FinishReason", "SamplingParams", "StreamEvent"]


def __getattr__(name: str):  # Engine pulls in torch and the models: import it on first use
    if name == "Engine":
        from strata.engine.engine import Engine

        return Engine
    raise AttributeError(name)
