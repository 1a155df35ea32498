"""Model forward passes, one file per architecture (`engine.loader` picks one from a GGUF).

Models talk to their routed experts only through `engine.experts.ExpertProvider`; they
never import the expert runtime.
"""

from typing import Any

from .deepseek4 import DeepSeek4Config, DeepSeek4ConfigError, DeepSeek4Model, DeepSeek4State
from .kimi_k3 import KimiK3Config, KimiK3ConfigError, KimiK3Model
from .protocol import Model, ModelConfig, ModelConfigError

# general.architecture -> (config class, model class). The classes share no base: what the
# loader calls (Config.from_metadata, the model's constructor) is the contract (protocol.py).
ARCHITECTURES: dict[str, tuple[type[Any], type[Any]]] = {
    "deepseek4": (DeepSeek4Config, DeepSeek4Model),
    "kimi-k3": (KimiK3Config, KimiK3Model),
}

__all__ = [
    "ARCHITECTURES",
    "DeepSeek4Config",
    "DeepSeek4ConfigError",
    "DeepSeek4Model",
    "DeepSeek4State",
    "KimiK3Config",
    "KimiK3ConfigError",
    "KimiK3Model",
    "Model",
    "ModelConfig",
    "ModelConfigError",
]
