"""Model forward passes, one file per architecture, plus the loader that picks one from a GGUF."""

from .deepseek4 import DeepSeek4Config, DeepSeek4ConfigError, DeepSeek4Model, DeepSeek4State
from .loader import build_model, load_model, open_model_source, resident_experts

__all__ = [
    "DeepSeek4Config",
    "DeepSeek4ConfigError",
    "DeepSeek4Model",
    "DeepSeek4State",
    "build_model",
    "load_model",
    "open_model_source",
    "resident_experts",
]
