"""The engine: requests in, one scheduled model step at a time, outputs out (engine.py's LLMEngine),
configured by config.py, checked once by rules.py, sized by sizing.py, its outputs made by output.py."""

from baton.serve.engine.config import EngineConfig
from baton.serve.engine.engine import LLMEngine

__all__ = ["EngineConfig", "LLMEngine"]
