"""Model architectures, registered lazily by their HF `architectures` name."""

from flotilla.services.engine.models.base import CausalLM
from flotilla.services.engine.models.registry import get_model_class, supported_architectures

__all__ = ["CausalLM", "get_model_class", "supported_architectures"]
